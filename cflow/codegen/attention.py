"""The attention core of the decode step: one token's GQA over the KV cache, as an llvmlite builder.

Stage: codegen. attention() emits (once per module and specialisation, found again by name) the function
codegen/step.py calls for a thread's kv heads. It is built from pieces: CoreShape (the specialisation's
constants), CoreFrame (one call's emission state: arguments, scratch, accumulators) and, per kv head, the
scans attend_group runs in order - write_position (this position's K and V into the cache), load_queries,
score_scan (q.k), softmax_scan (exp and sums) and weighted_sum or amx_weighted_sum (the weighted V sum).
The cache layout (kv_block, kv_layout) and the unit rule (core_unit) are here too: the runtime, the tuner
and the tests address the cache through them.
"""

from __future__ import annotations

import math

from llvmlite import ir

from ..ir import Attention
from .abi import KV_BYTES
from .cgutils import (
    Loop,
    P,
    V,
    alloca_once,
    bf16_dot,
    c32,
    c64,
    cf,
    const_vec,
    exp_vec,
    f32,
    float_to_bf16,
    float_to_half,
    half_to_float,
    hsum,
    i8,
    i16,
    i32,
    i64,
    internal_function,
    intrinsic,
    muladd,
    prefetch_lines,
    softcap,
    splat,
)
from .ops import float_label
from .target import ISA

ATT_LANES = 16  # scores are exponentiated 16 at a time: the scores scratch is padded by this much (abi.py)
# How far ahead the attention core's K and V scans prefetch by default (bytes, into L1; each host measures its own:
# codegen/attn_tune.py). Without it one scan per kv head left the cache's DRAM reads to the hardware prefetchers:
# on an AMX Xeon the f16 core took 474 us per layer at 4,064 positions from DRAM, 374 us 4 KiB ahead
# (docs/results/intel-amx/attention_core_prefetch_intel.json; docs/journal/performance.md, "Long contexts"). On Zen 5
# prefetching V ahead was measured slower (before this code: the default there is unmeasured, the tuner decides).
KV_PREFETCH = 4096


def kv_block(max_seq: int) -> int:
    """Positions per K block of the cache (the largest of 16, 8, 4, 2, 1 that divides max_seq)."""
    return next(B for B in (16, 8, 4, 2, 1) if max_seq % B == 0)


