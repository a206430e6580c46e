"""The serving engine: one thread owns the model and runs a scheduling loop over slots.

HTTP handlers never touch the model. They build a `Job` (prompt ids, sampling parameters) and `submit` it;
the job waits in a bounded queue (full -> `QueueFull`, a 429) until a slot is free. The engine thread loops:

    admit:   a free slot takes the next job from the queue
    check:   at every token boundary a cancelled job (client gone) leaves and frees its slot
    advance: one decode step moves every slot whose prompt is read one token forward
    emit:    each token becomes text (stop strings held back until they cannot match) and goes to the
             job's event queue, read by the handler on the asyncio loop; a finished job frees its slot,
             which the next admit refills from the queue (continuous batching)
    prefill: one piece (one prefill block, a single native call) of the oldest prompt still being read
             (chunked prefill: a long prompt delays the running slots by one block per token, not by its
             whole length)

The native step is only ever called from this thread. The loop is written against `Backend` (start /
prefill / advance / stop over slot numbers); two backends implement it:

    BatchedSlots   one model loaded with max_batch=B: a prompt is prefilled into its KV-cache slot a block at
                   a time (`batch_start`, `batch_extend`), and one `batch_step` advances every decoding slot
                   with one pass over the weights (issue 9's batched decode)
    StreamSlots    `CompiledModel.stream` per slot, one loaded model per slot: with one slot, exactly
                   `m.generate`'s path (one sequence at a time behind the queue); with several, the fallback
                   where batched decode is not available (experts or weights on disk): the slots take turns
                   token by token, each a full weight pass; a prompt is read in one go at admission
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..errors import CflowError


class QueueFull(CflowError):
    """The queue holds --max-queue requests already; `retry_after` estimates when a place frees up."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"server busy: {waiting} requests are waiting already; retry in {retry_after} s")
        self.waiting, self.retry_after = waiting, retry_after


class EngineStopped(CflowError):
    """The engine is shutting down (or died) and takes no more requests."""


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


