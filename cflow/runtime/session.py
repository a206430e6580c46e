"""A loaded model: the mapped file, validated tensors, the compiled step, KV cache positions and the disk tiers.

Load order (nothing reaches native code before it is checked):
  1. FileReader maps the file and validates its structure (magic, tables, bounds, overlaps).
  2. The header's config is rebuilt into the IR, lowered again, and the packing plan and schedule
     must equal the header's; every tensor must exist with the planned dtype, shape and byte size.
  3. The step is emitted for the host ISA and JIT-compiled, or loaded from the object cache (NativeStep).
  4. Buffers are allocated and the pointer table is filled (NativeStep.bind); only then may the step run.

The Session keeps what the user sees (the options, the plan, each slot's position) and drives the step: one
native call per token or prompt block, or, with experts or weights on disk, one per segment (segments.py).
"""

from __future__ import annotations

import os

import numpy as np

from ..codegen.abi import Mode, Param
from ..errors import CflowError, FormatError, RuntimeFault
from ..ir.config import ModelConfig
from ..passes.pipeline import plan_from_header
from ..passes.schedule import build_schedule
from .detached import DetachedSteps
from .disk_steps import DiskSteps
from .format import FileReader
from .format.folios import mend_folios_enabled
from .format.header import check_header, check_plan, stale_file_error
from .memory_estimate import allocating, check_load, fit_max_ram, lookup_tensors, memory_parts
from .native_step import NativeStep
from .options import KV_AUTO as KV_AUTO  # `X as X`: re-exported, other modules import these from here
from .options import MAX_BATCH as MAX_BATCH
from .options import MAX_THREADS as MAX_THREADS
from .options import check_options, context_length, resolve_kv, tokens_per_call
from .segments import Segment as Segment
from .segments import read_dense
from .workers import OversubscribedWarning as OversubscribedWarning
from .workers import parked_workers as parked_workers
from .workers import thread_count


def _on_native(name: str, doc: str | None = None) -> property:
    """An attribute of the session's NativeStep, read (and set) through the session."""
    return property(lambda self: getattr(self.native, name), lambda self, v: setattr(self.native, name, v), doc=doc)


