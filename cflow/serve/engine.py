"""The serving engine: one thread owns the model and runs a scheduling loop over slots.

HTTP handlers never touch the model. They build a `Job` (prompt ids, sampling parameters) and `submit` it;
the job waits in a bounded queue (full -> `QueueFull`, a 429) until a slot is free. The engine thread loops:

    admit:   a free slot takes the next job from the queue (unless its prompt starts like one being read now:
             it then waits until that one is read and copies the shared blocks from the prefix cache)
    check:   at every token boundary a cancelled job (client gone) leaves and frees its slot
    advance: one decode step moves every slot whose prompt is read one token forward
    emit:    each token becomes text (stop strings held back until they cannot match) and goes to the
             job's event queue, read by the handler on the asyncio loop; a finished job frees its slot,
             which the next admit refills from the queue (continuous batching)
    prefill: one piece (one prefill block, a single native call) of the oldest prompt still being read
             (chunked prefill: a long prompt delays the running slots by one block per token, not by its
             whole length)

The loop is written against `Backend` (backends.py: start / prefill / advance / stop over slot numbers), so the
native step is only ever called from this thread.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass

from ..errors import CflowError
from .backends import Backend
from .job import Job


class QueueFull(CflowError):
    """The queue holds --max-queue requests already; `retry_after` estimates when a place frees up."""

    def __init__(self, waiting: int, retry_after: int):
        super().__init__(f"server busy: {waiting} requests are waiting already; retry in {retry_after} s")
        self.waiting, self.retry_after = waiting, retry_after


class EngineStopped(CflowError):
    """The engine is shutting down (or died) and takes no more requests."""


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
            metrics.watch_prefix_cache(getattr(backend, "prefix_cache", None))
            metrics.watch_backend(backend)
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

    def submit(self, job: Job, *more: Job) -> None:
        """Queue `job` (and `more`: a request's other choices, together or not at all) for a slot; QueueFull if
        --max-queue requests would wait."""
        with self._cond:
            if not self.alive:
                raise EngineStopped("the engine is not running" + (f": {self.error}" if self.error else ""))
            free = self.backend.slots - len(self._active)
            if len(self._waiting) + len(more) >= self.max_queue + max(0, free):
                if self.metrics is not None:
                    self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull(len(self._waiting), self.retry_after())  # (the condition's lock is re-entrant)
            self._waiting.append(job)
            self._waiting.extend(more)
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
                job = self._waiting[0]
                if not job.cancelled and self._held(job):
                    return  # and the jobs behind it: first come, first served
                self._waiting.popleft()
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
            job.cache_n = self._reused(slot)
            read = len(job.prompt_ids) - left - job.cache_n  # (a backend that read some in start)
            if self.metrics is not None and read > 0:
                self.metrics.prefill(read, time.perf_counter() - t0)
            with self._cond:
                self._active[slot] = job
                self._gauges()
            if left:
                self._reading[slot] = left

    def _held(self, job: Job) -> bool:
        """Should `job` wait for a prompt another slot is reading now? Yes if, once that prompt is read and kept,
        the prefix cache would give this job more whole blocks than it gives now (two requests with the same
        system prompt, the n choices of one request): it then copies them instead of reading them a second
        time. The wait is short and bounded: prompts are read oldest first, so this job's own prompt could not
        start before those ahead of it anyway, and while it waits nothing is admitted behind it, so the prompts
        it waits for are only those being read now (a cancelled or failed one stops the wait too)."""
        cache = getattr(self.backend, "prefix_cache", None)
        if cache is None or not self._reading:
            return False
        return any(cache.worth_waiting(job.prompt_ids, self._active[s].prompt_ids) for s in self._reading)

    def _reused(self, slot: int) -> int:
        reused = getattr(self.backend, "reused", None)
        return reused(slot) if reused is not None else 0

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
            job.steps += 1
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
