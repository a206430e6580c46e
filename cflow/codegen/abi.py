"""The native step's ABI, defined once: what the emitter (step.py and the modules it calls) and the driver
(runtime/native_step.py) must agree on. Change a value here and both sides move together.

Exported symbols (every address comes from the pointer table, so the object code is position-free):

    cflow_step(i8** ptrs, i64* params, i64 tid, i64 nthreads, i32* barrier)   one token, one thread's share
    cflow_worker(ptrs, params, tid, nthreads, barrier, i32* ctl)             loop: wait for a kick, run a step
    cflow_kick(i32* ctl)                                                       start the next token

    ptrs[i]       address of binding i (`StepProgram.bindings[i]`: a tensor, a buffer pool, the KV cache ...)
    params[Param] token id and position of the token being decoded (i64 words)
    barrier[...]  arrival count and generation, on separate cache lines (i32 words)
    ctl[...]      token generation the workers wait on, and the stop flag (i32 words)
    scratch       per thread, ScratchLayout.nbytes apart, at ptrs[SCRATCH binding]
"""

from __future__ import annotations

import enum
import math

import attrs

from ..errors import CodegenError
from ..layout.quant import BLOCK, act_planes, padded

STEP_SYMBOL, WORKER_SYMBOL, KICK_SYMBOL, JOIN_SYMBOL = "cflow_step", "cflow_worker", "cflow_kick", "cflow_join"


class Param(enum.IntEnum):
    """i64 words of the parameter block."""

    TOKEN = 0  # token id fed at this step
    POS = 1  # its position (KV-cache row, RoPE angle)
    STAGE_LO = 2  # segmented steps only: run stages [STAGE_LO, STAGE_HI) of the schedule
    STAGE_HI = 3
    NTOK = 4  # multi-token calls: tokens in this call (1 .. tmax), their positions and slots in bindings
    MODE = 5  # Mode: what a call of cflow_step runs
    LOGITS_FROM = 6  # multi-token calls: the LM head runs for tokens [LOGITS_FROM, NTOK) only


class Mode(enum.IntEnum):
    DECODE = 0  # one token (params TOKEN, POS)
    PREFILL = 1  # NTOK tokens from TOKENS at POSITIONS in SLOTS: a prompt block, or one token of each sequence


PARAM_WORDS = 8  # room for later fields; unused words are zero


class BarrierWord(enum.IntEnum):
    """i32 words of the barrier block: the count and the generation live on different cache lines."""

    COUNT = 0  # arrivals at the current barrier (every arrival writes this line)
    SPIN = 1  # pause rounds a waiter spins before it sleeps; 0 = threads.BARRIER_SPINS (set at run time to tune)
    ABORT = 2  # non-zero: a one-thread step returns at its next stage boundary (set by the host, which then drops
    #            what the step computed: a detached step launched for a token it will not use)
    GENERATION = 16  # bumped by the last arriver; waiters poll it and futex_wait on it
    SLEEPERS = 17  # waiters inside futex_wait: the last arriver calls FUTEX_WAKE only when non-zero. On the
    #               generation's line, which the last arriver has just written, so reading it costs no miss.
    NAPS = 18  # times any waiter went to sleep (never reset): Session.barrier_naps reports it (benchmarks/load.py)


BARRIER_WORDS = 32  # two 64-byte cache lines


class CtlWord(enum.IntEnum):
    """i32 words of the worker control block."""

    GO = 0  # token generation: a kick adds 1, workers run a step when it changes (futex word)
    STOP = 16  # non-zero: workers return at their next wake-up
    DONE = 32  # the generation whose step a worker has finished (futex word: cflow_join waits on it)
    JOINERS = 33  # threads asleep in cflow_join: a worker that finishes a step wakes them only if non-zero
    SPINS = 34  # pause rounds an idle worker spins for the next kick, and cflow_join for the step, before sleeping
    # (0: threads.SPINS; runtime.workers sets more for a detached step)


CTL_WORDS = 48  # three 64-byte cache lines: the kick's, the stop's, the finished step's