class StopText:
    """Cut the text at the first stop string; hold back a tail that could still grow into one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.pending = tuple(stops), ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is safe to show, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


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


# --- backends: who runs the model for the slots --------------------------------------------------------
class Backend(Protocol):
    """What the engine needs from the model, by slot number (0 .. slots-1). Called from the engine thread only.

    start(slot, job):   give the slot to the job; returns how many of its prompt tokens are still to be read: 0 if
                        start read the whole prompt itself, else the engine calls prefill until it returns 0
    prefill(slot):      read the next piece of the slot's prompt (one native call, at most a prefill block);
                        returns the prompt tokens still to be read
    advance(slots):     one token for each of these slots (each with its prompt read), in order: an id, None when
                        the sequence ended by itself (an end-of-text token, or the context is full), or the
                        exception it raised; a slot's first advance returns the token its prompt predicts
    stop(slot):         the slot's sequence is abandoned (finished, cancelled); the slot may be started again
    model:              the CompiledModel whose tokenizer, context and chat template requests are checked against
                        (read by the HTTP layer; only the engine thread runs it)
    """

    slots: int
    model: object

    def start(self, slot: int, job: Job) -> int: ...

    def prefill(self, slot: int) -> int: ...

    def advance(self, slots: Sequence[int]) -> list[int | None | BaseException]: ...

    def stop(self, slot: int) -> None: ...

    def close(self) -> None: ...


class StreamSlots:
    """Slots over `CompiledModel.stream`: one loaded model per slot (each its own KV cache, the weights mapped
    once by the page cache). A step advances the active slots one after another, each a full weight pass;
    with one slot this is one sequence at a time behind the queue."""

    def __init__(self, models: Sequence):
        if not models:
            raise CflowError("a backend needs at least one model")
        self.models = list(models)
        self.slots = len(self.models)
        self._gens: dict[int, object] = {}
        self._first: dict[int, int | None] = {}

    @property
    def model(self):
        return self.models[0]

    def start(self, slot: int, job: Job) -> int:
        p = job.params
        gen = self.models[slot].stream(job.prompt_ids, max_new_tokens=p.max_tokens, temperature=p.temperature,
                                       top_k=p.top_k, top_p=p.top_p, seed=p.seed, stop=True)
        self._gens[slot] = gen
        self._first[slot] = next(gen, None)  # prefill and the first token, so that start is the prompt's time
        return 0  # `stream` reads the prompt in one go (the disk tiers read it token by token anyway)

    def prefill(self, slot: int) -> int:
        return 0

    def advance(self, slots: Sequence[int]) -> list[int | None | BaseException]:
        out: list[int | None | BaseException] = []
        for s in slots:
            if s in self._first:
                out.append(self._first.pop(s))
                continue
            try:
                out.append(next(self._gens[s], None))
            except Exception as e:  # noqa: BLE001 -- handed to the engine, which fails that job only
                out.append(e)
        return out

    def stop(self, slot: int) -> None:
        self._first.pop(slot, None)
        gen = self._gens.pop(slot, None)
        if gen is not None:
            gen.close()

    def close(self) -> None:
        for s in list(self._gens):
            self.stop(s)
        for m in self.models:
            m.close()


class BatchedSlots:
    """Slots of one model loaded with max_batch=B (each slot its own KV cache and position): `prefill` reads a
    prompt into its slot one prefill block per call (chunked prefill: the engine interleaves the pieces with
    decode steps), `advance` runs one `batch_step` over every given slot that has a token to feed (or, when
    slot 0 is the only one, the single-sequence decode step, which is faster for one token).
    Sampling and stopping are `CompiledModel.stream`'s (the same Sampler, seed and end-of-text ids), so a
    request's tokens are the ones `m.generate` gives for it."""

    def __init__(self, model):
        self.model = model
        self.slots = int(model.session.n_slots)
        self.chunk = model.prefill_block  # pieces of exactly one native call: the same calls as one batch_start
        self._eos = frozenset(model.eos_ids)
        self._sampler: dict[int, object] = {}
        self._last: dict[int, int] = {}
        self._first: dict[int, int | None] = {}
        self._prompt: dict[int, tuple[list[int], int]] = {}  # slot -> (prompt ids, how many are read)

    def _sample(self, slot: int, logits) -> int | None:
        import numpy as np

        from ..errors import RuntimeFault

        top = float(np.max(logits))
        if not math.isfinite(top):
            raise RuntimeFault(f"the logits of slot {slot} are not finite ({top}): the model's weights or "
                               "activations overflow")
        tok = self._sampler[slot](logits)
        if tok in self._eos:
            return None
        self._last[slot] = tok
        return tok

    def start(self, slot: int, job: Job) -> int:
        from ..runtime.sampling import Sampler

        p = job.params
        self._sampler[slot] = Sampler(p.temperature, p.top_k, p.top_p, p.seed)
        self._prompt[slot] = (job.prompt_ids, 0)
        return len(job.prompt_ids)

    def prefill(self, slot: int) -> int:
        ids, done = self._prompt[slot]
        piece = ids[done : done + self.chunk]
        # the first piece empties the slot's KV cache; the others continue at the slot's position
        logits = (self.model.batch_extend if done else self.model.batch_start)(piece, slot)
        done += len(piece)
        if done < len(ids):
            self._prompt[slot] = (ids, done)
            return len(ids) - done
        del self._prompt[slot]
        self._first[slot] = self._sample(slot, logits)
        return 0

    def advance(self, slots: Sequence[int]) -> list[int | None | BaseException]:
        out: dict[int, int | None | BaseException] = {}
        feed = []
        for s in slots:
            if s in self._first:
                out[s] = self._first.pop(s)
            else:
                feed.append(s)
        if feed:
            try:
                if feed == [0]:
                    # One sequence decoding, in slot 0 (the engine gives a request the lowest free slot, so a
                    # lone client always lands there): the single-sequence decode step, which uses slot 0's KV
                    # cache and position, computes bit for bit what a one-slot batch_step does
                    # (tests/runtime/test_batch.py) without the multi-token program's per-call work (token,
                    # slot and position bindings, the block loops). A lone sequence in another slot still goes
                    # through batch_step: the decode step has no slot parameter.
                    rows = [self.model.session.step(self._last[0])]
                else:
                    rows = self.model.batch_step([self._last[s] for s in feed], feed)
            except Exception as e:  # noqa: BLE001 -- the step failed: every sequence in it fails, the model stays
                rows = [e] * len(feed)
            for s, row in zip(feed, rows):
                if isinstance(row, BaseException):
                    out[s] = row
                    continue
                try:
                    out[s] = self._sample(s, row)
                except Exception as e:  # noqa: BLE001
                    out[s] = e
        return [out[s] for s in slots]

    def stop(self, slot: int) -> None:
        for d in (self._sampler, self._last, self._first, self._prompt):
            d.pop(slot, None)

    def close(self) -> None:
        self.model.close()


