"""Backends: who runs the model for the engine's slots. The engine is written against `Backend` (start /
prefill / advance / stop over slot numbers); two classes implement it:

    BatchedSlots   one model loaded with max_batch=B (B >= 1): a prompt is prefilled into its KV-cache slot a
                   block at a time (`batch_start`, `batch_extend`), and one `batch_step` advances every decoding
                   slot with one pass over the weights (batched decode); a sequence decoding alone in slot 0
                   runs the single-sequence decode step, so one slot is `m.generate`'s path. With a prefix cache
                   (prefix_cache.py) a prompt's cached first blocks are copied into its slot and only the rest
                   is read. A model loaded detached (its step's threads leave the engine thread a core) runs a
                   lone sequence's next step while the engine and the HTTP side handle the token just drawn.
    StreamSlots    `CompiledModel.stream` per slot, one loaded model per slot: the fallback for several slots
                   where batched decode is not available (experts or weights on disk): the slots take turns
                   token by token, each a full weight pass; a prompt is read in one go at admission; no prefix
                   cache (the slots are separate models)

`load_backend` picks one for a number of slots. A backend is only ever called from the engine thread.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Protocol

from ..errors import CflowError
from ..runtime.kv_blocks import KVSpans
from ..runtime.workers import thread_count
from .job import Job, chooser_of
from .prefix_cache import PrefixCache, budget_bytes

SMOOTH = 0.1  # weight of the newest sample in BatchedSlots' running means of step, Chooser and guess times


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

    Optional (BatchedSlots has them; the engine reads them with getattr):
    prefix_cache:       the PrefixCache start takes prompts' first blocks from (None: off); the engine holds back
                        a request that would find more there once another slot's prompt is read
    reused(slot):       prompt tokens the slot's start took from the prefix cache (not read: not prompt tokens
                        in the metrics)
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
    once by the page cache). A step advances the active slots one after another, each a full weight pass."""

    def __init__(self, models: Sequence, speculate: str | None = None):
        if not models:
            raise CflowError("a backend needs at least one model")
        self.models = list(models)
        self.speculate = speculate
        self.slots = len(self.models)
        self._gens: dict[int, object] = {}
        self._first: dict[int, int | None] = {}

    @property
    def model(self):
        return self.models[0]

    def start(self, slot: int, job: Job) -> int:
        chooser = chooser_of(job)
        gen = self.models[slot].stream(job.prompt_ids, max_new_tokens=job.params.max_tokens, seed=job.params.seed,
                                       stop=True, speculate=self.speculate if chooser.plain else None,
                                       sampler=chooser)  # rules or logprobs: no drafting (plain decode)
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
    Sampling and stopping are `CompiledModel.stream`'s (the job's Chooser: for a plain request the same Sampler
    and seed; the same end-of-text ids), so a request's tokens are the ones `m.generate` gives for it."""

    def __init__(self, model, speculate: str | None = None, prefix_cache: PrefixCache | None = None):
        self.model = model
        self.slots = int(model.session.n_slots)
        # the prefix cache (None: off): a prompt starting with cached blocks has them copied into its slot and
        # reads only the rest; a prompt's blocks are kept when it is read, its answer's when the slot stops
        self.prefix_cache = prefix_cache
        self._spans = KVSpans(model.session) if prefix_cache is not None else None
        self._seq: dict[int, list[int]] = {}  # slot -> its prompt and the tokens drawn since (while healthy)
        self._reused: dict[int, int] = {}  # slot -> prompt tokens its start took from the prefix cache
        self.chunk = model.prefill_block  # pieces of exactly one native call: the same calls as one batch_start
        self._eos = frozenset(model.eos_ids)
        self._sampler: dict[int, object] = {}
        self._last: dict[int, int] = {}
        self._first: dict[int, int | None] = {}
        self._prompt: dict[int, tuple[list[int], int]] = {}  # slot -> (prompt ids, how many are read)
        # speculative decoding (speculate='ngram' | 'draft'): slot 0's stream drafts while it decodes alone
        # (a lone client is always in slot 0); with other slots decoding, the batched step already reads each
        # weight once for several tokens and slot 0 steps with them, drafting nothing
        self.speculate = speculate
        self._spec: dict[int, object] = {}  # slot 0 -> its Speculator
        self._ready: dict[int, list[int]] = {}  # slot 0 -> tokens a pass computed, not yet handed out
        self._left: dict[int, int] = {}  # slot -> tokens its job may still generate
        self._drafting = None  # runtime.speculate.Drafting: prompt lookup's table and costs, shared by requests
        # A detached model (load(detached=True)): slot 0's step for the token just drawn is launched before the
        # token is handed out, so the engine's and the server's work on it overlaps the step; the next advance
        # waits for its logits. True while such a step is in flight or its logits are not taken yet.
        self.detached = bool(getattr(model.session, "detached", False))
        self._ahead = False
        self.ahead_steps = self.ahead_dropped = 0  # steps launched ahead; of them, run for a token not used
        # running means (seconds) of what _next_ahead weighs a guess with: dropping a step launched on a refused
        # guess (stopped at a stage boundary on one thread, else waited for), the Chooser's call on a token not
        # guessed, the guess itself
        self._drop_s, self._sample_s, self._guess_s = 0.0, 0.0, 0.0

    def _speculator(self, job: Job):
        from ..runtime import speculate as sp

        m = self.model
        if self._drafting is None:
            self._drafting = sp.Drafting()
        drafter, spec = self._drafting.start(self.speculate, self._sampler[0], job.params.seed,
                                             m.draft and m.draft.session)
        return sp.Speculator(m.session, self._sampler[0], drafter, spec, job.prompt_ids,
                             check=lambda rows: _finite(rows, 0))

    def _sample(self, slot: int, logits) -> int | None:
        spec = self._spec.get(slot)
        if spec is not None:
            tok = spec.draw(logits)  # checks the logits itself
        else:
            _finite(logits, slot)
            tok = self._sampler[slot](logits)
        return self._emit(slot, tok)

    def start(self, slot: int, job: Job) -> int:
        self._settle()
        self._sampler[slot] = chooser_of(job)
        ids = job.prompt_ids
        reused = self._reuse(slot, ids)
        self._prompt[slot] = (ids, reused)
        self._seq[slot] = list(ids)
        self._left[slot] = job.params.max_tokens
        if self.speculate and slot == 0 and self._sampler[slot].plain:  # rules or logprobs: no drafting
            self._spec[0] = self._speculator(job)
        return len(ids) - reused

    def _reuse(self, slot: int, ids: list[int]) -> int:
        """Copy the longest cached prefix of the prompt into the slot (the slot then holds a sequence of that
        many tokens); how many tokens it gave."""
        if self.prefix_cache is None:
            return 0
        blocks = self.prefix_cache.lookup(ids)
        self._reused[slot] = self._spans.restore(slot, blocks) if blocks else 0
        return self._reused[slot]

    def reused(self, slot: int) -> int:
        """Prompt tokens the slot's job took from the prefix cache instead of reading them."""
        return self._reused.get(slot, 0)

    def prefill(self, slot: int) -> int:
        self._settle()
        ids, done = self._prompt[slot]
        piece = ids[done : done + self.chunk]
        try:
            # the first piece empties the slot's KV cache; the others (and a prompt's rest after a cached
            # prefix) continue at the slot's position
            logits = (self.model.batch_extend if done else self.model.batch_start)(piece, slot)
            done += len(piece)
            if done < len(ids):
                self._prompt[slot] = (ids, done)
                return len(ids) - done
            first = self._sample(slot, logits)
        except BaseException:
            self._seq.pop(slot, None)  # what a failed slot holds is not kept
            raise
        del self._prompt[slot]
        self._first[slot] = first
        self._keep(slot, len(ids))  # now: requests with the same prompt waiting for it can take it
        self._launch(slot, first)
        self._prepare()
        return 0

    def _launch(self, slot: int, tok: int | None) -> None:
        """Start slot 0's step for `tok` now, when it decodes alone and will ask for another token (detached
        models only): its logits wait for the next advance."""
        if (self.detached and slot == 0 and tok is not None and len(self._sampler) == 1 and not self._spec
                and self._left.get(0, 0) > 0 and slot in self._seq and not self.model.session.in_turn()):
            try:
                self.model.session.step_launch(tok)
            except Exception:  # noqa: BLE001 -- the context is full, say: the next advance's step says so
                return
            self._ahead = True
            self.ahead_steps += 1

    def _next_ahead(self) -> int | None:
        """Slot 0's next token from the step launched ahead, and the step for it launched. Under a grammar the
        step starts on the Chooser's guess (the token it forces, or the draw the grammar is then asked about)
        while the grammar does its work; a refused guess costs that step (waited for, its position written
        again), never a token: the Chooser's answer is the one the sequence gets. A draw is guessed where that
        pays: the Chooser weighs the share of its refused first draws against what a refused guess costs (the
        drop: `_drop_s`, a stage on one thread, the rest of the step on more) and what an accepted one saves (the
        Chooser's call less the guess itself)."""
        clock = time.perf_counter
        session = self.model.session
        # The step runs on the other core; this thread's core is the one the HTTP side's loop has, and both of
        # them are busy (the step's worker, and this thread's Python or its wait for the step, which spins): a
        # loop woken for the token just handed out would wait for the scheduler to preempt one of them (ms: a
        # first token 5-7 ms after the request on the bundled model, the events in bursts). Offering the core
        # now lets it write while the step computes (2-4.5 ms; docs/serving.md).
        os.sched_yield()  # (releases the interpreter lock)
        row = session.step_wait()
        t0 = clock()
        guess = getattr(self._sampler[0], "guess", None)
        g = None
        if guess is not None and self._left[0] > 1:
            g = guess(row, odds=self._drop_s / max(self._sample_s - self._guess_s, 1e-6))
            if g is not None:
                self._guess_s += SMOOTH * (clock() - t0 - self._guess_s)
        if g is None or g in self._eos:
            t1 = clock()
            tok = self._sample(0, row)
            self._sample_s += SMOOTH * (clock() - t1 - self._sample_s)
            self._launch(0, tok)
        else:
            row = row.copy()  # the step launched now writes the logits buffer
            self._launch(0, g)
            tok = self._sample(0, row)
            if tok != g:
                t1 = clock()
                self._settle()
                self._drop_s += SMOOTH * (clock() - t1 - self._drop_s)
                self._launch(0, tok)
        self._prepare()
        return tok

    def _prepare(self) -> None:
        """While slot 0's step runs ahead: the grammar's work for its next token that needs no logits."""
        prepare = getattr(self._sampler.get(0), "prepare", None) if self._ahead else None
        if prepare is not None:
            prepare()

    def _settle(self) -> None:
        """Drop a step launched ahead, before anything else uses the model (Session.step_drop: stopped early
        where it runs on one thread): slot 0's position goes back, and its token is fed again by the next step
        that has it (a batch step with the others, or its own)."""
        if self._ahead:
            self.model.session.step_drop()  # stopped early where it can be; the token is fed again later
            self._ahead = False
            self.ahead_dropped += 1

    def _keep(self, slot: int, n: int) -> None:
        """Keep the whole blocks of the slot's first n positions in the prefix cache (if it is on and the slot
        healthy)."""
        seq = self._seq.get(slot)
        if self.prefix_cache is not None and seq is not None:
            self.prefix_cache.store(seq, n, lambda lo, hi: self._spans.read(slot, lo, hi))

    def _emit(self, slot: int, tok: int) -> int | None:
        if tok in self._eos:
            return None
        self._last[slot] = tok
        self._left[slot] -= 1
        if slot in self._seq:
            self._seq[slot].append(tok)
        return tok

    def advance(self, slots: Sequence[int]) -> list[int | None | BaseException]:
        out: dict[int, int | None | BaseException] = {}
        if self._ahead and list(slots) == [0]:  # slot 0's step is running already
            if 0 in self._first:  # the prompt's first token, handed out while the step for it runs
                return [self._first.pop(0)]
            self._ahead = False
            try:
                return [self._next_ahead()]
            except Exception as e:  # noqa: BLE001 -- that sequence fails, the model stays
                self._settle()
                self._seq.pop(0, None)
                return [e]
        self._settle()
        feed = []
        for s in slots:
            if s in self._first:
                out[s] = self._first.pop(s)
            elif self._ready.get(s):
                out[s] = self._emit(s, self._ready[s].pop(0))
            else:
                feed.append(s)
        spec0 = self._spec.get(0)
        alone = feed == [0] and spec0 is not None and len(self._sampler) == 1  # no other sequence, not even one
        if alone and spec0.spec.pause:  # drafting paused: plain decode's step below
            spec0.spec.pause -= 1
        elif alone:  # decoding alone: a drafting pass
            try:
                new = self._spec[0].advance(self._last[0], max(1, self._left[0]))
                out[0], self._ready[0] = self._emit(0, new[0]), new[1:]
            except Exception as e:  # noqa: BLE001 -- that sequence fails, the model stays
                out[0] = e
                self._seq.pop(0, None)
            feed = []
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
                    self._seq.pop(s, None)
                    continue
                try:
                    out[s] = self._sample(s, row)
                except Exception as e:  # noqa: BLE001
                    out[s] = e
                    self._seq.pop(s, None)
            if feed == [0] and isinstance(out[0], int):
                self._launch(0, out[0])
                self._prepare()
        return [out[s] for s in slots]

    def stop(self, slot: int) -> None:
        if self._ahead and slot == 0:  # the step ran for a token the sequence will not use: not kept
            self._settle()
        try:
            self._stop(slot)
        finally:
            for d in (self._sampler, self._last, self._first, self._prompt, self._ready, self._left, self._seq,
                      self._reused):
                d.pop(slot, None)

    def _stop(self, slot: int) -> None:
        spec = self._spec.pop(slot, None)
        if spec is not None:
            spec.finish()
        # Keep what the slot holds for a later request: the prompt read so far or, once read, the prompt and the
        # answer (for a chat's next turn) up to the slot's position (the last token drawn is not fed yet; with
        # speculation, tokens computed ahead may not be handed out yet)
        if slot in self._prompt:
            self._keep(slot, self._prompt[slot][1])
        elif slot in self._seq:
            self._keep(slot, min(len(self._seq[slot]), int(self.model.session.slot_pos[slot])))

    def close(self) -> None:
        self._settle()
        self.model.close()