class Binding(enum.StrEnum):
    """What a pointer-table entry points at."""

    TENSOR = "tensor"  # a packed weight tensor of the file (name = tensor name)
    POOL = "pool"  # a buffer pool (name = passes.schedule.Pool)
    KV = "kv"  # KV cache (f32, or f16 / bf16 bits): [slot][layer][K|V][kv_floats_per_layer] (attention.kv_layout)
    COS = "cos"  # f32 RoPE cos table [max_seq][head_dim / 2]
    SIN = "sin"  # f32 RoPE sin table [max_seq][head_dim / 2]
    SCRATCH = "scratch"  # per-thread scratch (ScratchLayout), nthreads copies
    PROF = "prof"  # i64 cycle stamps [threads + 1][n_stages + 1] (profiling builds only)
    EXPERT_ROWS = "expert_rows"  # i64 [n_layers + 1][n_experts][2]: tile-rows read per expert, gate_up / down
    #   (profiling builds only: tests count that a prompt block reads each chosen expert once)
    TOKENS = "tokens"  # i64 token ids [tmax] of a multi-token call
    POSITIONS = "positions"  # i64 [tmax]: each token's position in its sequence
    SLOTS = "slots"  # i64 [tmax]: each token's sequence (KV-cache slot); a prompt block is one slot


@attrs.frozen
class BindingKey:
    kind: Binding = attrs.field(converter=Binding)
    name: str = ""

    def to_json(self) -> list[str]:
        return [str(self.kind), self.name]

    @classmethod
    def from_json(cls, v) -> BindingKey:
        kind, name = v
        return cls(kind, name)