class Session(DetachedSteps, DiskSteps):
    """Everything needed to run decode steps of one compiled file."""

    # the compiled step's parts, where other code reads them from the session
    program = _on_native("program", "The StepProgram: the emitted IR and the binding table.")
    library = _on_native("library")
    target = _on_native("target")
    tuning = _on_native("tuning")
    pools = _on_native("pools")
    kv = _on_native("kv", "The KV cache of every slot (f16 / bf16 entries as their bits).")
    cos = _on_native("cos")
    sin = _on_native("sin")
    scratch = _on_native("scratch")
    params = _on_native("params")
    barrier = _on_native("barrier")
    prof = _on_native("prof")
    expert_rows = _on_native("expert_rows")
    ptrs = _on_native("ptrs")
    logits_view = _on_native("logits_view")
    _pool = _on_native("workers")
    _backoff = _on_native("backoff")

    def __init__(self, path: str, threads: int | None = None, verify: bool = False, max_seq: int | None = None,
                 cache=None, profile: bool = False, experts: str = "ram", expert_cache_mb: float | None = None,
                 expert_io: str = "async", weights: str = "ram", read_ahead: int = 2, prefill_block: int = 64,
                 max_batch: int = 1, kv: str = "auto", activations: str = "q8", max_ram_mb: float | None = None,
                 guess_routes: bool = True, detached: bool = False):
        check_options(threads, max_seq, experts, weights, expert_io, read_ahead, kv, activations)
        self.activations = activations  # the quantised activations' format (layout.quant.ACT_FORMATS)
        if max_ram_mb is not None and not (isinstance(max_ram_mb, (int, float)) and max_ram_mb > 0):
            raise CflowError(f"max_ram must be a number of MiB > 0, not {max_ram_mb!r}")
        if max_ram_mb is not None and expert_cache_mb is not None:
            raise CflowError("max_ram sizes the expert cache: give max_ram or expert_cache_mb, not both")
        self.max_ram = None if max_ram_mb is None else int(max_ram_mb * 2**20)
        self.guess_routes = guess_routes  # experts on disk: start the next layer's reads on a guess (route_guess.py)
        self.experts, self.expert_io, self.weights, self.read_ahead = experts, expert_io, weights, read_ahead
        self.native: NativeStep | None = None
        self.tier = None
        self.streamer = None
        self._dense_fd = None
        self.path = str(path)
        self.reader = FileReader(self.path)
        if verify:
            self.reader.verify()
        h = self.reader.header
        self.header = h
        try:
            check_header(self.reader)  # every field typed and bounded, the plan's size against the file
            self.compiled = plan_from_header(h, self.path)  # the plan the header claims, re-derived
            self.tile = self.compiled.tile
            self.config: ModelConfig = self.compiled.graph.config
            self._check_plan()
        except FormatError as e:  # from another cflow: say so (recompile), not "does not match"
            raise stale_file_error(h, self.path, e) or e from None
        self.kv_dtype = resolve_kv(kv, h["quant"])  # 'auto' by the weights' type (KV_AUTO)
        self.threads = thread_count(threads)
        self.max_seq = context_length(max_seq, self.config)
        self.profile = profile
        # every step thread a worker, so that step_launch returns while the step runs (RAM-resident weights only:
        # the disk tiers' calls interleave with reads the caller issues)
        self.detached = bool(detached)
        self.n_slots = max_batch  # sequences with their own KV cache; slot 0 is the single-sequence API's
        if self.max_ram is not None:
            experts, weights = fit_max_ram(self, experts, weights, prefill_block)
        self._set_tiers(experts, weights, prefill_block)
        if self.detached and self.segmented:
            raise CflowError("detached steps need the weights in RAM (not with experts or weights on disk)")
        self.slot_pos = np.zeros(max_batch, np.int64)  # next position of each slot
        # Slots holding a sequence: set by prefill (and step, for slot 0), cleared by reset and release.
        # step_batch refuses the others, so a slot never started, or reused after release, is one clear error
        # instead of silently decoding on top of whatever (or nothing) its KV cache holds.
        self.slot_open = np.zeros(max_batch, bool)
        check_load(self, expert_cache_mb)  # before anything is compiled or allocated
        self.tier_tensors: set[str] = set()
        self.streamed: set[str] = set()
        with allocating(self):  # an allocation failing all the same: one CflowError
            self._build(cache, adaptive=threads is None)
            if self.segmented:
                self._open_disk(expert_cache_mb)
            # Decode reads the mapped file whole every token: parts cached in small folios go back to disk once,
            # to come back in 2 MiB ones (format/folios.py; CFLOW_FOLIOS=keep leaves the page cache as it is).
            self.folios = self.reader.mend_folios() if not self.segmented and mend_folios_enabled() else None
            self.native.bind(self._tensor)

    # --- where the weights live -----------------------------------------------------------------
    def _set_tiers(self, experts: str, weights: str, prefill_block: int) -> None:
        """The run state for experts / weights in RAM or on disk, and the tokens per native call it allows."""
        self.run_state = self.compiled
        has_experts = any(t.expert >= 0 for t in self.compiled.tensors.values())
        if weights == "disk" and has_experts:
            experts = "disk"  # a model streamed from disk keeps its experts there too
        if experts == "disk":
            if not has_experts:
                raise CflowError(f"{self.path}: --experts-on-disk: this model has no experts")
            # The schedule for the disk tier: routes split off, experts as late as their injection allows.
            self.run_state = self.compiled.evolve(schedule=build_schedule(self.compiled.graph, self.tile,
                                                                          experts_late=True))
        self.experts, self.weights = experts, weights
        self.segmented = experts == "disk" or weights == "disk"
        self.lookup_tensors = lookup_tensors(self.compiled)  # kept mapped when segmented (_tensor)
        self.tmax = tokens_per_call(prefill_block, self.n_slots, self.max_seq, self.segmented)

    # --- validation -----------------------------------------------------------------------------
    def _check_plan(self) -> None:
        check_plan(self.reader, self.compiled)

    def memory_parts(self, expert_cache_mb: float | None = None, cache_default: bool = False) -> dict[str, int]:
        """Bytes loading allocates, by part (memory_estimate.memory_parts for this load's options)."""
        return memory_parts(self.compiled, self.run_state, tmax=self.tmax, max_seq=self.max_seq,
                            n_slots=self.n_slots, kv=self.kv_dtype, threads=self.threads, weights=self.weights,
                            activations=self.activations, expert_io=self.expert_io, cache_default=cache_default,
                            experts=self.experts, read_ahead=self.read_ahead, expert_cache_mb=expert_cache_mb)

    # --- native code ----------------------------------------------------------------------------
    def _build(self, cache, adaptive: bool = False) -> None:
        self.native = NativeStep(self.run_state, self.header, max_seq=self.max_seq, tmax=self.tmax, kv=self.kv_dtype,
                                 activations=self.activations, n_slots=self.n_slots, threads=self.threads,
                                 profile=self.profile, segmented=self.segmented, adaptive=adaptive, cache=cache,
                                 detached=self.detached)

    def _tensor(self, name: str) -> np.ndarray | None:
        """A tensor binding's array: mapped from the file, or read into RAM when segmented (of the file only an
        untied embedding stays mapped: a step reads a row of it per token, and the kernel keeps or drops those
        pages as memory allows); None for one on disk, pointed at when chosen (experts) or read (streamed)."""
        if name in self.tier_tensors or name in self.streamed:
            return None
        if self.segmented and name not in self.lookup_tensors:
            return read_dense(self._dense_fd, self.reader, self.path, name)
        return self.reader.tensor(name)

    def _solo(self) -> bool:
        """Run the next call (the disk tiers: the next token's calls) on the caller's thread alone?"""
        return self.native.solo()

    def _run_native(self, solo: bool | None = None) -> None:
        self.native.run(solo)

    @property
    def solo_calls(self) -> int:
        """Native calls run on one thread because workers were descheduled: the default thread count's (Backoff),
        a detached one-thread step's calls in turn (DetachedBackoff)."""
        return self.native.solo_calls

    @property
    def backoffs(self) -> int:
        """Times the step backed off under load (the default thread count's Backoff or a detached step's
        DetachedBackoff), each for a while (their solo_calls ran then)."""
        return self.native.backoffs

    # --- running ----------------------------------------------------------------------------------
    @property
    def pos(self) -> int:
        """Next position of slot 0 (the single-sequence API)."""
        return int(self.slot_pos[0])

    @pos.setter
    def pos(self, value: int) -> None:
        self.slot_pos[0] = value

    @property
    def barrier_naps(self) -> int:
        """Times a thread waiting at a stage barrier stopped spinning and slept (BarrierWord.NAPS, counted since
        load): about zero on a quiet machine, growing when a worker is descheduled (benchmarks/load.py)."""
        return self.native.barrier_naps

    def reset(self, slot: int | None = None) -> None:
        """Empty every sequence (or one slot): its next token goes to position 0."""
        self.native.wait()
        if slot is None:
            self.slot_pos[:] = 0
            self.slot_open[:] = False
        else:
            self._check_slot(slot)
            self.slot_pos[slot] = 0
            self.slot_open[slot] = False
        self._reset_io()

    def step(self, token: int) -> np.ndarray:
        """Run one token at the current position; returns (a view of) the logits [vocab]."""
        self._set_token(token)
        if not self.segmented:
            self._run_native()
        else:
            try:
                self._step_segments()
            except BaseException:
                self._reset_io()  # the model stays usable: no pins left, failed reads forgotten
                raise
        self.pos += 1
        self.slot_open[0] = True
        return self.native.logits_view

    def _set_token(self, token) -> None:
        """The decode step's parameters for `token` at slot 0's position (after any step in flight is done)."""
        self.native.wait()
        token = int(token)
        if not 0 <= token < self.config.vocab_size:
            raise RuntimeFault(f"token id {token} out of range 0..{self.config.vocab_size - 1}")
        if not 0 <= self.pos < self.max_seq:
            raise RuntimeFault(f"context full: position {self.pos} reaches the maximum of {self.max_seq} tokens"
                               if self.pos >= 0 else f"position {self.pos} is below 0")
        self.native.params[Param.TOKEN], self.native.params[Param.POS] = token, self.pos

    def resume(self, slot: int, pos: int) -> None:
        """Start a sequence in slot `slot` whose first `pos` positions are already in its KV cache (written there
        by kv_blocks from another sequence with the same first tokens): its next token goes to position `pos`."""
        self.reset(slot)
        if not 0 < pos < self.max_seq:
            raise RuntimeFault(f"resume at position {pos}: must be in 1..{self.max_seq - 1}")
        self.slot_pos[slot] = pos
        self.slot_open[slot] = True

    def release(self, slot: int) -> None:
        """Mark slot `slot` free: its sequence is over; step_batch refuses it until a prefill starts a new one."""
        slot = self._check_slot(slot)
        self.native.wait()
        self.slot_pos[slot] = 0
        self.slot_open[slot] = False

    def check_open(self, slot: int, what: str) -> int:
        """The slot number, if slot `slot` holds a sequence; else a RuntimeFault naming `what` was refused."""
        slot = self._check_slot(slot)
        if not self.slot_open[slot]:
            raise RuntimeFault(f"{what}: slot {slot} holds no sequence (never started, or released after it "
                               "finished); start one with batch_start(prompt, slot)")
        return slot

    def _check_slot(self, slot) -> int:
        if not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.n_slots:
            raise RuntimeFault(f"slot {slot!r} out of range 0..{self.n_slots - 1} (max_batch {self.n_slots})")
        return int(slot)

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.config.vocab_size), None)
        if bad is not None:
            raise RuntimeFault(f"token id {bad} out of range 0..{self.config.vocab_size - 1}")
        return ids

    def _run_multi(self, tokens, slots, positions, logits_from: int) -> None:
        """One multi-token call: token i of slot slots[i] at positions[i]; the logits of rows logits_from on."""
        native, n = self.native, len(tokens)
        native.wait()
        native.tokens[:n], native.slots[:n], native.positions[:n] = tokens, slots, positions
        params = native.params
        params[Param.NTOK], params[Param.LOGITS_FROM], params[Param.MODE] = n, logits_from, Mode.PREFILL
        try:
            self._run_native()
        finally:
            params[Param.MODE] = Mode.DECODE

    def step_batch(self, tokens, slots) -> np.ndarray:
        """One token for each of several sequences (one slot each) in one pass over the weights.

        Returns a copy of the logits [len(slots), vocab]; each slot advances by one position.
        """
        slots = list(slots)
        if len(slots) > self.n_slots:
            raise RuntimeFault(f"batch of {len(slots)} sequences exceeds the compiled maximum max_batch={self.n_slots} "
                               "(load with a larger max_batch)")
        tokens, slots = self._check_ids(tokens), [self._check_slot(s) for s in slots]
        if not slots or len(tokens) != len(slots):
            raise RuntimeFault(f"step_batch needs one token per slot and at least one slot, got {len(tokens)} "
                               f"tokens for {len(slots)} slots")
        if len(set(slots)) != len(slots):
            raise RuntimeFault(f"step_batch: a slot appears twice in {slots}")
        for s in slots:
            self.check_open(s, "step_batch")
        full = [s for s in slots if self.slot_pos[s] >= self.max_seq]
        if full:
            raise RuntimeFault(f"context full in slot {full[0]}: position {self.slot_pos[full[0]]} reaches the "
                               f"maximum of {self.max_seq} tokens")
        n = len(slots)
        if self.tmax == 1:  # a decode-only program: slot 0, one token
            return self.step(tokens[0])[None].copy()
        self._run_multi(tokens, slots, self.slot_pos[slots], 0)
        self.slot_pos[slots] += 1
        return self.native.logits_rows(n).copy()

    def prefill(self, ids, slot: int = 0, all_logits: bool = False) -> np.ndarray:
        """Feed a prompt to a slot (default 0), up to tmax tokens per native call (each tile read once per call);
        returns a copy of the last position's logits, or with all_logits every position's [len(ids), vocab] (the
        head then runs for every token of each call: what teacher-forced scoring, cflow perplexity, needs). A
        block of 1 (or a disk tier) feeds it token by token."""
        slot = self._check_slot(slot)
        ids = self._check_ids(ids)
        if not ids:
            raise RuntimeFault("empty prompt")
        pos = int(self.slot_pos[slot])
        if pos + len(ids) > self.max_seq:
            raise RuntimeFault(f"prompt of {len(ids)} tokens does not fit the context "
                               f"({self.max_seq - pos} left of {self.max_seq})")
        rows = []
        if self.tmax == 1:
            if slot != 0:
                raise RuntimeFault(f"slot {slot}: a decode-only program (prefill_block 1) has one slot")
            out = None
            for t in ids:
                out = self.step(t)
                if all_logits:
                    rows.append(out.copy())
            return np.stack(rows) if all_logits else out.copy()
        for i in range(0, len(ids), self.tmax):
            chunk = ids[i : i + self.tmax]
            n = len(chunk)
            p = int(self.slot_pos[slot])
            self._run_multi(chunk, slot, np.arange(p, p + n), 0 if all_logits else n - 1)
            self.slot_pos[slot] += n
            self.slot_open[slot] = True
            if all_logits:
                rows.append(self.native.logits_rows(n).copy())
        return np.concatenate(rows) if all_logits else self.native.logits_row(n - 1).copy()

    def close(self) -> None:
        if getattr(self, "native", None) is not None:
            self.native.close()  # the workers stop; the buffers go with the session
        if self.tier is not None:
            self.tier.close()
            self.tier = None
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        if getattr(self, "_dense_fd", None) is not None:
            os.close(self._dense_fd)
            self._dense_fd = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