def load_backend(path: str, threads: int | None = None, slots: int = 1, speculate: str | None = None,
                 cache_mb: float | None = None, overlap: bool = True, **load_kwargs) -> Backend:
    """The backend for `slots` sequences at once: BatchedSlots over one model loaded with max_batch=slots, or,
    with experts or weights on disk and several slots (no batched decode there), StreamSlots over `slots` loaded
    models. cache_mb: the prefix cache's budget in MiB (prefix_cache.budget_bytes; None: its default, 0: off;
    not with StreamSlots). overlap: load the model detached where the step's threads leave this thread a core
    (BatchedSlots then runs a lone sequence's next step while the token just drawn is handed out; False: never).
    load_kwargs go to `cflow.load`; without kv= the KV cache type is load's 'auto' (f16
    for Q4 / Q8 weights, f32 otherwise), as `cflow run` decodes."""
    import cflow

    if slots < 1:
        raise CflowError(f"--max-batch must be >= 1, not {slots}")
    disk = load_kwargs.get("experts", "ram") == "disk" or load_kwargs.get("weights", "ram") == "disk"
    if speculate not in (None, "ngram", "draft"):
        raise CflowError(f"--speculate must be ngram or draft, not {speculate!r}")
    if speculate and disk:
        raise CflowError("--speculate checks drafts with the multi-token body, which needs the weights in RAM "
                         "(not with --experts-on-disk or --weights-on-disk)")
    if speculate == "draft" and load_kwargs.get("draft") is None:
        raise CflowError("--speculate draft needs a draft model (--draft FILE)")
    budget_bytes(cache_mb, 0, slots, None)  # a bad --cache-mb fails before the model loads
    if slots > 1 and disk:
        if cache_mb:
            raise CflowError("--cache-mb: the prefix cache copies keys and values between the slots of one "
                             "loaded model; with the disk tiers and --max-batch > 1 each slot is a model of its "
                             "own (give --cache-mb 0, or --max-batch 1)")
        return _stream_slots(path, threads, slots, speculate, load_kwargs)
    # detached when the step's threads leave the engine thread a core of its own: a lone sequence's next step
    # then runs while the engine and the HTTP side handle the token just drawn (BatchedSlots._launch). By
    # default a small model's step leaves that core (one thread fewer than the usable cores): its step is short
    # against the host's work per token, which then hides; a larger one takes every core.
    cores = len(os.sched_getaffinity(0))
    # (Not with speculation: a lone sequence drafts instead, and never launches ahead.) Under load the detached
    # step stops launching ahead and, with one thread, runs its calls on the engine's thread (runtime/workers.py
    # DetachedBackoff); a step of more threads keeps them (the barriers' Backoff is for the attached default).
    if (threads is None and overlap and not disk and not speculate and cores > 1
            and token_bytes(path) < OVERLAP_BELOW):
        threads = cores - 1
    detached = overlap and not disk and thread_count(threads) < cores
    m = cflow.load(path, threads=threads, max_batch=slots, detached=detached, **load_kwargs)
    try:
        cache = _prefix_cache(m, slots, cache_mb)
        return BatchedSlots(m, speculate, cache)
    except BaseException:
        m.close()
        raise