@attrs.define
class ScratchLayout:
    """Byte offsets inside one thread's scratch area (every field 64-byte aligned).

    The per-token fields (PER_TOKEN) hold tmax consecutive copies, token t's at field + t * token_bytes(field):
    a multi-token call normalises and quantises every token's input before one mat-mat reads them all.
    """

    PER_TOKEN = ("xn", "xq", "xd", "xs", "route")

    kmax: int  # widest mat-vec input (padded)
    dp: int  # d_model padded to the tile unit
    max_seq: int
    n_experts: int
    top_k: int
    n_layers: int
    tmax: int = 1  # tokens per multi-token call
    expert_rows: int = 0  # one expert's hidden width, padded to the tile unit (0: no experts)
    act_planes: int = 1  # int8 planes of the widest quantised activation (2: activations='q8x2', quant.act_planes)
    xn: int = 0  # f32[tmax][kmax]: normalised (or copied) step input
    xq: int = 0  # i8[tmax][act_planes * kmax]: its int8 blocks (32 bytes a block per plane)
    xd: int = 0  # f32[tmax][kmax/32]: block scales
    xs: int = 0  # i32[tmax][kmax/32]: block code sums
    tmp: int = 0  # f32[dp]: one expert's down output before its weighted add
    att_rep: int = 1  # query heads per kv head: attention keeps the scores of a kv group's heads together
    scores: int = 0  # f32[att_rep][max_seq + 2 * 16]: a kv group's attention scores (exp runs 16 lanes past the last)
    probs: int = 0  # f32[n_experts]: router probabilities
    route: int = 0  # [tmax][layer 0..n_layers]: i32 idx[k], f32 w[k], f32 shared gate
    # A multi-token call of an MoE model groups the block's tokens by the expert they chose, so each chosen
    # expert's tiles are read once per call (moe.py experts_*_grouped); these fields exist only then.
    gq: int = 0  # i8[tmax][act_planes * kmax]: the int8 inputs of one expert's tokens, gathered
    gd: int = 0  # f32[tmax][kmax/32]
    gs: int = 0  # i32[tmax][kmax/32]
    gy: int = 0  # f32: one expert's up outputs [tmax][expert_rows], or every down output [tmax][top_k + 1][dp]
    gtok: int = 0  # i64[tmax]: token of each group member
    gj: int = 0  # i64[tmax]: which of its top-k choices the expert is
    gpos: int = 0  # i64[tmax][top_k]: row of gy holding token t's j-th expert's down output
    nbytes: int = 0  # size of one thread's area (a multiple of 4096)

    def token_bytes(self, field: str) -> int:
        """Bytes between two tokens' copies of a per-token field."""
        kb = self.kmax // BLOCK
        return {"xn": 4 * self.kmax, "xq": self.act_planes * self.kmax, "xd": 4 * kb, "xs": 4 * kb,
                "route": self.route_stride * (self.n_layers + 1)}[field]

    def __attrs_post_init__(self):
        off = 0

        def take(n):
            nonlocal off
            start = off
            off = padded(off + n, 64)
            return start

        self.xn = take(self.tmax * self.token_bytes("xn"))
        self.xq = take(self.tmax * self.token_bytes("xq"))
        self.xd = take(self.tmax * self.token_bytes("xd"))
        self.xs = take(self.tmax * self.token_bytes("xs"))
        self.tmp = take(4 * self.dp)
        # attention.ATT_LANES of slack past the end (and a window's start)
        self.scores = take(4 * self.att_rep * (self.max_seq + 32))
        self.probs = take(4 * max(self.n_experts, 1))
        self.route = take(self.tmax * self.token_bytes("route"))
        if self.grouped:
            T, kb = self.tmax, self.kmax // BLOCK
            self.gq, self.gd, self.gs = take(T * self.token_bytes("xq")), take(4 * T * kb), take(4 * T * kb)
            self.gy = take(4 * T * max(self.expert_rows, (self.top_k + 1) * self.dp))
            self.gtok, self.gj, self.gpos = take(8 * T), take(8 * T), take(8 * T * self.top_k)
        self.nbytes = padded(off, 4096)

    @property
    def grouped(self) -> bool:
        """Multi-token calls run each chosen expert once for all its tokens (needs the group fields)."""
        return self.tmax > 1 and self.n_experts > 0 and self.expert_rows > 0

    @property
    def route_stride(self) -> int:
        """Per layer: i32 idx[k], f32 w[k], f32 shared gate."""
        return padded(4 * (2 * self.top_k + 1), 16)

    def to_json(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ScratchLayout:
        s = cls(**{k: d[k] for k in ("kmax", "dp", "max_seq", "n_experts", "top_k", "n_layers", "tmax",
                                        "expert_rows", "att_rep", "act_planes") if k in d})
        if s.to_json() != d:
            raise ValueError("stored scratch layout does not match this version")
        return s


def scratch_layout(config, tensors: dict, max_seq: int, tmax: int = 1, activations: str = "q8") -> ScratchLayout:
    """The scratch layout of the step compiled for these packed tensors (`PackedTensor` by name) and activation
    format (quant.ACT_FORMATS: 'q8x2' doubles the int8 fields when any matrix reads two planes).

    kmax is the widest mat-vec input as the kernels read it (padded to the tile unit, lcm of the tile's
    rows and columns). The session's memory check sizes the scratch with this before anything is compiled;
    the emitter must build its layout the same way, and tests/runtime/test_memory_estimate.py checks that
    the estimate equals what is allocated."""
    tile = next(iter(t.tile for t in tensors.values()))
    unit = math.lcm(*tile)
    dp = padded(config.d_model, unit)
    kmax = dp
    for t in tensors.values():
        if t.form.is_tiled:
            kmax = max(kmax, t.layout.cols_p, padded(t.layout.cols, unit))
    planes = max((act_planes(activations, t.part_dtypes or (t.dtype,)) for t in tensors.values() if t.form.is_tiled),
                 default=1)
    return ScratchLayout(kmax=kmax, dp=dp, max_seq=max_seq, n_experts=config.n_experts, top_k=config.top_k,
                         n_layers=config.n_layers, tmax=tmax, act_planes=planes,
                         att_rep=max(1, config.n_heads // max(config.n_kv_heads, 1)),
                         expert_rows=padded(config.expert_dim, unit) if config.n_experts else 0)


def kv_floats_per_layer(config, max_seq: int) -> int:
    """Entries of one layer's K (or V) cache: [max_seq][n_kv_heads * head_dim] (see Binding.KV), max_seq rounded
    up to even (kv='bf16' keeps V in pairs of positions: attention.kv_layout)."""
    return (max_seq + max_seq % 2) * config.n_kv_heads * config.head_dim


KV_BYTES = {"f32": 4, "f16": 2, "bf16": 2}  # the KV cache's element types (load(kv=...)) and bytes per entry


def kv_cache_bytes(config, max_seq: int, n_slots: int = 1, kv: str = "f32") -> int:
    """Bytes of the whole KV cache: [slot][layer][K|V][kv_floats_per_layer] entries of type kv."""
    return KV_BYTES[kv] * n_slots * 2 * config.n_layers * kv_floats_per_layer(config, max_seq)


# Linux futex, used by the worker wake-up (threads.emit_workers) and the stage barrier (threads.barrier). Syscall
# numbers are per architecture; the kernels are x86 only today, so only x86-64 is accepted, and any other
# triple is refused here.
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129
_SYS_FUTEX = {"x86_64": 202}


def sys_futex(triple: str) -> int:
    arch = triple.split("-", 1)[0]
    if arch not in _SYS_FUTEX or "linux" not in triple:
        raise CodegenError(f"worker threads need Linux futexes on x86-64; target {triple} is not supported")
    return _SYS_FUTEX[arch]
