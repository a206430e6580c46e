"""A loaded model: the mapped file, validated tensors, the compiled step, buffers, KV cache and worker threads.

Load order (nothing reaches native code before it is checked):
  1. FileReader maps the file and validates its structure (magic, tables, bounds, overlaps).
  2. The header's config is rebuilt into the IR, lowered again, and the packing plan and schedule
     must equal the header's; every tensor must exist with the planned dtype, shape and byte size.
  3. The step is emitted for the host ISA and JIT-compiled (or loaded from the object cache).
  4. Buffers are allocated and the pointer table is filled; only then may the step run.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings

import attrs
import numpy as np

from ..codegen.abi import (
    BARRIER_WORDS,
    CTL_WORDS,
    KICK_SYMBOL,
    KV_BYTES,
    PARAM_WORDS,
    STEP_SYMBOL,
    WORKER_SYMBOL,
    BarrierWord,
    Binding,
    CtlWord,
    Mode,
    Param,
)
from ..errors import CflowError, FormatError, RuntimeFault
from ..ir.config import ModelConfig
from ..ir.rope import rope_tables
from ..layout import STORED
from ..layout.quant import QUANT_TARGETS
from ..layout.tile import aligned_empty
from ..passes.pipeline import plan_from_header
from ..passes.schedule import Phase, Pool, build_schedule
from .format import FileReader
from .format.folios import mend_folios_enabled
from .format.header import check_header, check_plan, stale_file_error
from .format.spec import pad

MAX_THREADS = 1024  # worker threads of one model
MAX_BATCH = 4096  # sequences decoded together (each its own KV cache)
# kv="auto": the KV cache's element type for each weight type. Measured equal in quality where f16 (the bundled
# model's perplexity, benchmarks/long_context.py --text: Q8 weights 8.3391 with an f32 cache vs 8.3397 with f16,
# Q4 8.5117 vs 8.5100; docs/journal/performance.md, "Long contexts"); f16 / f32 weights keep the exact f32 cache (not
# measured, and there the cache's rounding would be the largest error left).
KV_AUTO = {dt.label: "f16" if dt.quantised else "f32" for dt in QUANT_TARGETS} | {STORED: "f16"}  # stored: GGUF types


def resolve_kv(kv: str, quant: str) -> str:
    """The KV cache type that load(kv=...) / Session(kv=...) / --kv mean for weights of type `quant`: 'auto' is
    KV_AUTO[quant], 'f32' / 'f16' / 'bf16' (abi.KV_BYTES) are taken as given; anything else is a CflowError."""
    if kv == "auto":
        return KV_AUTO.get(quant, "f32")
    if kv not in KV_BYTES:
        raise CflowError(f"the KV cache type must be auto or one of {', '.join(KV_BYTES)}, not {kv!r}")
    return kv


def _whole(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _zeros(nbytes: int, align: int = 4096) -> np.ndarray:
    return aligned_empty(nbytes, align, zero=True)


@attrs.frozen
class Segment:
    """Stages [lo, hi) of the disk-tier schedule, run in one native call, and what the host does around it."""

    lo: int
    hi: int
    awaits: tuple[int, ...]  # layers whose chosen experts must be in RAM before the segment runs
    issues: tuple[int, ...]  # layers whose route is known after it: start their reads (async)
    releases: tuple[int, ...]  # layers whose experts are no longer needed after it


class OversubscribedWarning(UserWarning):
    """More worker threads were asked for than this process may run on (os.sched_getaffinity)."""


def _thread_count(threads: int | None) -> int:
    """The worker threads of a model: by default the cores this process may run on (its affinity mask, which
    taskset, cgroups' cpusets and container limits narrow; os.cpu_count() would count the whole machine).
    Asking for more still works (the barriers sleep instead of spinning) but every extra thread shares a core,
    so it warns; Python's default filter shows a given warning once per process."""
    usable = len(os.sched_getaffinity(0))
    if threads is None:
        return usable
    if threads > usable:
        warnings.warn(f"threads={threads} but this process may run on {usable} core{'s' * (usable != 1)} "
                      f"(os.sched_getaffinity): threads will share cores; the default is {usable}",
                      OversubscribedWarning, stacklevel=3)
    return int(threads)


def _cores_taken(threads: int) -> bool:
    """Would `threads` threads not each get a core right now? The runnable tasks other than this calling thread
    (/proc/loadavg's count includes it; the workers sleep while the backoff runs single-threaded), plus `threads`,
    against the cores this process may run on. False where it cannot be read (then the probe decides)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    return running - 1 + threads > cores


class _Backoff:
    """The default thread count under load: back off to one thread while the workers are being descheduled.

    With another process busy on a core, a stage barrier waits for a worker that is not running, once per stage,
    so the default (every usable core) decodes many times slower than one thread (docs/journal/performance.md, "Under
    load"); no spin budget fixes that (the waiter either burns the core the worker needs or pays a wake-up per
    stage). The barrier counts the waits that ended in futex_wait (BarrierWord.NAPS). NAPS such sleeps within
    WINDOW multi-threaded calls (one per call on average; a quiet host shows 0-0.6, a loaded one 1-40) mean a
    worker is being descheduled, and the calls of the next `backoff` seconds run on the caller's thread alone
    (nthreads = 1: the same arithmetic, bit-identical results; the workers stay asleep). Then multi-threaded
    calls probe again, and the first one under load usually decides at once; the backoff doubles up to MOST
    seconds while the load lasts (so probing costs little) and resets after a quiet window. In seconds, not
    calls: a call takes 50 us on a tiny model, 30 ms on a 1B one. A probe under load costs a call that naps at
    its barriers (~2-3% of a 114m decode measured over 1 s), so when a backoff ends and other tasks are runnable
    right then (`busy`: /proc/loadavg's count of runnable tasks says the threads would not each get a core),
    the probe is skipped and the backoff doubles as if it had failed; the barrier's naps stay the judge
    otherwise (a quiet moment still probes, and other tenants of a VM, invisible here, are caught as before).
    Only the default thread count adapts; an explicit `threads=N` is taken as asked."""

    WINDOW = 8  # multi-threaded calls per probe window
    NAPS = 8  # barrier sleeps in a window that mean descheduled workers
    # Seconds on one thread after a failed window, doubling from FIRST up to MOST. FIRST is short because bursts
    # of other work (another job for 50 ms) also trip the window, and staying single-threaded past their end
    # costs; MOST is long because each probe under load costs a call that waits for a descheduled worker.
    FIRST, MOST = 0.02, 2.0

    def __init__(self, clock=time.perf_counter, busy=None):
        self.clock = clock
        self.busy = busy if busy is not None else (lambda: False)  # other tasks runnable now? (skip a probe)
        self.skipped = 0  # probes skipped because `busy` said so
        self.until = 0.0  # run single-threaded until this time
        self.backoff = self.FIRST
        self.calls = self.naps = 0
        self.seen = 0  # BarrierWord.NAPS after the last multi-threaded call
        self.solo_calls = 0  # calls run single-threaded since load (reported by Session.solo_calls)

    def solo(self) -> bool:
        """Run the next call on the caller's thread alone?"""
        if self.until:
            now = self.clock()
            if now >= self.until and self.busy():  # the load is still there: skip the probe, back off longer
                self.until = now + self.backoff
                self.backoff = min(2 * self.backoff, self.MOST)
                self.skipped += 1
            if now < self.until:
                self.solo_calls += 1
                return True
        self.until = 0.0
        return False

    def after(self, naps: int) -> None:
        """After a multi-threaded call: `naps` = BarrierWord.NAPS now."""
        self.naps += naps - self.seen
        self.seen = naps
        self.calls += 1
        if self.naps >= self.NAPS:  # at once, not at the window's end: under load one call already shows it
            self.until = self.clock() + self.backoff
            self.backoff = min(2 * self.backoff, self.MOST)
        elif self.calls < self.WINDOW:
            return
        else:
            self.backoff = self.FIRST
        self.calls = self.naps = 0


class Session:
    """Everything needed to run decode steps of one compiled file."""

    def __init__(self, path: str, threads: int | None = None, verify: bool = False, max_seq: int | None = None,
                 cache=None, profile: bool = False, experts: str = "ram", expert_cache_mb: float | None = None,
                 expert_io: str = "async", weights: str = "ram", read_ahead: int = 2, prefill_block: int = 64,
                 max_batch: int = 1, kv: str = "auto"):
        if experts not in ("ram", "disk"):
            raise CflowError(f"experts must be 'ram' or 'disk', not {experts!r}")
        if weights not in ("ram", "disk"):
            raise CflowError(f"weights must be 'ram' or 'disk', not {weights!r}")
        if expert_io not in ("async", "sync"):
            raise CflowError(f"expert_io must be 'async' or 'sync', not {expert_io!r}")
        resolve_kv(kv, "f32")  # a bad type fails before the file is read
        if not isinstance(read_ahead, int) or read_ahead < 0:
            raise CflowError(f"read-ahead must be a whole number of stages >= 0, not {read_ahead!r}")
        if threads is not None and (not _whole(threads) or not 1 <= threads <= MAX_THREADS):
            raise CflowError(f"threads must be a whole number in 1..{MAX_THREADS}, not {threads!r}")
        if max_seq is not None and (not _whole(max_seq) or max_seq < 1):
            raise CflowError(f"max_seq must be a whole number of tokens >= 1, not {max_seq!r}")
        self.experts, self.expert_io, self.weights, self.read_ahead = experts, expert_io, weights, read_ahead
        self.tier = None
        self.streamer = None
        self._pool = None
        self._backoff = None
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
        self.threads = _thread_count(threads)
        if max_seq is not None and max_seq > self.config.max_seq_len:
            raise CflowError(f"max_seq {max_seq} exceeds the model's context of {self.config.max_seq_len} tokens "
                             "(config.max_seq_len)")
        self.max_seq = int(max_seq or self.config.max_seq_len)
        self.profile = profile
        self.run_state = self.compiled
        has_experts = any(t.expert >= 0 for t in self.compiled.tensors.values())
        if weights == "disk" and has_experts:
            self.experts = experts = "disk"  # a model streamed from disk keeps its experts there too
        if experts == "disk":
            if not has_experts:
                raise CflowError(f"{self.path}: --experts-on-disk: this model has no experts")
            # The schedule for the disk tier: routes split off, experts as late as their injection allows.
            self.run_state = self.compiled.evolve(schedule=build_schedule(self.compiled.graph, self.tile,
                                                                          experts_late=True))
        self.segmented = experts == "disk" or weights == "disk"
        # Prompt tokens per multi-token call; the disk tiers read prompts token by token (their host logic
        # follows one token's routes), as does a block of 1.
        if not isinstance(prefill_block, int) or prefill_block < 1:
            raise CflowError(f"prefill block must be a whole number of tokens >= 1, not {prefill_block!r}")
        self.tmax = 1 if self.segmented else min(prefill_block, self.max_seq)
        if not _whole(max_batch) or not 1 <= max_batch <= MAX_BATCH:
            raise CflowError(f"max_batch must be a whole number of sequences in 1..{MAX_BATCH}, not {max_batch!r}")
        if max_batch > 1 and self.segmented:
            raise CflowError("batched decode (max_batch > 1) is not available with experts or weights on disk")
        self.n_slots = max_batch  # sequences with their own KV cache; slot 0 is the single-sequence API's
        self.tmax = max(self.tmax, max_batch) if max_batch > 1 else self.tmax
        self.slot_pos = np.zeros(max_batch, np.int64)  # next position of each slot
        # Slots holding a sequence: set by prefill (and step, for slot 0), cleared by reset and release.
        # step_batch refuses the others, so a slot never started, or reused after release, is one clear error
        # instead of silently decoding on top of whatever (or nothing) its KV cache holds.
        self.slot_open = np.zeros(max_batch, bool)
        self._check_memory(expert_cache_mb)  # before anything is compiled or allocated
        self._build(cache)
        self.tier_tensors: set[str] = set()
        self.streamed: set[str] = set()
        if self.segmented:
            self._dense_fd = os.open(self.path, os.O_RDONLY)
            self._plan_segments()
        if experts == "disk":
            self._open_tier(expert_cache_mb)
        if weights == "disk":
            self._open_streamer()
        # Decode reads the mapped file whole every token: parts cached in small folios go back to disk once, to
        # come back in 2 MiB ones (format/folios.py; CFLOW_FOLIOS=keep leaves the page cache as it is).
        self.folios = self.reader.mend_folios() if not self.segmented and mend_folios_enabled() else None
        self._alloc()
        self._pool = (_Workers(self.library, self._args, self.threads, keep=(self.ptrs, self.params, self.barrier))
                      if self.threads > 1 else None)
        self._backoff = (_Backoff(busy=lambda n=self.threads: _cores_taken(n)) if self._pool is not None
                         and threads is None else None)

    # --- validation -----------------------------------------------------------------------------
    def _check_plan(self) -> None:
        check_plan(self.reader, self.compiled)

    def _check_memory(self, expert_cache_mb: float | None) -> None:
        """What loading will allocate (KV cache, RoPE tables, per-thread scratch, buffers, weights read into RAM)
        against the memory this process may still use, before the JIT or any allocation: one error naming the
        largest part and how to shrink it."""
        from ..util import available_memory, format_bytes

        parts = self.memory_parts(expert_cache_mb)
        need, avail = sum(parts.values()), available_memory()
        if avail is not None and need > avail:
            big = max(parts, key=parts.get)
            raise CflowError(f"{self.path}: loading needs {format_bytes(need)} of memory, {format_bytes(parts[big])} "
                             f"of it for {big}, but {format_bytes(avail)} is available")

    def memory_parts(self, expert_cache_mb: float | None = None) -> dict[str, int]:
        """Bytes loading allocates, by part (what the memory check adds up). The KV cache and the scratch are
        exact, sized by codegen.abi next to the layouts they describe (ScratchLayout, Binding.KV) rather than by
        a second formula here; tests/runtime/test_memory_estimate.py checks they equal what _alloc allocates.
        The activation buffers are an upper bound."""
        from ..codegen.abi import kv_cache_bytes, scratch_layout
        from ..layout.quant import padded

        c, T, S, tc = self.config, self.tmax, self.max_seq, self.tile[1]
        widest = padded(max(c.d_model, c.ffn_dim, c.expert_dim, c.shared_expert_dim, c.n_heads * c.head_dim), tc)
        parts = {
            (f"the KV cache (config.max_seq_len={S} positions x {c.n_layers} layers"
             + (f" x max_batch={self.n_slots} sequences" if self.n_slots > 1 else "")
             + "; load with a smaller max_seq" + (" or max_batch)" if self.n_slots > 1 else ")")):
                kv_cache_bytes(c, S, self.n_slots, self.kv_dtype),
            f"the RoPE tables (config.max_seq_len={S})": S * c.head_dim * 4 * (  # a second pair: Gemma 3's local
                2 if c.local_rope_theta and any(c.is_sliding(l) for l in range(1, c.n_layers + 1)) else 1),
            f"the per-thread scratch ({self.threads} threads)":
                scratch_layout(c, self.run_state.tensors, S, T).nbytes * self.threads,
            "the activation buffers": 4 * T * (padded(c.vocab_size, 64) + 32 * widest),
        }
        tensors = self.compiled.tensors
        if self.weights == "disk":  # streamed: only what is not tiled stays in RAM, plus the read-ahead buffers
            stages = [sum(tensors[n].nbytes for st in stage for n in st.tensors if n in tensors)
                      for stage in self.run_state.schedule.stages]
            parts["the weights kept in RAM and the read-ahead buffers"] = (
                sum(t.nbytes for t in tensors.values() if t.expert < 0 and not t.form.is_tiled)
                + (self.read_ahead + 2) * max(stages, default=0))
        elif self.experts == "disk":
            parts["the non-expert weights read into RAM (--weights-on-disk streams them)"] = sum(
                t.nbytes for t in tensors.values() if t.expert < 0)
        if self.experts == "disk" and expert_cache_mb is not None and expert_cache_mb > 0:
            # the tier never allocates more slots than there are experts (ExpertTier), so neither does the estimate
            parts[f"the expert cache (--expert-cache-mb {expert_cache_mb})"] = min(
                int(expert_cache_mb * 2**20), sum(t.nbytes for t in tensors.values() if t.expert >= 0))
        return parts

    # --- native code ----------------------------------------------------------------------------
    def _build(self, cache) -> None:
        from ..codegen import attn_tune, program_cache, tune
        from ..codegen.library import Library
        from ..codegen.step import StepProgram, build_step
        from ..codegen.target import host_target

        target = self.target = host_target()  # the CPU the code is built for (CFLOW_CPU / CFLOW_FEATURES apply)
        segmented = self.segmented
        # This host's mat-vec knobs: measured by `cflow tune` and cached, else the ones shipped for this
        # microarchitecture (codegen/tune_defaults.py), else the built-in defaults; a load never searches unless
        # CFLOW_TUNE=search (CFLOW_TUNE=off: the defaults). Schedule-only: the numbers do not change.
        search = tune.search_at_load()
        geoms = attn_tune.geometries(self.compiled.graph.nodes())
        self.tuning = tune.choices(self.run_state.tensors.values(), target, search=search,
                                   budget=tune.kernel_budget(tune.BUDGET, len(geoms)) if search else None)
        # and the attention core's prefetch distance, the same way
        self.tuning.update(attn_tune.choices(geoms, self.kv_dtype, target, max_seq=self.max_seq, search=search))
        bf16_unit = target.bf16_unit if self.kv_dtype == "bf16" else ""
        fp = (program_cache.fingerprint(self.header, self.run_state.schedule.to_json(), target.isa, self.max_seq,
                                        self.profile, segmented, self.tmax, self.kv_dtype, self.tuning,
                                        bf16_unit)
              if cache is not False else None)
        hit = program_cache.load(fp) if fp else None
        self.program = None
        if hit is not None:
            try:
                self.program = StepProgram.from_meta(hit["ir"], hit["meta"])
            except (KeyError, TypeError, ValueError):
                self.program = None
        if self.program is None:
            self.program = build_step(self.run_state, target.isa, self.max_seq, profile=self.profile,
                                      segmented=segmented, tmax=self.tmax, kv=self.kv_dtype, tuning=self.tuning,
                                      bf16_unit=bf16_unit)
        ir_text = self.program.module if isinstance(self.program.module, str) else str(self.program.module)
        if fp and hit is None:
            program_cache.save(fp, ir_text, self.program.meta())
        self.library = Library(name="cflow_step", target=target, cache=cache)
        self.library.add_ir(ir_text)
        self.library.finalize()
        vp = ctypes.c_void_p
        self._fn = self.library.get_cfunc(STEP_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp)

    def _alloc(self) -> None:
        prog, cfg = self.program, self.config
        T = prog.scratch.tmax  # every pool slot holds T token rows
        self.pools = {p: _zeros(4 * prog.pool_slots.get(p, 0) * T * prog.pool_strides[p] or 64).view(np.float32)
                      for p in prog.pool_strides}
        self.tokens = np.zeros(T, np.int64)
        self.positions = np.zeros(T, np.int64)
        self.slots = np.zeros(T, np.int64)
        # f16 / bf16 entries are their bits (the generated code converts); numpy only holds and zeroes them
        self.kv = np.zeros(self.n_slots * 2 * cfg.n_layers * prog.kv_floats_per_layer,
                           np.uint16 if KV_BYTES[prog.kv] == 2 else np.float32)
        half = cfg.head_dim // 2
        # ir/rope.py: RoPE scaling and partial rotary included. Gemma 3's sliding-window layers rotate at their own
        # base: the "local" pair (BindingKey name, codegen/step.py), the model's RoPE from a layer that is not local.
        local = [l for l in range(1, cfg.n_layers + 1) if cfg.local_rope_theta and cfg.is_sliding(l)]
        other = [l for l in range(1, cfg.n_layers + 1) if l not in local]
        cos, sin = rope_tables(cfg, self.max_seq, layer=other[0] if other else 1)
        self.cos = np.ascontiguousarray(cos, np.float32).reshape(-1)
        self.sin = np.ascontiguousarray(sin, np.float32).reshape(-1)
        assert self.cos.size == self.max_seq * half
        self._rope = {"": (self.cos, self.sin)}  # name -> (cos, sin); kept alive with the session
        if local:
            lc, ls = rope_tables(cfg, self.max_seq, layer=local[0])
            self._rope["local"] = (np.ascontiguousarray(lc, np.float32).reshape(-1),
                                  np.ascontiguousarray(ls, np.float32).reshape(-1))
        self.scratch = _zeros(prog.scratch.nbytes * self.threads)
        self.params = np.zeros(PARAM_WORDS, np.int64)
        self.barrier = _zeros(4 * BARRIER_WORDS, 64).view(np.int32)
        # cycle stamps (profile builds): row 0 worker 0's after each stage's barrier, row 1 + t thread t's on
        # reaching it and, in its last column, on starting the call (codegen/step.py: stamp, arrive). Sized by
        # the schedule the program runs: the disk tier's (run_state) has more stages than the file's.
        self.prof = np.zeros((self.threads + 1, self.run_state.schedule.n_stages + 1), np.int64)
        # profile builds: tile-rows read per [layer][expert][gate_up, down] (codegen/step.py:count_expert_rows)
        self.expert_rows = np.zeros((cfg.n_layers + 1, max(cfg.n_experts, 1), 2), np.int64)
        fixed = {Binding.KV: self.kv, Binding.COS: self.cos, Binding.SIN: self.sin, Binding.SCRATCH: self.scratch,
                 Binding.PROF: self.prof, Binding.EXPERT_ROWS: self.expert_rows, Binding.TOKENS: self.tokens,
                 Binding.POSITIONS: self.positions,
                 Binding.SLOTS: self.slots}
        addr: list[int] = []
        self._keep = []
        self._ptr_index: dict[str, int] = {}
        for i, key in enumerate(prog.bindings):
            if key.kind == Binding.TENSOR:
                self._ptr_index[key.name] = i
                if key.name in self.tier_tensors or key.name in self.streamed:
                    a = 0  # on disk: set when chosen (experts) or read (streamed), before the step that reads it
                else:
                    v = self._dense_copy(key.name) if self.segmented else self.reader.tensor(key.name)
                    self._keep.append(v)
                    a = v.ctypes.data
            elif key.kind == Binding.POOL:
                a = self.pools[Pool(key.name)].ctypes.data
            elif key.kind in (Binding.COS, Binding.SIN):
                a = self._rope[key.name][0 if key.kind == Binding.COS else 1].ctypes.data
            else:
                a = fixed[key.kind].ctypes.data
            addr.append(a)
        self.ptrs = (ctypes.c_void_p * len(addr))(*addr)
        self._args = (ctypes.cast(self.ptrs, ctypes.c_void_p), ctypes.c_void_p(self.params.ctypes.data),
                      ctypes.c_void_p(self.barrier.ctypes.data))
        self.logits_view = self.pools[Pool.LOGITS][: cfg.vocab_size]

    # --- the disk expert tier --------------------------------------------------------------------------
    def _plan_segments(self) -> None:
        """Cut the late schedule where the host must act: after each ROUTE stage (read the choice, start the
        reads) and before each expert UP stage (wait, point the table at the slots); release after DOWN."""
        sched = self.run_state.schedule
        route, up, down = {}, {}, {}
        for st in sched.steps():
            if st.phase == Phase.ROUTE:
                route[st.layer] = st.stage
            elif st.phase == Phase.UP and st.layer in route and st.op.startswith("moe"):
                up[st.layer] = st.stage
            elif st.phase == Phase.DOWN and st.layer in route and st.op.startswith("moe"):
                down[st.layer] = st.stage
        n = sched.n_stages
        every = set(range(n)) if self.weights == "disk" else set()  # streamed weights: one stage per call
        cuts = sorted({0, n} | {r + 1 for r in route.values()} | set(up.values()) | every)
        self.segments = []
        for lo, hi in zip(cuts, cuts[1:]):
            self.segments.append(Segment(
                lo=lo, hi=hi, awaits=tuple(l for l in up if lo <= up[l] < hi),
                issues=tuple(l for l in route if lo <= route[l] < hi),
                releases=tuple(l for l in down if lo <= down[l] < hi)))
        # Experts pinned at once: a layer's choice is pinned from its issue to its release.
        live, most = set(), 0
        for seg in self.segments:  # in step order: sync issues at the await, async after the route; release last
            live |= set(seg.awaits if self.expert_io == "sync" else seg.issues)
            most = max(most, len(live))
            live -= set(seg.releases)
        self.window_stages = {l: up[l] - route[l] - 1 for l in route}  # stages run between a choice and its use
        self.segment_seconds = np.zeros(len(self.segments))  # native time per segment, summed over steps
        self._layer_misses = {l: 0 for l in route}
        self._min_slots = max(1, most) * self.config.top_k
        self._route_at = {l: self.program.scratch.route + l * self.program.scratch.route_stride for l in route}

    def _open_tier(self, expert_cache_mb: float | None) -> None:
        from .experts import ExpertTier

        names: dict[tuple[int, int], list[str]] = {}
        for t in self.compiled.tensors.values():
            if t.expert >= 0:
                names.setdefault((t.block, t.expert), []).append(t.name)
        self.tier_tensors = {n for ns in names.values() for n in ns}
        per = max(sum(pad(self.reader.entry(n).nbytes) for n in ns) for ns in names.values())  # one slot
        if expert_cache_mb is None:  # default: a quarter of the experts, at least what decoding needs
            budget = max(self._min_slots, len(names) // 4) * per
        else:
            if not expert_cache_mb > 0:
                raise CflowError(f"expert cache must be > 0 MB, not {expert_cache_mb}")
            budget = int(expert_cache_mb * 2**20)
        layers: dict[int, tuple[int, ...]] = {}  # weight block -> the layers that run it (named in read errors)
        for l in self._layer_misses:
            layers[self.config.block_of(l)] = (*layers.get(self.config.block_of(l), ()), l)
        self.tier = ExpertTier(self.reader, names, budget, self._min_slots, layers=layers)

    def _open_streamer(self) -> None:
        """Stream every big non-expert matrix (tiled forms) per stage; norms, biases, router and the
        embedding table (one row per token) stay in RAM."""
        from ..layout.packed import Form
        from .streaming import StageStreamer

        tensors = self.compiled.tensors
        big = {n for n, t in tensors.items() if t.expert < 0 and t.form.is_tiled}
        per_stage = [[n for st in stage for n in st.tensors if n in big] for stage in self.run_state.schedule.stages]
        self.streamed = {n for names in per_stage for n in names}
        assert all(tensors[n].form != Form.VECTOR for n in self.streamed)
        self.streamer = StageStreamer(self.reader, per_stage, self.read_ahead)

    def _dense_copy(self, name: str) -> np.ndarray:
        """A non-expert tensor read into RAM (disk mode: nothing of the file stays mapped), checksummed."""
        import zlib

        e = self.reader.entry(name)
        buf = aligned_empty(max(e.nbytes, 1), 64)
        got = os.preadv(self._dense_fd, [memoryview(buf)[: e.nbytes]], e.file_offset)
        if got != e.nbytes or zlib.crc32(buf[: e.nbytes]) != e.crc:
            raise FormatError(f"{self.path}: tensor {name!r} at file offset 0x{e.file_offset:x}: "
                              f"{'short read' if got != e.nbytes else 'checksum mismatch'}")
        return buf

    def _route(self, layer: int) -> np.ndarray:
        """The experts layer `layer` chose (thread 0's copy; every thread routes alike)."""
        at = self._route_at[layer]
        return self.scratch[at : at + 4 * self.config.top_k].view(np.int32).copy()

    def _step_segments(self) -> None:
        chosen: dict[int, np.ndarray] = {}
        blk = self.config.block_of
        clock = time.perf_counter
        # One thread count for every segment of the token: each thread keeps its own copy of a layer's route
        # (and shared-expert gate) in its scratch, written by the ROUTE segment and read by the expert
        # segments. Were _Backoff to switch from one thread to all between them, a worker would read its stale
        # route and the pointer of an expert nobody loaded (NULL until first chosen: a SIGSEGV, issue 14).
        solo = self._solo()
        for k, seg in enumerate(self.segments):
            for l in seg.awaits:
                if self.expert_io == "sync":
                    self._layer_misses[l] += self.tier.issue(blk(l), chosen[l], l)
                for name, addr in self.tier.wait(blk(l), chosen[l]).items():
                    self.ptrs[self._ptr_index[name]] = addr
            if self.streamer is not None:
                for name, addr in self.streamer.wait(seg.lo).items():  # one stage per segment when streaming
                    self.ptrs[self._ptr_index[name]] = addr
            self.params[Param.STAGE_LO], self.params[Param.STAGE_HI] = seg.lo, seg.hi
            t0 = clock()
            self._run_native(solo)
            self.segment_seconds[k] += clock() - t0  # compute only: what the overlap model needs
            if self.streamer is not None:
                self.streamer.done(seg.lo)
            for l in seg.issues:
                chosen[l] = self._route(l)
                if self.expert_io == "async":
                    self._layer_misses[l] += self.tier.issue(blk(l), chosen[l], l)
            for l in seg.releases:
                self.tier.release(blk(l), chosen[l])
        if solo and self._backoff is not None:
            self._backoff.solo_calls += len(self.segments) - 1  # solo_calls counts native calls, solo() one

    def misses_by_layer(self) -> dict[int, int]:
        """Expert reads started per layer since load (the disk tier)."""
        return dict(self._layer_misses)

    def _solo(self) -> bool:
        """Run the next call (the disk tiers: the next token's calls) on the caller's thread alone?"""
        return self._pool is None or (self._backoff is not None and self._backoff.solo())

    def _run_native(self, solo: bool | None = None) -> None:
        if solo is None:
            solo = self._solo()
        if solo:
            self._fn(self._args[0], self._args[1], 0, 1, self._args[2])  # one thread: the workers stay asleep
        else:
            self._pool.run()
            if self._backoff is not None:
                self._backoff.after(int(self.barrier[BarrierWord.NAPS]))

    @property
    def solo_calls(self) -> int:
        """Native calls the default thread count ran on one thread because workers were descheduled (_Backoff)."""
        return self._backoff.solo_calls if self._backoff is not None else 0

    # --- running ----------------------------------------------------------------------------------
    def _reset_io(self) -> None:
        if self.tier is not None:
            self.tier.reset()
        if self.streamer is not None:
            self.streamer.reset()

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
        return int(self.barrier[BarrierWord.NAPS])

    def reset(self, slot: int | None = None) -> None:
        """Empty every sequence (or one slot): its next token goes to position 0."""
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
        token = int(token)
        if not 0 <= token < self.config.vocab_size:
            raise RuntimeFault(f"token id {token} out of range 0..{self.config.vocab_size - 1}")
        if self.pos >= self.max_seq:
            raise RuntimeFault(f"context full: position {self.pos} reaches the maximum of {self.max_seq} tokens")
        self.params[Param.TOKEN], self.params[Param.POS] = token, self.pos
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
        return self.logits_view

    def release(self, slot: int) -> None:
        """Mark slot `slot` free: its sequence is over; step_batch refuses it until a prefill starts a new one."""
        slot = self._check_slot(slot)
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

    def _run_multi(self, n: int, logits_from: int) -> None:
        self.params[Param.NTOK], self.params[Param.LOGITS_FROM], self.params[Param.MODE] = n, logits_from, Mode.PREFILL
        try:
            self._run_native()
        finally:
            self.params[Param.MODE] = Mode.DECODE

    def _logits_row(self, t: int) -> np.ndarray:
        stride = self.program.pool_strides[Pool.LOGITS]
        return self.pools[Pool.LOGITS][t * stride : t * stride + self.config.vocab_size]

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
        self.tokens[:n], self.slots[:n], self.positions[:n] = tokens, slots, self.slot_pos[slots]
        self._run_multi(n, 0)
        self.slot_pos[slots] += 1
        stride = self.program.pool_strides[Pool.LOGITS]
        rows = self.pools[Pool.LOGITS][: n * stride].reshape(n, stride)
        return rows[:, : self.config.vocab_size].copy()

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
            self.tokens[:n], self.slots[:n], self.positions[:n] = chunk, slot, np.arange(p, p + n)
            self._run_multi(n, 0 if all_logits else n - 1)
            self.slot_pos[slot] += n
            self.slot_open[slot] = True
            if all_logits:
                stride = self.program.pool_strides[Pool.LOGITS]
                rows.append(self.pools[Pool.LOGITS][: n * stride].reshape(n, stride)[:, : self.config.vocab_size]
                            .copy())
        return np.concatenate(rows) if all_logits else self._logits_row(n - 1).copy()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
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


# Workers that were still alive when their session closed (join timed out: a thread descheduled for long), with
# everything they may still touch: the control block they wait on, the step's argument buffers and the JIT-compiled
# code they run. Kept alive here, never freed under a running thread; entries go once all their threads have ended.
_PARKED: list[tuple[list[threading.Thread], tuple]] = []
_PARK_LOCK = threading.Lock()
JOIN_TIMEOUT = 5.0  # seconds close() waits for each worker before parking it


def _reap_parked() -> None:
    with _PARK_LOCK:
        _PARKED[:] = [(ts, keep) for ts, keep in _PARKED if any(t.is_alive() for t in ts)]


def parked_workers() -> int:
    """Worker threads of closed sessions still running (normally 0)."""
    _reap_parked()
    with _PARK_LOCK:
        return sum(t.is_alive() for ts, _ in _PARKED for t in ts)


class _Workers:
    """Worker threads 1..n-1 live in native code (cflow_worker): each token, worker 0 (the caller)
    kicks them through a futex and runs its share; the step's final barrier means all are done.
    Python only starts them (one thread each, ctypes releases the GIL) and stops them."""

    def __init__(self, library, args, n: int, keep: tuple = ()):
        self.n = n
        # the code the workers run and the buffers args points into: they must outlive the threads (close parks
        # them if a worker lingers)
        self.library, self.keep = library, keep
        self.ctl = _zeros(4 * CTL_WORDS, 64).view(np.int32)
        vp = ctypes.c_void_p
        self.worker = library.get_cfunc(WORKER_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp, vp)
        self.kick = library.get_cfunc(KICK_SYMBOL, None, vp)
        self.step = library.get_cfunc(STEP_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp)
        self.args = args
        ctl = ctypes.c_void_p(self.ctl.ctypes.data)
        self._ctl = ctl
        self.threads = [threading.Thread(target=self.worker, args=(args[0], args[1], t, n, args[2], ctl), daemon=True,
                                         name=f"cflow-worker-{t}") for t in range(1, n)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        self.kick(self._ctl)
        self.step(self.args[0], self.args[1], 0, self.n, self.args[2])

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers. Between tokens a worker only waits on the control block (and the barrier), so one
        that has not ended after the join timeout is parked with the control block, the argument buffers and
        the code, rather than having them freed under it; it ends as soon as it runs again and sees STOP."""
        self.ctl[CtlWord.STOP] = 1  # then wake everyone
        self.kick(self._ctl)
        for t in self.threads:
            t.join(timeout=JOIN_TIMEOUT if timeout is None else timeout)
        alive = [t for t in self.threads if t.is_alive()]
        if alive:
            with _PARK_LOCK:
                keep = (self.library, self.keep, self.ctl, self._ctl, self.args, self.worker, self.kick)
                _PARKED.append((alive, keep))
        _reap_parked()