def load_backend(path: str, threads: int | None = None, slots: int = 1, **load_kwargs) -> Backend:
    """The backend for `slots` sequences at once: one sequence -> StreamSlots over one model (m.generate's path);
    several -> BatchedSlots over one model loaded with max_batch=slots, or, with experts or weights on disk
    (no batched decode there), StreamSlots over `slots` loaded models. load_kwargs go to `cflow.load`; without
    kv= the KV cache type is load's 'auto' (f16 for Q4 / Q8 weights, f32 otherwise), as `cflow run` decodes."""
    import cflow

    if slots < 1:
        raise CflowError(f"--max-batch must be >= 1, not {slots}")
    disk = load_kwargs.get("experts", "ram") == "disk" or load_kwargs.get("weights", "ram") == "disk"
    if slots > 1 and not disk:
        return BatchedSlots(cflow.load(path, threads=threads, max_batch=slots, **load_kwargs))
    models = []
    try:
        for _ in range(slots):
            models.append(cflow.load(path, threads=threads, **load_kwargs))
    except BaseException:
        for m in models:
            m.close()
        raise
    return StreamSlots(models)


# --- the engine -------------------------------------------------------------------------------------------
@dataclass
class EngineStats:
    waiting: int
    active: int
    slots: int
    alive: bool
    served: int = 0


