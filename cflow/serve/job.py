"""One request inside the engine: what it asks for (`SamplingParams`), what it gets back (`Piece`s, then one
`Finish`), and how its tokens become text (`Detokenizer`, then `StopText`, which holds back a tail that could
still grow into a stop string).

A `Job` is created and read on the asyncio loop (`events`), and fed token by token by the engine thread, which
hands each event over with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Piece:
    """Text the client can show (may be empty while a multi-byte character or stop string is pending)."""

    text: str


@dataclass(frozen=True)
class Finish:
    """The last event of a job. reason: stop | length | cancelled | error."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


class Detokenizer:
    """Token ids -> text pieces exactly as `CompiledModel.stream` makes them; ' ID' without a tokenizer."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int]):
        self.dec = None
        if tokenizer is not None:
            from ..runtime.tokenizer import StreamDecoder

            self.dec = StreamDecoder(tokenizer, list(prompt_ids))

    def push(self, token: int) -> str:
        return self.dec.push(token) if self.dec is not None else f" {token}"


class Job:
    """One request inside the engine. Created and read on the asyncio loop, advanced by the engine thread."""

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, tokenizer=None,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.params = params
        self.loop = loop or asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the handler (client gone), read by the engine at token boundaries
        self.finished = False
        self.arrived = time.monotonic()
        self.started_at: float | None = None  # admitted to a slot
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.completion_tokens = 0
        self._detok = Detokenizer(tokenizer, self.prompt_ids)
        self._stop = StopText(params.stops)

    def cancel(self) -> None:
        self.cancelled = True

    async def events(self) -> AsyncIterator[Piece | Finish]:
        """Pieces as they come, then one Finish."""
        while True:
            ev = await self.queue.get()
            yield ev
            if isinstance(ev, Finish):
                return

    # --- engine thread --------------------------------------------------------------------------
    def _emit(self, ev) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _feed(self, token: int) -> str | None:
        """Take one generated token; returns the finish reason if the job is done."""
        if token in self.params.stop_ids:
            return "stop"
        self.completion_tokens += 1
        text, stopped = self._stop.push(self._detok.push(token))
        if text:
            self._emit(Piece(text))
        if stopped:
            return "stop"
        if self.completion_tokens >= self.params.max_tokens:
            return "length"
        return None

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        if reason in ("stop", "length") and (rest := self._stop.flush()):
            self._emit(Piece(rest))  # a tail held back for a stop string that never came: it was text
        self._emit(Finish(reason, len(self.prompt_ids), self.completion_tokens, error))
