"""A model's compiled step: the program (emitted and JIT-compiled, or read back from the caches), the buffers and
pointer table it runs on, and the threads that run it.

    step = NativeStep(state, header, max_seq=..., tmax=..., kv=..., n_slots=..., threads=...)  # build
    step.bind(tensor)    allocate the buffers and fill the pointer table (tensor(name): its array, or None
                         for one that is set later with point()); start the workers
    step.run()           one native call over the parameters in step.params (a Session sets them)
    step.launch()        (detached) start that call on the workers and return; step.wait() once it is done
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..codegen.abi import BARRIER_WORDS, KV_BYTES, PARAM_WORDS, STEP_SYMBOL, BarrierWord, Binding
from ..errors import RuntimeFault
from ..ir.rope import rope_tables
from ..layout.tile import aligned_empty
from ..passes.schedule import Pool
from .workers import Backoff, DetachedBackoff, Workers, cores_taken


def _zeros(nbytes: int, align: int = 4096) -> np.ndarray:
    return aligned_empty(nbytes, align, zero=True)


class NativeStep:
    """The step of one plan (`state`: the file's, or the disk tier's late schedule) for `max_seq` positions,
    `tmax` tokens per multi-token call, `n_slots` KV caches of type `kv`, run by `threads` threads. `segmented`:
    stage-range calls (the disk tiers); `adaptive`: the thread count was the default, so calls back off to one
    thread while workers are descheduled (workers.Backoff)."""

    def __init__(self, state, header: dict, *, max_seq: int, tmax: int, kv: str, n_slots: int, threads: int,
                 profile: bool = False, segmented: bool = False, adaptive: bool = False, cache=None,
                 activations: str = "q8", detached: bool = False):
        self.state, self.header, self.config = state, header, state.graph.config
        self.activations = activations  # the quantised activations' format (layout.quant.ACT_FORMATS)
        self.max_seq, self.tmax, self.kv_dtype, self.n_slots = max_seq, tmax, kv, n_slots
        self.threads, self.profile, self.segmented, self.adaptive = threads, profile, segmented, adaptive
        # detached: every thread of the step is a worker (thread 0 too), so the caller may launch a call and do
        # other work until it waits for it (Session.step_launch); under load its calls run in turn instead
        # (DetachedBackoff: on the caller's thread where the step has one thread)
        self.detached = detached
        self.ptrs = None  # the pointer table: None until bind()
        self.workers: Workers | None = None
        self.backoff: Backoff | None = None
        self.detached_backoff: DetachedBackoff | None = None
        # True while this step shares the cores with another model of ours (a speculative draft model): its
        # workers' spinning makes this step's barriers nap, which is not load to back off from
        self.hold_threads = False
        self._build(cache)

    # --- building ---------------------------------------------------------------------------------
    def _build(self, cache) -> None:
        # imported here: benchmarks/jit_time.py times build_step by replacing it in its module
        from ..codegen import attn_tune, program_cache, tune
        from ..codegen.library import Library
        from ..codegen.step import StepProgram, build_step
        from ..codegen.target import host_target

        state = self.state
        target = self.target = host_target()  # the CPU the code is built for (CFLOW_CPU / CFLOW_FEATURES apply)
        # This host's mat-vec knobs: measured by `cflow tune` and cached, else the ones shipped for this
        # microarchitecture (codegen/tune_defaults.py), else the built-in defaults; a load never searches unless
        # CFLOW_TUNE=search (CFLOW_TUNE=off: the defaults). Schedule-only: the numbers do not change.
        search = tune.search_at_load()
        geoms = attn_tune.geometries(state.graph.nodes())
        self.tuning = tune.choices(state.tensors.values(), target, search=search,
                                   budget=tune.kernel_budget(tune.BUDGET, len(geoms)) if search else None)
        # and the attention core's prefetch distance, the same way
        self.tuning.update(attn_tune.choices(geoms, self.kv_dtype, target, max_seq=self.max_seq, search=search))
        bf16_unit = target.bf16_unit if self.kv_dtype == "bf16" else ""
        fp = (program_cache.fingerprint(self.header, state.schedule.to_json(), target.isa, self.max_seq,
                                        self.profile, self.segmented, self.tmax, self.kv_dtype, self.tuning,
                                        bf16_unit, self.activations)
              if cache is not False else None)
        hit = program_cache.load(fp) if fp else None
        self.program = None
        if hit is not None:
            try:
                self.program = StepProgram.from_meta(hit["ir"], hit["meta"])
            except (KeyError, TypeError, ValueError):
                self.program = None
        if self.program is None:
            self.program = build_step(state, target.isa, self.max_seq, profile=self.profile,
                                      segmented=self.segmented, tmax=self.tmax, kv=self.kv_dtype, tuning=self.tuning,
                                      bf16_unit=bf16_unit, activations=self.activations)
        ir_text = self.program.module if isinstance(self.program.module, str) else str(self.program.module)
        if fp and hit is None:
            program_cache.save(fp, ir_text, self.program.meta())
        self.library = Library(name="cflow_step", target=target, cache=cache)
        self.library.add_ir(ir_text)
        self.library.finalize()
        vp = ctypes.c_void_p
        self._fn = self.library.get_cfunc(STEP_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp)

    # --- buffers and the pointer table ------------------------------------------------------------
    def bind(self, tensor) -> None:
        """Allocate the buffers, fill the pointer table (each tensor binding from `tensor(name)`: an array kept
        alive here, or None for an address set later with point() before any call reads it), then start the
        workers. Only then may the step run."""
        if self.ptrs is not None:
            raise RuntimeFault("the step's buffers are already bound")
        self._alloc()
        fixed = {Binding.KV: self.kv, Binding.COS: self.cos, Binding.SIN: self.sin, Binding.SCRATCH: self.scratch,
                 Binding.PROF: self.prof, Binding.EXPERT_ROWS: self.expert_rows, Binding.TOKENS: self.tokens,
                 Binding.POSITIONS: self.positions,
                 Binding.SLOTS: self.slots}
        addr: list[int] = []
        self.keep = []
        self.ptr_index: dict[str, int] = {}
        for i, key in enumerate(self.program.bindings):
            if key.kind == Binding.TENSOR:
                self.ptr_index[key.name] = i
                v = tensor(key.name)
                if v is None:
                    a = 0  # on disk: set when chosen (experts) or read (streamed), before the step that reads it
                else:
                    self.keep.append(v)
                    a = v.ctypes.data
            elif key.kind == Binding.POOL:
                a = self.pools[Pool(key.name)].ctypes.data
            elif key.kind in (Binding.COS, Binding.SIN):
                a = self.rope[key.name][0 if key.kind == Binding.COS else 1].ctypes.data
            else:
                a = fixed[key.kind].ctypes.data
            addr.append(a)
        ptrs = (ctypes.c_void_p * len(addr))(*addr)
        self.args = (ctypes.cast(ptrs, ctypes.c_void_p), ctypes.c_void_p(self.params.ctypes.data),
                     ctypes.c_void_p(self.barrier.ctypes.data))
        self.logits_view = self.pools[Pool.LOGITS][: self.config.vocab_size]
        self.ptrs = ptrs
        self.workers = (Workers(self.library, self.args, self.threads, keep=(self.ptrs, self.params, self.barrier),
                                detached=self.detached)
                        if self.threads > 1 or self.detached else None)
        self.backoff = (Backoff(busy=lambda n=self.threads: cores_taken(n)) if self.workers is not None
                        and self.adaptive and not self.detached else None)
        self.detached_backoff = DetachedBackoff() if self.detached else None

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
        self.rope = {"": (self.cos, self.sin)}  # name -> (cos, sin)
        if local:
            lc, ls = rope_tables(cfg, self.max_seq, layer=local[0])
            self.rope["local"] = (np.ascontiguousarray(lc, np.float32).reshape(-1),
                                  np.ascontiguousarray(ls, np.float32).reshape(-1))
        self.scratch = _zeros(prog.scratch.nbytes * self.threads)
        self.params = np.zeros(PARAM_WORDS, np.int64)
        self.barrier = _zeros(4 * BARRIER_WORDS, 64).view(np.int32)
        # cycle stamps (profile builds): row 0 worker 0's after each stage's barrier, row 1 + t thread t's on
        # reaching it and, in its last column, on starting the call (codegen/step.py: stamp, arrive). Sized by
        # the schedule the program runs: the disk tier's has more stages than the file's.
        self.prof = np.zeros((self.threads + 1, self.state.schedule.n_stages + 1), np.int64)
        # profile builds: tile-rows read per [layer][expert][gate_up, down] (codegen/moe.py:count_expert_rows)
        self.expert_rows = np.zeros((cfg.n_layers + 1, max(cfg.n_experts, 1), 2), np.int64)

    def point(self, name: str, addr: int) -> None:
        """Point tensor `name`'s table entry at `addr` (an expert's slot, a streamed stage's buffer)."""
        self.ptrs[self.ptr_index[name]] = addr

    # --- running ----------------------------------------------------------------------------------
    def solo(self) -> bool:
        """Run the next call (the disk tiers: the next token's calls) on the caller's thread alone?"""
        if self.detached:  # under load, a one-thread step's calls in turn on the caller's thread (DetachedBackoff)
            return self.threads == 1 and self.detached_backoff is not None and self.detached_backoff.solo()
        return self.workers is None or (self.backoff is not None and not self.hold_threads and self.backoff.solo())

    def run(self, solo: bool | None = None) -> None:
        """One native call over the current params (solo: on the caller's thread alone; None: as solo() says)."""
        if self.ptrs is None:
            raise RuntimeFault("the step ran before its buffers were bound (NativeStep.bind)")
        self.wait()
        if solo is None:
            solo = self.solo()
        if solo:
            self._fn(self.args[0], self.args[1], 0, 1, self.args[2])  # one thread: the workers stay asleep
        else:
            self.workers.run()
            if self.backoff is not None:
                naps = int(self.barrier[BarrierWord.NAPS])
                if self.hold_threads:  # not judged, but counted as seen: the next judged call sees its own naps
                    self.backoff.seen = naps
                else:
                    self.backoff.after(naps)

    def launch(self) -> None:
        """Start one native call over the current params on the workers and return at once (detached steps
        only); the params, buffers and logits are the call's until wait()."""
        if self.ptrs is None:
            raise RuntimeFault("the step ran before its buffers were bound (NativeStep.bind)")
        if not self.detached:
            raise RuntimeFault("launch() needs a detached step (Session(detached=True))")
        if self.workers.inflight:
            raise RuntimeFault("a step is already in flight: wait() for it first")
        self.detached_backoff.launched()
        self.workers.launch()

    def wait(self, judge: bool = False) -> None:
        """Return once the launched call is done (at once if none is in flight). judge: the time from its launch
        counts for DetachedBackoff (Session.step_wait's: the caller's own work between a launch and its wait;
        not a call given up, nor one another call waits for after work of its own)."""
        if self.workers is not None and self.workers.inflight:
            backoff = self.detached_backoff
            if backoff is not None:
                backoff.waiting()
            self.workers.wait()
            if backoff is not None:
                backoff.waited(judge)

    def abort(self) -> None:
        """Stop the launched call at its next stage boundary and wait for it (a one-thread step; with more
        threads, wait for it to end): what it computed is not to be used (the KV cache's entries at its
        position, its logits), the next call at that position writes them again."""
        if not self.inflight:
            return
        if self.threads == 1:
            self.barrier[BarrierWord.ABORT] = 1
        try:
            self.wait()
        finally:
            self.barrier[BarrierWord.ABORT] = 0

    @property
    def inflight(self) -> bool:
        """A launched call not yet waited for."""
        return self.workers is not None and self.workers.inflight

    def logits_rows(self, n: int) -> np.ndarray:
        """A view of the logits of the last call's first `n` token rows, [n, vocab]."""
        stride = self.program.pool_strides[Pool.LOGITS]
        return self.pools[Pool.LOGITS][: n * stride].reshape(n, stride)[:, : self.config.vocab_size]

    def logits_row(self, t: int) -> np.ndarray:
        stride = self.program.pool_strides[Pool.LOGITS]
        return self.pools[Pool.LOGITS][t * stride : t * stride + self.config.vocab_size]

    @property
    def solo_calls(self) -> int:
        """Native calls run on one thread because workers were descheduled (Backoff; a detached step's calls in
        turn, DetachedBackoff)."""
        backoff = self.backoff or self.detached_backoff
        return backoff.solo_calls if backoff is not None else 0

    @property
    def backoffs(self) -> int:
        """Times the step backed off under load (Backoff, DetachedBackoff: each trip)."""
        backoff = self.backoff or self.detached_backoff
        return backoff.trips if backoff is not None else 0

    @property
    def barrier_naps(self) -> int:
        """Times a thread waiting at a stage barrier stopped spinning and slept (BarrierWord.NAPS, counted since
        bind)."""
        return int(self.barrier[BarrierWord.NAPS])

    def close(self) -> None:
        """Stop the workers (the buffers go with the object)."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def __enter__(self) -> NativeStep:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
