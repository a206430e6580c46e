"""One request inside the engine: what it asks for (`SamplingParams`), what it gets back (`Piece`s, then one
`Finish`), how its next tokens are chosen (`chooser`, a runtime.choice.Chooser both backends call), and how its
tokens become text (`Detokenizer`, then `StopText`, which holds back a tail that could still grow into a stop
string).

Logprobs ride with the text their tokens made: a token whose text is held back (an incomplete UTF-8 character,
a possible stop string) has its record delivered with the piece that shows that text, or, if the text never
shows (cut by a stop string, or an incomplete character at the end), with the job's last piece, whose text may
be empty. Every generated token (usage's completion_tokens) so has exactly one record.

A `Job` is created and read on the asyncio loop (`events`, `batches`), and fed token by token by the engine
thread, which hands each event over with `call_soon_threadsafe`. A loop that fell behind the engine takes what
waits in one batch (one write to the client).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ..runtime.choice import REPETITION_WINDOW, Chooser
from ..runtime.stop_text import StopText


# --- what a request asks for and what it gets back --------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    stop_ids: frozenset = frozenset()  # tokens that end the answer unseen, like end-of-text (a chat's end of turn)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = REPETITION_WINDOW
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    logprobs: int | None = None  # None: no logprobs; N: each token's logprob and its row's N best


def make_chooser(params: SamplingParams, prompt_ids: Sequence[int], constraint=None,
                 eos_id: int | None = None) -> Chooser:
    """The Chooser of one sequence with these parameters (its repetition penalty sees the prompt)."""
    p = params
    return Chooser(p.temperature, p.top_k, p.top_p, p.seed, min_p=p.min_p, logit_bias=dict(p.logit_bias),
                   presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                   repetition_penalty=p.repetition_penalty, repetition_window=p.repetition_window,
                   prompt_ids=prompt_ids, logprobs=p.logprobs, constraint=constraint, eos_id=eos_id)


def chooser_of(job) -> Chooser:
    """The job's Chooser (a stand-in job without one, as tests make, gets one from its parameters)."""
    c = getattr(job, "chooser", None)
    return c if c is not None else make_chooser(job.params, job.prompt_ids)


@dataclass(frozen=True)
class Piece:
    """Text the client can show (may be empty while a multi-byte character or stop string is pending), and the
    logprob records (runtime.choice.TokenLogprob) of the tokens that made it, when the request asked for them."""

    text: str
    logprobs: tuple = ()


@dataclass(frozen=True)
class Finish:
    """The last event of a job. reason: stop | length | cancelled | error."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # protocol.Timings' fields, where the job had a first token (a measurement, not part of what the job gave)
    timings: dict | None = field(default=None, compare=False)


class Detokenizer:
    """Token ids -> text pieces exactly as `CompiledModel.stream` makes them; ' ID' without a tokenizer."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.dec = None
        if tokenizer is not None:
            from ..runtime.tokenizer import StreamDecoder

            self.dec = StreamDecoder(tokenizer, list(prompt_ids))

    def push(self, token: int) -> str:
        return self.dec.push(token) if self.dec is not None else f" {token}"


async def drain(queue: asyncio.Queue) -> list:
    """The next item of the queue and every one waiting behind it."""
    batch = [await queue.get()]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch


class Job:
    """One request inside the engine. Created and read on the asyncio loop, advanced by the engine thread."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, tokenizer=None,
                 loop: asyncio.AbstractEventLoop | None = None, constraint=None, eos_id: int | None = None):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.params = params
        self.chooser = make_chooser(params, self.prompt_ids, constraint, eos_id)
        self._records: list = []  # logprob records of tokens whose text is not shown yet
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the handler (client gone), read by the engine at token boundaries
        self.finished = False
        self.arrived = time.monotonic()
        self.started_at: float | None = None  # admitted to a slot
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self.steps = 0  # tokens the model gave (completion_tokens and an end-of-text token not shown)
        self.cache_n = 0  # prompt tokens its slot took from the prefix cache
        self._detok = Detokenizer(tokenizer, self.prompt_ids)
        self._stop = StopText(params.stops)

    def cancel(self) -> None:
        self.cancelled = True

    async def events(self) -> AsyncIterator[Piece | Finish]:
        """Pieces as they come, then one Finish."""
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self) -> AsyncIterator[list]:
        """The events as they come, in lists of those that arrived together (the last list ends with the
        Finish): a reader that fell behind gets everything waiting at once."""
        while True:
            batch = await drain(self.queue)
            yield batch
            if isinstance(batch[-1], Finish):
                return

    # --- engine thread --------------------------------------------------------------------------
    def _emit(self, ev) -> None:
        # one wake-up of the loop an event: the write to the loop's pipe also lets the loop's thread take the
        # interpreter lock now (an outbox that woke the loop once for what piled up did no better served, and left
        # the loop waiting for the lock's switch interval)
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _feed(self, token: int) -> str | None:
        """Take one generated token; returns the finish reason if the job is done."""
        if token in self.params.stop_ids:
            return "stop"
        self.completion_tokens += 1
        if self.params.logprobs is not None and (rec := self.chooser.take(token)) is not None:
            self._records.append(rec)
        text, stopped = self._stop.push(self._detok.push(token))
        if text:
            self._emit(Piece(text, tuple(self._records)))
            self._records = []
        if stopped:
            return "stop"
        if self.completion_tokens >= self.params.max_tokens:
            return "length"
        return None

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        if reason in ("stop", "length") and ((rest := self._stop.flush()) or self._records):
            # a tail held back for a stop string that never came was text; records of text never shown go last
            self._emit(Piece(rest, tuple(self._records)))
            self._records = []
        self._emit(Finish(reason, len(self.prompt_ids), self.completion_tokens, error, self.timings()))

    def timings(self) -> dict | None:
        """llama-server's timings of this job (protocol.Timings), once it was admitted to a slot. A job whose
        first token ended it (end of text) read its prompt until now and predicted nothing."""
        if self.started_at is None:
            return None
        read = len(self.prompt_ids) - self.cache_n
        first = self.first_token_at if self.first_token_at is not None else time.monotonic()
        prompt_ms = 1e3 * (first - self.started_at)
        predicted_ms = 1e3 * ((self.last_token_at or first) - first)
        per_token = predicted_ms / (self.steps - 1) if self.steps > 1 else 0.0
        return {"cache_n": self.cache_n, "prompt_n": read, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_token_ms": round(prompt_ms / max(1, read), 4),
                "prompt_per_second": round(1e3 * read / prompt_ms, 2) if prompt_ms > 0 else 0.0,
                "predicted_n": self.completion_tokens, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_token_ms": round(per_token, 4),
                "predicted_per_second": round(1e3 / per_token, 2) if per_token > 0 else 0.0}