# Weights a token reads (token_bytes) below which the server's default threads leave the engine a core
# (load_backend): a served token's time, free text, one core for the step with the overlap against both cores
# without it, on a 2-core AMX Xeon VM (`python -m benchmarks.serve --thread-split`; docs/serving.md, "The next
# step while a token is handed out"): 2.9 MB a token 0.32x, 8.6 MB 0.72x, 22.8 MB 0.91x, 41 MB 0.96x, 485 MB
# 1.42x. Below the largest size measured to gain.
OVERLAP_BELOW = 32e6


def token_bytes(path: str) -> float:
    """The weight bytes of a file's tensor table counted per token (an expert's by its share of the routing:
    top_k / n_experts; an untied embedding whole, of which a step reads one row: an upper bound, the one
    OVERLAP_BELOW was measured with); inf where the file cannot be read (the load says why)."""
    from ..runtime.format import FileReader

    try:
        with FileReader(path) as r:
            cfg = r.header.get("config", {})
            share = cfg.get("top_k", 0) / cfg["n_experts"] if cfg.get("n_experts") else 0.0
            return float(sum(t.nbytes * (share if t.expert >= 0 else 1.0) for t in r.tensors))
    except (CflowError, OSError, KeyError, TypeError, ZeroDivisionError):
        return math.inf


def _stream_slots(path, threads, slots, speculate, load_kwargs) -> StreamSlots:
    import cflow

    models = []
    try:
        for _ in range(slots):
            models.append(cflow.load(path, threads=threads, **load_kwargs))
    except BaseException:
        for m in models:
            m.close()
        raise
    return StreamSlots(models, speculate)


def _prefix_cache(model, slots: int, cache_mb: float | None) -> PrefixCache | None:
    """The prefix cache for a loaded model (None when its budget is 0)."""
    from ..util import available_memory

    s = model.session
    budget = budget_bytes(cache_mb, KVSpans(s).nbytes(s.max_seq), slots, available_memory())
    return PrefixCache(budget) if budget > 0 else None


def _finite(logits, slot: int) -> None:
    import numpy as np

    from ..errors import RuntimeFault

    top = float(np.asarray(logits).max())  # the method: half np.max's call overhead, on every token
    if not math.isfinite(top):
        raise RuntimeFault(f"the logits of slot {slot} are not finite ({top}): the model's weights or "
                           "activations overflow")