def kv_layout(max_seq: int, n_kv_heads: int, head_dim: int, kv: str = "f32"):
    """Where position s, kv head g, dimension d of one layer's K and V live (element offsets in each region of
    abi.kv_floats_per_layer entries): K in blocks of B = kv_block(max_seq) positions, dimension-major inside a
    block, so one load gives B positions' entries of a dimension; V position after position, each kv head's
    positions together. Both are read front to back by a kv head's scan. Works on ints and numpy arrays.

    kv='bf16' pairs the entries one BF16 dot-product lane takes (bf16_dot): in K the two dimensions 2m, 2m+1 of a
    position sit side by side (a block is pair-major: pair m holds B positions x 2 dimensions); in V the two
    positions 2t, 2t+1 of a dimension (a kv head's V is pair-row after pair-row, the position count rounded up
    to even)."""
    B = kv_block(max_seq)
    nb = max_seq // B
    if kv == "bf16":
        S2 = max_seq + max_seq % 2

        def k_at(s, g, d):
            return ((g * nb + s // B) * head_dim + d - d % 2) * B + 2 * (s % B) + d % 2

        def v_at(s, g, d):
            return (g * S2 + s - s % 2) * head_dim + 2 * d + s % 2

        return k_at, v_at

    def k_at(s, g, d):
        return ((g * nb + s // B) * head_dim + d) * B + s % B

    def v_at(s, g, d):
        return (g * max_seq + s) * head_dim + d

    return k_at, v_at


# The tile unit for kv='bf16' attention (bf16_unit 'amx'). Tiles: the queries (then the softmax weights) as A,
# one K or V tile as B, a block's scores, and one output accumulator per 16 dimensions.
T_Q, T_B, T_S, T_O = 0, 2, 3, 4


def amx_fits(rep: int, head_dim: int, kv_block: int) -> bool:
    """The geometries the tile core takes: K blocks of 16 positions (a B tile row is one dimension pair of the 16
    positions, 64 bytes), at most 16 query heads per kv head (the tiles' rows), head_dim 32 or 64 (one or two A
    tiles of queries and head_dim / 16 output tiles next to the other three: 8 tiles in all)."""
    return kv_block == 16 and 1 <= rep <= 16 and head_dim in (32, 64)


def core_unit(kv: str, bf16_unit: str, rep: int, head_dim: int, max_seq: int) -> str:
    """What one attention core's bf16 dot products run on, given the host's unit (Target.bf16_unit): 'amx' only
    where the geometry and cache fit the tiles (amx_fits), else VDPBF16PS ('dpbf16') where the host has it, else
    '' (the FMA emulation; also every kv other than 'bf16'). The one rule attention() and the tuning key share."""
    if kv != "bf16" or not bf16_unit:
        return ""
    if bf16_unit == "amx" and not amx_fits(rep, head_dim, kv_block(max_seq)):
        return "dpbf16"
    return bf16_unit


def _tile(b: ir.IRBuilder, op: str, *args) -> None:
    """llvm.x86.<op> of the tile unit: tile numbers (immediates), then a byte pointer and a stride in bytes."""
    sig = {"ldtilecfg": "p", "tilerelease": "", "tileloadd64": "tpl", "tilestored64": "tpl", "tilezero": "t",
           "tdpbf16ps": "ttt"}[op]
    tys = {"t": i8, "p": P(i8), "l": i64}
    vals = [b.bitcast(a, P(i8)) if k == "p" else a if isinstance(a, ir.Value) else ir.Constant(tys[k], a)
            for k, a in zip(sig, args)]
    b.call(intrinsic(b.module, "llvm.x86." + op, ir.VoidType(), [tys[k] for k in sig]), vals)


def _amx_config(b: ir.IRBuilder, rep: int, head_dim: int) -> None:
    """LDTILECFG (palette 1) for the tile core's tiles: queries / weights rep x 64 bytes (two query tiles where
    head_dim is 64), the B operand 16 x 64, the scores and the head_dim / 16 outputs rep x 64."""
    shapes = {T_Q: rep, T_B: 16, T_S: rep} | {T_O + c: rep for c in range(head_dim // 16)}
    if head_dim == 64:
        shapes[T_Q + 1] = rep
    cfg = [0] * 64
    cfg[0] = 1
    for t, rows in shapes.items():
        cfg[16 + 2 * t], cfg[48 + t] = 64, rows  # bytes per row (u16, < 256), rows
    at = alloca_once(b, ir.ArrayType(i8, 64))
    at.align = 64
    b.store(ir.Constant(ir.ArrayType(i8, 64), cfg), at)
    _tile(b, "ldtilecfg", at)


class CoreShape:
    """The constants of one attention specialisation (attention()'s arguments but the module), in the names its
    docstring uses: H query and KV kv heads of hd dimensions, rep query heads per kv head, half = hd / 2; S cached
    positions, K in nb blocks of B per kv head, V in S2 rows (bf16: even, for its pairs); SS floats per head in
    the scores scratch; NP q.k chains per head; W lanes per V chunk, nc chunks per head; L lanes of the
    exponential. Raises ValueError for a context or cache type the core does not take."""

    def __init__(self, n: Attention, offsets: tuple[int, int, int], isa: str, kv: str, max_seq: int,
                 bf16_unit: str, kv_prefetch: int):
        if max_seq < 1:
            raise ValueError(f"attention: max_seq must be >= 1, got {max_seq}")
        if kv not in KV_BYTES:
            raise ValueError(f"KV cache type must be one of {', '.join(KV_BYTES)}, not {kv!r}")
        H, KV, hd = n.n_heads, n.n_kv_heads, n.head_dim
        rep, S, B, bf = H // KV, max_seq, kv_block(max_seq), kv == "bf16"
        self.H, self.KV, self.hd, self.rep, self.half = H, KV, hd, rep, hd // 2
        self.S, self.B, self.nb = S, B, S // B
        self.S2 = S + S % 2 if bf else S  # positions per kv head in the V region (pairs of positions in bf16)
        self.SS = S + 2 * ATT_LANES  # floats per head in the scores scratch (abi.ScratchLayout.scores)
        self.NP = 1 if rep >= 4 else (2 if rep >= 2 else 4)  # q.k chains per head: >= 4 independent multiply-adds
        self.qo, self.ko, self.vo = offsets
        self.scale = 1.0 / math.sqrt(hd)
        self.bias, self.qk_norm, self.eps, self.softcap = n.bias, n.qk_norm, n.eps, n.softcap
        self.window = n.window  # a sliding window (Gemma 2/3, Mistral): attend to positions [pos - window + 1, pos]
        self.W = math.gcd(hd, 16)
        self.nc = hd // self.W
        self.vt, self.L = V(f32, self.W), ATT_LANES
        self.isa, self.fma = isa, isa != ISA.GENERIC
        self.kv, self.half_kv, self.bf, self.kv_prefetch = kv, kv == "f16", bf, kv_prefetch
        unit = core_unit(kv, bf16_unit, rep, hd, S)
        self.amx, self.bf16_hw = unit == "amx", unit in ("dpbf16", "amx")
        self.esz = KV_BYTES[kv]
        self.upair = 2 if bf else 1  # entries per unit of the scans (bf16: pairs)
        # The two scans' units, by cache type. q.k: a K block's unit (a dimension; bf16: a pair of them) as B lanes,
        # QU units per iteration (unrolled). V sum: a unit's row (a position; bf16: a pair-row) in nc chunks.
        self.qk_units, self.QU = (hd // 2, math.gcd(hd // 2, 4)) if bf else (hd, math.gcd(hd, 8))
        self.kstep = self.QU * B * self.upair * self.esz  # bytes per q.k step
        self.vstep = hd * self.upair * self.esz  # bytes per V unit
        self.RB = 32  # positions per block of the weighted sum (their V rows stay in L1 across the head groups)
        # The weighted sum reads each V row whole (all nc chunks), front to back, for a group of heads whose
        # rep x nc accumulators fit the registers; the next group re-reads the block from L1. Reading chunk by
        # chunk instead (a 128-byte stride through each 4 KiB block, four times) streamed V from DRAM at 11 GB/s
        # against 18 for K on Zen 5 (docs/journal/performance.md). Each accumulator sums its positions in the same
        # order.
        HG = max(1, min(rep, (16 if isa == ISA.AVX512VNNI else 4) // self.nc))  # accumulators: half the registers
        self.head_groups = [range(h, min(rep, h + HG)) for h in range(0, rep, HG)]

    def key(self) -> tuple:
        """The emitted function's name, as its parts (cgutils.internal_function)."""
        return ("attn", self.H, self.KV, self.hd, self.qo, self.ko, self.vo, int(self.bias),
                "fma" if self.fma else "mul", self.kv, f"S{self.S}", f"pf{self.kv_prefetch}") + (
            ("amx" if self.amx else "bfhw",) if self.bf16_hw else ()) + (
            (self.qk_norm, float_label(self.eps)) if self.qk_norm else ()) + (
            (f"cap{float_label(self.softcap)}",) if self.softcap else ()) + (
            (f"win{self.window}",) if self.window else ())


def attention(m: ir.Module, n: Attention, offsets: tuple[int, int, int], isa: str, kv: str = "f32",
              max_seq: int = 0, bf16_unit: str = "", kv_prefetch: int = KV_PREFETCH):
    """Single-token GQA over the cache for kv heads [g0, g1): bias, q/k norms, RoPE, cache write, softmax(qK)V.

    q/k norms (n.qk_norm) are RMSNorms of (projection + bias) before RoPE, weights qn/kn: 'head' normalises each
    head over head_dim (weights [hd]); 'proj' the whole projection (weights [H*hd] / [KV*hd]), whose sums every
    thread takes over all heads itself (the projection is whole after the QKV stage: no barrier).
    n.softcap caps the scores (Gemma 2); n.window > 0 attends to the last `window` positions only (the cache
    keeps every position: only the loops start later), the same function for decode, prefill and batches.

    The cache layout is kv_layout(max_seq, ...): K in blocks of B positions (dimension-major inside a block), V
    position after position per kv head, so a kv head's scan reads both front to back. The core is vectorised
    in a fixed order, so a token's output depends only on its inputs and position: the scores of B positions
    at once, q.k as NP interleaved multiply-add chains over the dimensions (dimension d into chain d mod NP,
    the chains then summed by a halving tree), no horizontal sum; exp over ATT_LANES scores of a head at a time
    (cgutils.exp_vec), their sum lane-wise then by the halving tree; the weighted V sum in W = gcd(head_dim,
    16)-lane accumulators, one position after another. The rep query heads of a kv group go together: each K
    and V entry is loaded (and widened) once per group. FMA where the ISA has it (one rounding per
    multiply-add, the exponential's polynomial included), separate multiply and add on the generic path.

    kv: the cache's element type, 'f32', 'f16' or 'bf16'. 'f16' (IEEE half, rounded to nearest even as numpy's
    astype does; the interpreter's kv='f16' rounds the same way): K and V rounded once when written, widened on read.
    'bf16' (rounded to nearest even, layout.quant.round_bf16) is also the arithmetic's type: the query is rounded
    to bf16 and q.k taken as bf16 pair dot products (cgutils.bf16_dot: exact products, f32 sums), and the
    weighted V sum takes bf16(exp(score - max)) in pairs of positions, divided by the f32 sum of the unrounded
    weights. bf16_unit (Target.bf16_unit) says what takes the dot products: 'dpbf16', AVX512_BF16's VDPBF16PS, two
    multiply-adds per lane (half the instructions per cache byte of f16; on an AMX Xeon it issues at a quarter
    of the FMA rate, so there it is slower than f16: docs/journal/performance.md); '', an FMA emulation in the same
    order (bit-identical, and slower than f16: two FMAs and four integer ops per pair); 'amx', the tile unit (TDPBF16PS
    for q.k and the weighted V sum: the same exact products and f32 sums, taken in the tile unit's order, so not
    bit-identical to the other two), where the geometry fits it (core_unit, amx_fits), else 'dpbf16'.

    kv_prefetch: how far ahead (bytes) the K and V scans prefetch, 0 for none; a schedule knob (this host's choice:
    codegen/attn_tune.py), the numbers do not change.
    """
    s = CoreShape(n, offsets, isa, kv, max_seq, bf16_unit, kv_prefetch)

    def build(b, qkv, bq, bk, bv, qn, kn, kc, vc, cos, sin, att, scores, pos, g0, g1):
        f = CoreFrame(b, s, qkv, bq, bk, bv, qn, kn, kc, vc, cos, sin, att, scores, pos)
        with Loop(b, g0, g1, "g") as g:
            attend_group(f, g)
        if s.amx:
            _tile(b, "tilerelease")
        b.ret_void()

    kvp = P(i16) if KV_BYTES[kv] == 2 else P(f32)
    return internal_function(m, s.key(), (P(f32),) * 6 + (kvp, kvp) + (P(f32),) * 4 + (i64, i64, i64), build)


def attend_group(f: CoreFrame, g) -> None:
    """Kv head g: this position's K and V into the cache, then its rep query heads over [start, pos] into att."""
    b, s = f.b, f.s
    goff = b.mul(g, c64(s.hd))
    kbase = b.mul(g, c64(s.nb * s.hd * s.B))  # this kv head's K blocks
    vbase = b.mul(g, c64(s.S2 * s.hd))  # and its V rows
    write_position(f, goff, kbase, vbase)
    load_queries(f, g)
    score_scan(f, kbase)
    inv = softmax_scan(f)
    (amx_weighted_sum if s.amx else weighted_sum)(f, g, vbase, inv)


class CoreFrame:
    """One call's emission state, shared by the scans: the builder, the arguments, the values every kv head
    reads (pos + 1, the window's start, pos's block and lane) and the scratch, allocated once in the entry block
    (the roped K and queries, the per-head maxima, q.k chains, V accumulators and exponential sums). Emits the
    call's preamble: the tile configuration, the projection-wide q/k norm factors ('proj')."""

    def __init__(self, b: ir.IRBuilder, s: CoreShape, qkv, bq, bk, bv, qn, kn, kc, vc, cos, sin, att, scores, pos):
        self.b, self.s = b, s
        self.qkv, self.bq, self.bk, self.bv, self.qn, self.kn = qkv, bq, bk, bv, qn, kn
        self.kc, self.vc, self.cos, self.sin, self.att, self.scores, self.pos = kc, vc, cos, sin, att, scores, pos
        hd, rep = s.hd, s.rep
        # sqrt (inv_rms) declared up front: where the module text has always had it, with q/k norms or without
        intrinsic(b.module, "llvm.sqrt.f32", f32, [f32])
        self.kr = b.bitcast(alloca_once(b, ir.ArrayType(f32, hd)), P(f32))
        self.row = b.mul(pos, c64(s.half))  # pos's row of the cos / sin tables
        self.vtail = None
        if s.amx:
            _amx_config(b, rep, hd)
            self.vtail = alloca_once(b, ir.ArrayType(i8, 16 * 4 * hd))  # the last V pair-rows, zero-padded to 16
            self.vtail.align = 64
        self.q_inv = self.k_inv = None
        if s.qk_norm == "proj":
            self.q_inv = inv_rms(b, b.gep(qkv, [c64(s.qo)]), bq if s.bias else None, s.H * hd, s.eps)
            self.k_inv = inv_rms(b, b.gep(qkv, [c64(s.ko)]), bk if s.bias else None, s.KV * hd, s.eps)
        self.npos = b.add(pos, c64(1))
        self.start = c64(0)
        if s.window:  # max(0, pos + 1 - window): the oldest position still inside the window
            lo = b.sub(self.npos, c64(s.window))
            self.start = b.select(b.icmp_signed(">", lo, c64(0)), lo, c64(0))
        self.kc8, self.vc8 = b.bitcast(kc, P(i8)), b.bitcast(vc, P(i8))
        self.bt = bt = V(f32, s.B)
        self.mx = [alloca_once(b, bt) for _ in range(rep)]
        self.qk = [[alloca_once(b, bt) for _ in range(s.NP)] for _ in range(rep)]
        self.accs = [[alloca_once(b, s.vt) for _ in range(s.nc)] for _ in range(rep)]
        self.esum = [alloca_once(b, V(f32, s.L)) for _ in range(rep)]
        self.qr = b.bitcast(alloca_once(b, ir.ArrayType(f32, rep * hd)), P(f32))
        # kv='bf16': the queries as bf16 (read as i32 pairs), and the weights as bf16 over the scores
        self.qbf = b.bitcast(alloca_once(b, ir.ArrayType(i32, rep * hd // 2)), P(i16)) if s.bf else None
        self.sbf = b.bitcast(scores, P(i16)) if s.bf else None
        self.lane_ids = ir.Constant(V(i64, s.B), list(range(s.B)))
        self.ninf_b = const_vec(f32, s.B, -math.inf)
        self.pos_blk, self.pos_lane = b.udiv(pos, c64(s.B)), b.urem(pos, c64(s.B))

    # --- loads, stores and steps the scans share -------------------------------------------------
    def vload(self, base, i):
        """W floats from element i."""
        return self.b.load(self.b.bitcast(self.b.gep(base, [i]), P(self.s.vt)), align=4)

    def cload(self, base, i, lanes=None):
        """`lanes` (default W) cache entries from element i, as floats (f32 / f16 caches)."""
        assert not self.s.bf, "bf16 entries are read in pairs (k_unit, v_chunks)"
        return load_entries(self.b, base, i, lanes or self.s.W, self.s.half_kv, self.s.isa)

    def cstore(self, v, base, i) -> None:
        """W floats into the cache from element i (f32 / f16 caches)."""
        assert not self.s.bf, "bf16 entries are written in pairs (write_position)"
        store_entries(self.b, v, base, i, self.s.half_kv, self.s.isa)

    def ahead(self, base8, at, nbytes: int) -> None:
        prefetch_ahead(self.b, base8, at, nbytes, self.s.kv_prefetch)

    def rope(self, src, bsrc, dst, norm=None) -> None:
        rope_into(self.b, src, bsrc, dst, self.cos, self.sin, self.row, self.s.half, norm)

    def norm_of(self, off, src, bsrc, w, proj_inv):
        """(weights, 1/rms) of the head at `off` of a projection (src: the head; None without q/k norms)."""
        if self.s.qk_norm == "head":
            return w, inv_rms(self.b, src, bsrc, self.s.hd, self.s.eps)
        if self.s.qk_norm == "proj":
            return self.b.gep(w, [off]), proj_inv
        return None

    def v_units(self):
        """The V units [v_lo, v_hi) a scan covers: positions; bf16: pairs of them."""
        b, start, npos = self.b, self.start, self.npos
        return (b.udiv(start, c64(2)), b.udiv(b.add(npos, c64(1)), c64(2))) if self.s.bf else (start, npos)

    def k_unit(self, blk, u):
        """Unit u of the K block at blk as B lanes: dimension u (bf16: i32 pairs, dimensions 2u, 2u+1)."""
        b, B = self.b, self.s.B
        if self.s.bf:
            return b.load(b.bitcast(b.gep(self.kc, [b.add(blk, b.mul(u, c64(2 * B)))]), P(V(i32, B))), align=4)
        return self.cload(self.kc, b.add(blk, b.mul(u, c64(B))), B)

    def q_unit(self, r, u):
        """Head r's query at unit u, splat over B lanes."""
        b, s = self.b, self.s
        if s.bf:
            qp = b.gep(self.qbf, [b.add(c64(r * s.hd), b.mul(u, c64(2)))])
            return splat(b, b.load(b.bitcast(qp, P(i32)), align=4), s.B)
        return splat(b, b.load(b.gep(self.qr, [b.add(c64(r * s.hd), u)])), s.B)

    def qk_step(self, kd, q, acc):
        s = self.s
        return bf16_dot(self.b, acc, kd, q, s.bf16_hw, s.fma) if s.bf else muladd(self.b, q, kd, acc, s.fma)

    def v_chunks(self, base, u):
        """V unit u's row in nc chunks of W: position u (bf16: pair-row u, positions 2u, 2u+1 of W dimensions)."""
        b, s = self.b, self.s
        if s.bf:
            row = b.add(base, b.mul(u, c64(2 * s.hd)))
            return [b.load(b.bitcast(b.gep(self.vc, [b.add(row, c64(2 * c * s.W))]), P(V(i32, s.W))), align=4)
                    for c in range(s.nc)]
        row = b.add(base, b.mul(u, c64(s.hd)))
        return [self.cload(self.vc, b.add(row, c64(c * s.W))) for c in range(s.nc)]

    def weight(self, r, u):
        """Head r's softmax weight of V unit u, splat over W lanes (bf16: of positions 2u, 2u+1)."""
        b, s = self.b, self.s
        if s.bf:
            pp = b.gep(self.sbf, [b.add(c64(2 * r * s.SS), b.mul(u, c64(2)))])
            return splat(b, b.load(b.bitcast(pp, P(i32)), align=4), s.W)
        return splat(b, b.load(b.gep(self.scores, [b.add(c64(r * s.SS), u)])), s.W)

    def v_step(self, vv, p, acc):
        s = self.s
        return bf16_dot(self.b, acc, vv, p, s.bf16_hw, s.fma) if s.bf else muladd(self.b, p, vv, acc, s.fma)


# --- the scans of one kv head, in the order attend_group runs them ---------------------------------
def write_position(f: CoreFrame, goff, kbase, vbase) -> None:
    """This position's K (+ bias, normalised, roped) and V (+ bias) of the kv head at goff into the cache: K into
    its block, dimension d at d * B (a strided store: hd entries per token, against hd * (pos + 1) read by the
    scans; bf16: dimension pairs side by side), V after the previous positions' rows (bf16: interleaved with its
    pair's)."""
    b, s = f.b, f.s
    B, hd, W = s.B, s.hd, s.W
    ksrc, kb = b.gep(f.qkv, [b.add(c64(s.ko), goff)]), b.gep(f.bk, [goff]) if s.bias else None
    f.rope(ksrc, kb, f.kr, f.norm_of(goff, ksrc, kb, f.kn, f.k_inv))
    kpos = b.add(b.add(kbase, b.mul(f.pos_blk, c64(hd * B))), b.mul(f.pos_lane, c64(2 if s.bf else 1)))
    for c in range(s.nc):
        kv_ = f.vload(f.kr, c64(c * W))
        hv = float_to_bf16(b, kv_) if s.bf else float_to_half(b, kv_, s.isa) if s.half_kv else kv_
        for t in range(W):
            d = c * W + t
            at = (d - d % 2) * B + d % 2 if s.bf else d * B
            b.store(b.extract_element(hv, c32(t)), b.gep(f.kc, [b.add(kpos, c64(at))]))
    if s.bf:
        odd = b.urem(f.pos, c64(2))
        vrow = b.add(b.add(vbase, b.mul(b.udiv(f.pos, c64(2)), c64(2 * hd))), odd)
        # The pair scan reads pos's partner pos + 1 with weight 0 before it is written; 0 x NaN is NaN, and a
        # slot keeps an earlier sequence's entries (Session.reset does not clear it), so an even position
        # zeroes its partner's V first (an odd one zeroes its own entries, then overwrites them).
        part = b.add(vrow, b.sub(c64(1), odd))  # even: pos + 1's entries; odd: its own
        for d in range(hd):
            b.store(ir.Constant(i16, 0), b.gep(f.vc, [b.add(part, c64(2 * d))]))
    else:
        vrow = b.add(vbase, b.mul(f.pos, c64(hd)))
    for c in range(s.nc):
        v = f.vload(f.qkv, b.add(c64(s.vo + c * W), goff))
        if s.bias:
            v = b.fadd(v, f.vload(f.bv, b.add(goff, c64(c * W))))
        if s.bf:
            hv = float_to_bf16(b, v)
            for t in range(W):
                b.store(b.extract_element(hv, c32(t)), b.gep(f.vc, [b.add(vrow, c64(2 * (c * W + t)))]))
        else:
            f.cstore(v, f.vc, b.add(vrow, c64(c * W)))


def load_queries(f: CoreFrame, g) -> None:
    """Kv head g's rep query heads (+ bias, normalised), roped side by side in qr; bf16: also rounded into qbf,
    W at a time (pair m of head r is the i32 at qbf[r * hd + 2m]); on the tile unit loaded as its A tiles
    (head r's dimensions 32t .. 32t + 31 in row r of tile T_Q + t)."""
    b, s = f.b, f.s
    hd, W = s.hd, s.W
    with Loop(b, c64(0), c64(s.rep), "h") as r:
        hoff = b.mul(b.add(b.mul(g, c64(s.rep)), r), c64(hd))
        qsrc, qb = b.gep(f.qkv, [b.add(c64(s.qo), hoff)]), b.gep(f.bq, [hoff]) if s.bias else None
        f.rope(qsrc, qb, b.gep(f.qr, [b.mul(r, c64(hd))]), f.norm_of(hoff, qsrc, qb, f.qn, f.q_inv))
    if s.bf:
        with Loop(b, c64(0), c64(s.rep * hd // W), "qbf") as i:
            b.store(float_to_bf16(b, f.vload(f.qr, b.mul(i, c64(W)))),
                    b.bitcast(b.gep(f.qbf, [b.mul(i, c64(W))]), P(V(i16, W))), align=2)
    if s.amx:
        for t in range(hd // 32):
            _tile(b, "tileloadd64", T_Q + t, b.gep(b.bitcast(f.qbf, P(i8)), [c64(64 * t)]), c64(2 * hd))


def score_scan(f: CoreFrame, kbase) -> None:
    """scores[r][s] = q_r.k_s * scale (soft-capped) for the K blocks (from kbase) holding [start, pos], lanes
    outside it -inf; mx[r] their lane-wise maximum."""
    b, s = f.b, f.s
    B, SS, bt = s.B, s.SS, f.bt
    for r in range(s.rep):
        b.store(f.ninf_b, f.mx[r])
    with Loop(b, b.udiv(f.start, c64(B)), b.add(f.pos_blk, c64(1)), "kb") as j:
        blk = b.add(kbase, b.mul(j, c64(s.hd * B)))
        if s.amx:
            _tile_block_scores(f, j, blk)
        else:
            _chain_block_scores(f, blk)
        s_ids = b.add(splat(b, b.mul(j, c64(B)), B), f.lane_ids)
        live = b.and_(b.icmp_signed(">=", s_ids, splat(b, f.start, B)),
                      b.icmp_signed("<", s_ids, splat(b, f.npos, B)))
        for r in range(s.rep):
            at_r = b.bitcast(b.gep(f.scores, [b.add(c64(r * SS), b.mul(j, c64(B)))]), P(bt))
            raw = b.load(at_r, align=4) if s.amx else tree_sum(b, [b.load(a_) for a_ in f.qk[r]])
            sc = b.fmul(raw, const_vec(f32, B, s.scale))
            if s.softcap:  # Gemma 2: scores -> cap * tanh(scores / cap) before the softmax
                sc = softcap(b, sc, s.softcap)
            sc = b.select(live, sc, f.ninf_b)
            b.store(sc, b.bitcast(b.gep(f.scores, [b.add(c64(r * SS), b.mul(j, c64(B)))]), P(bt)), align=4)
            m0 = b.load(f.mx[r])
            b.store(b.select(b.fcmp_ordered(">", sc, m0), sc, m0), f.mx[r])


def _chain_block_scores(f: CoreFrame, blk) -> None:
    """q.k of the block at blk for every head as NP multiply-add chains over the units (unit u into chain
    u mod NP), left in qk[r] (score_scan sums the chains)."""
    b, s = f.b, f.s
    for r in range(s.rep):
        for a_ in f.qk[r]:
            b.store(const_vec(f32, s.B, 0.0), a_)
    with Loop(b, c64(0), c64(s.qk_units // s.QU), "kd") as dd:
        u0 = b.mul(dd, c64(s.QU))
        kp = b.mul(b.add(blk, b.mul(u0, c64(s.B * s.upair))), c64(s.esz))
        f.ahead(f.kc8, kp, s.kstep)
        chains = [[b.load(a_) for a_ in f.qk[r]] for r in range(s.rep)]
        for u in range(s.QU):
            uu = b.add(u0, c64(u))
            kd = f.k_unit(blk, uu)
            for r in range(s.rep):
                chains[r][u % s.NP] = f.qk_step(kd, f.q_unit(r, uu), chains[r][u % s.NP])
        for r in range(s.rep):
            for a_, x in zip(f.qk[r], chains[r]):
                b.store(x, a_)


def _tile_block_scores(f: CoreFrame, j, blk) -> None:
    """The tile unit: block j's 16 scores of every head, row r of T_S, stored where the scores go (unscaled)."""
    b, s = f.b, f.s
    f.ahead(f.kc8, b.mul(blk, c64(s.esz)), s.hd * s.B * s.esz)
    _tile(b, "tilezero", T_S)
    for t in range(s.hd // 32):  # B: dimension pairs 16t .. 16t + 15 of the 16 positions
        _tile(b, "tileloadd64", T_B, b.gep(f.kc8, [b.mul(b.add(blk, c64(32 * t * s.B)), c64(s.esz))]), c64(64))
        _tile(b, "tdpbf16ps", T_S, T_Q + t, T_B)
    _tile(b, "tilestored64", T_S, b.gep(f.scores, [b.mul(j, c64(s.B))]), c64(4 * s.SS))


def softmax_scan(f: CoreFrame) -> list:
    """exp(scores - max) of each head, ATT_LANES positions at a time from start (positions past pos masked to
    -inf: exp gives 0, stored into the scratch's slack; bf16: rounded into the head's bf16 weights), summed
    lane-wise, then by the halving tree. Returns each head's 1 / sum (an IR float)."""
    b, s = f.b, f.s
    L, SS, npos, start = s.L, s.SS, f.npos, f.start
    nchunk = b.udiv(b.add(b.sub(npos, start), c64(L - 1)), c64(L))
    inv = []
    for r in range(s.rep):
        mv = b.load(f.mx[r])
        mr = b.extract_element(mv, c32(0))
        for t in range(1, s.B):  # the max of the lanes (order does not matter for a max)
            x = b.extract_element(mv, c32(t))
            mr = b.select(b.fcmp_ordered(">", x, mr), x, mr)
        m_v = splat(b, mr, L)
        b.store(const_vec(f32, L, 0.0), f.esum[r])
        with Loop(b, c64(0), nchunk, "ex") as j:
            s0 = b.add(start, b.mul(j, c64(L)))
            sp = b.bitcast(b.gep(f.scores, [b.add(c64(r * SS), s0)]), P(V(f32, L)))
            live = b.icmp_signed("<", b.add(splat(b, s0, L), ir.Constant(V(i64, L), list(range(L)))),
                                 splat(b, npos, L))
            x = b.select(live, b.fsub(b.load(sp, align=4), m_v), const_vec(f32, L, -math.inf))
            p = exp_vec(b, x, s.fma)
            if s.bf:  # bf16(p) at i16 index s of the head's scratch: below the floats not yet read (p is 0
                # or normal: exp_vec gives exactly 0 below -87.33, so the instruction's flush changes nothing)
                b.store(float_to_bf16(b, p, s.bf16_hw), b.bitcast(b.gep(f.sbf, [b.add(c64(2 * r * SS), s0)]),
                                                                  P(V(i16, L))), align=2)
            else:
                b.store(p, sp, align=4)
            b.store(b.fadd(b.load(f.esum[r]), p), f.esum[r])
        inv.append(b.fdiv(cf(1.0), hsum(b, b.load(f.esum[r]))))
        if s.bf:  # the pair scan reads the neighbours of an odd start / end: their weights are 0
            odd_start = b.icmp_unsigned("!=", b.urem(start, c64(2)), c64(0))
            for at in (npos, b.select(odd_start, b.sub(start, c64(1)), npos)):
                b.store(ir.Constant(i16, 0), b.gep(f.sbf, [b.add(c64(2 * r * SS), at)]))
        if s.amx:  # the tile reads 32 weights at a time: those past pos are 0 (the slots hold older floats)
            b.store(const_vec(i16, 32, 0), b.bitcast(b.gep(f.sbf, [b.add(c64(2 * r * SS), npos)]),
                                                     P(V(i16, 32))), align=2)
    return inv


def weighted_sum(f: CoreFrame, g, vbase, inv) -> None:
    """att_r = (sum_s p_r(s) v_s) * inv_r for kv head g's heads in vector accumulators: VB units at a time, each V
    row (from vbase) read whole by the first head group and from L1 by the others (CoreShape.RB)."""
    b, s = f.b, f.s
    hd, W = s.hd, s.W
    for ar in f.accs:
        for a in ar:
            b.store(const_vec(f32, W, 0.0), a)
    v_lo, v_hi = f.v_units()
    VB = s.RB // 2 if s.bf else s.RB
    with Loop(b, c64(0), b.udiv(b.add(b.sub(v_hi, v_lo), c64(VB - 1)), c64(VB)), "pb") as j:
        u_lo = b.add(v_lo, b.mul(j, c64(VB)))
        u_end = b.add(u_lo, c64(VB))
        u_hi = b.select(b.icmp_signed("<", u_end, v_hi), u_end, v_hi)
        for k, heads in enumerate(s.head_groups):
            with Loop(b, u_lo, u_hi, f"pv{k}") as u:
                if k == 0:  # the first head group reads the rows from memory, the others from L1
                    vp = b.mul(b.add(vbase, b.mul(u, c64(hd * s.upair))), c64(s.esz))
                    f.ahead(f.vc8, vp, s.vstep)
                vvs = f.v_chunks(vbase, u)
                for r in heads:
                    p = f.weight(r, u)
                    for c, vv in enumerate(vvs):
                        b.store(f.v_step(vv, p, b.load(f.accs[r][c])), f.accs[r][c])
    for r in range(s.rep):
        out = b.gep(f.att, [b.mul(b.add(b.mul(g, c64(s.rep)), c64(r)), c64(hd))])
        iv = splat(b, inv[r], W)
        for c in range(s.nc):
            b.store(b.fmul(b.load(f.accs[r][c]), iv), b.bitcast(b.gep(out, [c64(c * W)]), P(s.vt)), align=4)


def amx_weighted_sum(f: CoreFrame, g, vbase, inv) -> None:
    """att_r = (sum_s p_r(s) v_s) * inv_r on the tile unit: per 16 pair-rows (32 positions) of V, A = the heads'
    bf16 weights of those positions, B = 16 dimensions of the rows, one output tile per 16 dimensions
    accumulating over the whole scan. The last rows (fewer than 16) are copied into a zeroed buffer first: the
    tile always loads 16 rows, and those past the scan are another head's or outside the cache (their weights
    are 0, but 0 x a stale inf is NaN)."""
    b, s = f.b, f.s
    hd, esz, rep, vtail = s.hd, s.esz, s.rep, f.vtail
    v_lo, v_hi = f.v_units()
    nu = b.sub(v_hi, v_lo)
    nfull = b.udiv(nu, c64(16))
    sbf8, row_b = b.bitcast(f.sbf, P(i8)), 4 * hd  # bytes per V pair-row
    for c in range(hd // 16):
        _tile(b, "tilezero", T_O + c)

    def chunk(u0, vsrc):  # 16 pair-rows from u0, B read from vsrc (bytes)
        _tile(b, "tileloadd64", T_Q, b.gep(sbf8, [b.mul(u0, c64(4))]), c64(4 * s.SS))
        for c in range(hd // 16):
            _tile(b, "tileloadd64", T_B, b.gep(vsrc, [c64(64 * c)]), c64(row_b))
            _tile(b, "tdpbf16ps", T_O + c, T_Q, T_B)

    with Loop(b, c64(0), nfull, "pv") as j:
        u0 = b.add(v_lo, b.mul(j, c64(16)))
        vp = b.mul(b.add(vbase, b.mul(u0, c64(2 * hd))), c64(esz))
        f.ahead(f.vc8, vp, 16 * row_b)
        chunk(u0, b.gep(f.vc8, [vp]))
    u0 = b.add(v_lo, b.mul(nfull, c64(16)))
    rest = b.sub(nu, b.mul(nfull, c64(16)))
    with b.if_then(b.icmp_unsigned(">", rest, c64(0))):
        tb = b.bitcast(vtail, P(V(i32, 16)))
        for k in range(16 * row_b // 64):
            b.store(const_vec(i32, 16, 0), b.gep(tb, [c64(k)]), align=64)
        src = b.gep(f.vc8, [b.mul(b.add(vbase, b.mul(u0, c64(2 * hd))), c64(esz))])
        with Loop(b, c64(0), rest, "vt") as i:
            for k in range(row_b // 64):
                at = b.add(b.mul(i, c64(row_b)), c64(64 * k))
                v = b.load(b.bitcast(b.gep(src, [at]), P(V(i32, 16))), align=1)
                b.store(v, b.bitcast(b.gep(b.bitcast(vtail, P(i8)), [at]), P(V(i32, 16))), align=64)
        chunk(u0, b.bitcast(vtail, P(i8)))
    out0 = b.gep(f.att, [b.mul(b.mul(g, c64(rep)), c64(hd))])  # the group's heads, hd floats apart
    for c in range(hd // 16):
        _tile(b, "tilestored64", T_O + c, b.gep(out0, [c64(16 * c)]), c64(4 * hd))
    for r in range(rep):
        iv = splat(b, inv[r], 16)
        for c in range(hd // 16):
            at = b.bitcast(b.gep(out0, [c64(r * hd + 16 * c)]), P(V(f32, 16)))
            b.store(b.fmul(b.load(at, align=4), iv), at, align=4)


# --- helpers that need no frame ----------------------------------------------------------------
def tree_sum(b: ir.IRBuilder, vals: list):
    """The pairwise sum of a list of vectors in a fixed shape: ((v0 + v1) + (v2 + v3)) + v4 ..."""
    while len(vals) > 1:
        vals = [b.fadd(vals[j], vals[j + 1]) if j + 1 < len(vals) else vals[j] for j in range(0, len(vals), 2)]
    return vals[0]


def biased(b: ir.IRBuilder, src, bsrc, i):
    """src[i] + bsrc[i] (bsrc None: no bias, src[i])."""
    x = b.load(b.gep(src, [i]))
    return b.fadd(x, b.load(b.gep(bsrc, [i]))) if bsrc is not None else x


def inv_rms(b: ir.IRBuilder, src, bsrc, count: int, eps: float):
    """1 / sqrt(mean((src + bias)^2) + eps) over `count` values (a q/k norm's factor; bsrc as in biased)."""
    acc = alloca_once(b, f32)
    b.store(cf(0.0), acc)
    with Loop(b, c64(0), c64(count), "ms") as i:
        x = biased(b, src, bsrc, i)
        b.store(b.fadd(b.load(acc), b.fmul(x, x)), acc)
    sqrt = intrinsic(b.module, "llvm.sqrt.f32", f32, [f32])
    return b.fdiv(cf(1.0), b.call(sqrt, [b.fadd(b.fdiv(b.load(acc), cf(count)), cf(eps))]))


def rope_into(b: ir.IRBuilder, src, bsrc, dst, cos, sin, row, half: int, norm=None) -> None:
    """dst[i] = rotate-half RoPE of (src + bias) over 2 * half values with the tables' entries from `row` (pos *
    half); norm = (weights, 1/rms): normalised first."""
    with Loop(b, c64(0), c64(half), "rp") as i:
        ih = b.add(i, c64(half))
        x1, x2 = biased(b, src, bsrc, i), biased(b, src, bsrc, ih)
        if norm is not None:
            w, inv = norm
            x1 = b.fmul(b.fmul(x1, inv), b.load(b.gep(w, [i])))
            x2 = b.fmul(b.fmul(x2, inv), b.load(b.gep(w, [ih])))
        cs, sn = b.load(b.gep(cos, [b.add(row, i)])), b.load(b.gep(sin, [b.add(row, i)]))
        b.store(b.fadd(b.fmul(x1, cs), b.fmul(b.fsub(cf(0.0), x2), sn)), b.gep(dst, [i]))
        b.store(b.fadd(b.fmul(x2, cs), b.fmul(x1, sn)), b.gep(dst, [ih]))


def load_entries(b: ir.IRBuilder, base, i, lanes: int, half_kv: bool, isa: str):
    """`lanes` cache entries from element i, as floats: an f32 cache, or an f16 one widened."""
    if not half_kv:
        return b.load(b.bitcast(b.gep(base, [i]), P(V(f32, lanes))), align=4)
    return half_to_float(b, b.load(b.bitcast(b.gep(base, [i]), P(V(i16, lanes))), align=2), isa)


def store_entries(b: ir.IRBuilder, v, base, i, half_kv: bool, isa: str) -> None:
    """The floats of vector v into the cache from element i: an f32 cache, or an f16 one rounded."""
    if half_kv:
        b.store(float_to_half(b, v, isa), b.bitcast(b.gep(base, [i]), P(V(i16, v.type.count))), align=2)
    else:
        b.store(v, b.bitcast(b.gep(base, [i]), P(v.type)), align=4)


def prefetch_ahead(b: ir.IRBuilder, base8, at, nbytes: int, distance: int) -> None:
    """Prefetch every line of the `nbytes` read from byte `at` of base8, `distance` bytes on (0: none)."""
    if distance:
        prefetch_lines(b, base8, [b.add(at, c64(distance + 64 * i)) for i in range(-(-nbytes // 64))])