class Engine:
    """The scheduling loop over a backend's slots, in one thread of its own."""

    def __init__(self, backend: Backend, max_queue: int = 64, metrics=None, name: str = "cflow-engine"):
        if max_queue < 0:
            raise CflowError(f"--max-queue must be >= 0, not {max_queue}")
        self.backend = backend
        self.max_queue = max_queue
        self.metrics = metrics
        self._waiting: collections.deque[Job] = collections.deque()
        self._active: dict[int, Job] = {}  # slot -> its job, prompt being read or decoding
        self._reading: dict[int, int] = {}  # slots still reading their prompts (oldest first) -> tokens left
        self._cond = threading.Condition()
        self._stopping = False
        self._served = 0
        self._mean_seconds = 1.0  # running mean of the time a request holds a slot (for Retry-After)
        self.error: BaseException | None = None
        if metrics is not None:
            metrics.slots.set(backend.slots)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- any thread -------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def stats(self) -> EngineStats:
        with self._cond:
            return EngineStats(len(self._waiting), len(self._active), self.backend.slots, self.alive, self._served)

    def retry_after(self) -> int:
        """Seconds until a queue place is likely free: waiting requests x mean duration / slots."""
        with self._cond:
            waiting = len(self._waiting)
        est = (waiting + 1) * self._mean_seconds / max(1, self.backend.slots)
        return int(min(60, max(1, math.ceil(est))))

    def submit(self, job: Job) -> None:
        """Queue `job` for a slot; QueueFull if --max-queue requests wait already."""
        with self._cond:
            if not self.alive:
                raise EngineStopped("the engine is not running" + (f": {self.error}" if self.error else ""))
            free = self.backend.slots - len(self._active)
            if len(self._waiting) >= self.max_queue + max(0, free):
                if self.metrics is not None:
                    self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull(len(self._waiting), self.retry_after())  # (the condition's lock is re-entrant)
            self._waiting.append(job)
            self._gauges()
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: a waiting job leaves the queue now, a running one at its next token boundary."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return  # running (the engine drops it) or done
            self._gauges()
        self._done(job, "cancelled")

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking requests, end the ones in flight (error 'server shutting down'), join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self.backend.close()

    # --- the engine thread ------------------------------------------------------------------------
    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue.set(len(self._waiting))
            self.metrics.active.set(len(self._active))

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._waiting and not self._active:
                        self._cond.wait(0.5)
                    if self._stopping:
                        break
                self._admit()
                self._drop_cancelled()
                self._step()
                self._prefill()
        except BaseException as e:  # a bug: fail everything in flight, /health turns 503
            self.error = e
            raise
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            jobs = list(self._waiting) + list(self._active.values())
            self._waiting.clear()
            slots = list(self._active)
            self._active.clear()
            self._reading.clear()
            self._gauges()
        for s in slots:
            try:
                self.backend.stop(s)
            except Exception:  # noqa: BLE001 -- shutting down anyway
                pass
        for job in jobs:
            job._finish("error", "server shutting down")

    def _admit(self) -> None:
        while True:
            with self._cond:
                free = [s for s in range(self.backend.slots) if s not in self._active]
                if not free or not self._waiting:
                    return
                job = self._waiting.popleft()
                self._gauges()
            if job.cancelled:
                self._done(job, "cancelled")
                continue
            slot = free[0]  # the lowest: a lone request gets slot 0, where BatchedSlots uses the decode step
            job.started_at = time.monotonic()
            t0 = time.perf_counter()
            try:
                left = self.backend.start(slot, job) or 0
            except Exception as e:  # noqa: BLE001 -- that request fails; the model stays usable
                self.backend.stop(slot)
                self._done(job, "error", str(e))
                continue
            if self.metrics is not None and left < len(job.prompt_ids):  # (a backend that read it in start)
                self.metrics.prefill(len(job.prompt_ids) - left, time.perf_counter() - t0)
            with self._cond:
                self._active[slot] = job
                self._gauges()
            if left:
                self._reading[slot] = left

    def _drop_cancelled(self) -> None:
        for slot, job in list(self._active.items()):
            if job.cancelled:
                self._release(slot, "cancelled")

    def _prefill(self) -> None:
        """Chunked prefill: one piece (one native call) of the oldest prompt still being read. Between two
        decode steps the running slots so wait for at most one prefill block, not for a whole long prompt."""
        if not self._reading:
            return
        slot, before = next(iter(self._reading.items()))
        t0 = time.perf_counter()
        try:
            left = self.backend.prefill(slot)
        except Exception as e:  # noqa: BLE001 -- that request fails; the model stays usable
            self._release(slot, "error", str(e) or type(e).__name__)
            return
        if self.metrics is not None:
            self.metrics.prefill(before - left, time.perf_counter() - t0)
        if left:
            self._reading[slot] = left
        else:
            del self._reading[slot]

    def _step(self) -> None:
        """One decode step for every slot whose prompt is read."""
        slots = [s for s in self._active if s not in self._reading]
        if not slots:
            return
        t0 = time.perf_counter()
        out = self.backend.advance(slots)
        dt = time.perf_counter() - t0
        now = time.monotonic()
        decoded = 0
        for slot, tok in zip(slots, out):
            job = self._active[slot]
            if isinstance(tok, BaseException):
                self._release(slot, "error", str(tok) or type(tok).__name__)
                continue
            if tok is None:  # end of text (the context cannot be full: the handler checked max_tokens)
                self._release(slot, "stop" if job.completion_tokens < job.params.max_tokens else "length")
                continue
            if job.first_token_at is None:
                job.first_token_at = now
                if self.metrics is not None:
                    self.metrics.ttft.observe(now - job.arrived)
            else:
                decoded += 1
                if self.metrics is not None:
                    self.metrics.itl.observe(now - job.last_token_at)
            job.last_token_at = now
            if self.metrics is not None:
                self.metrics.generation_tokens.inc()
            reason = job._feed(tok)
            if reason is not None:
                self._release(slot, reason)
        if self.metrics is not None and decoded:
            self.metrics.decode(decoded, dt)

    def _release(self, slot: int, reason: str, error: str | None = None) -> None:
        job = self._active.get(slot)
        self._reading.pop(slot, None)
        try:
            self.backend.stop(slot)
        finally:
            with self._cond:
                self._active.pop(slot, None)
                self._gauges()
            if job is not None:
                self._done(job, reason, error)

    def _done(self, job: Job, reason: str, error: str | None = None) -> None:
        job._finish(reason, error)
        with self._cond:
            self._served += 1
            if reason in ("stop", "length") and job.started_at is not None:
                took = time.monotonic() - job.started_at
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * took
        if self.metrics is not None:
            self.metrics.requests.labels(reason).inc()
            if job.last_token_at is not None:
                self.metrics.duration.observe(job.last_token_at - job.arrived)
