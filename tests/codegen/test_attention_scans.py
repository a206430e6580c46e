"""The attention core's pieces (codegen/attention.py), each emitted alone into a small function, JIT-compiled and
checked against NumPy: the helpers that need no frame (tree_sum, biased, inv_rms, rope_into, load_entries,
store_entries, prefetch_ahead) and the scans one kv head runs in order (write_position, load_queries,
score_scan, softmax_scan, weighted_sum, amx_weighted_sum) on f32, f16 and bf16 caches, on every bf16 unit the
host has. The whole core is checked through the runtime (tests/runtime/test_kv_cache.py,
test_attention_amx.py); here a piece that goes wrong is named."""

import ctypes
import math
import re

import numpy as np
import pytest
from llvmlite import ir

from cflow.codegen.attention import (
    ATT_LANES,
    CoreFrame,
    CoreShape,
    _tile,
    amx_weighted_sum,
    biased,
    inv_rms,
    kv_layout,
    load_entries,
    load_queries,
    prefetch_ahead,
    rope_into,
    score_scan,
    softmax_scan,
    store_entries,
    tree_sum,
    weighted_sum,
    write_position,
)
from cflow.codegen.cgutils import Loop, P, V, c64, f32, i16, i32, i64, void
from cflow.codegen.library import compile_ir
from cflow.codegen.target import generic_target, host_target
from cflow.ir import Attention
from cflow.layout.quant import bf16_bits, bf16_to_f32

HOST = host_target(env=False)
UNIT = HOST.bf16_unit  # 'amx', 'dpbf16' or ''
VP, I64 = ctypes.c_void_p, ctypes.c_int64


def _jit(args, build, target=HOST):
    """f(*args) with body build(b, *fn.args), compiled; ctypes takes pointers for pointer args, int64 for i64."""
    m = ir.Module(name="piece")
    m.triple = target.triple
    fn = ir.Function(m, ir.FunctionType(void, list(args)), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    build(b, *fn.args)
    b.ret_void()
    lib = compile_ir(m, target=target, cache=False)
    return lib.get_cfunc("f", None, *[I64 if a == i64 else VP for a in args])


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _vec(b, base, i: int, n: int):
    return b.load(b.bitcast(b.gep(base, [c64(i)]), P(V(f32, n))), align=4)


# --- helpers that need no frame -----------------------------------------------------------------
def test_tree_sum_adds_pairwise_in_a_fixed_shape():
    n, lanes = 5, 4
    f = _jit([P(f32), P(f32)], lambda b, x, out: b.store(tree_sum(b, [_vec(b, x, lanes * k, lanes) for k in range(n)]),
                                                         b.bitcast(out, P(V(f32, lanes))), align=4))
    x = (np.random.default_rng(0).standard_normal((n, lanes)) * np.array([1e8, 1, -1e8, 1e-3, 3])[:, None]).astype(
        np.float32)
    out = np.zeros(lanes, np.float32)
    f(_ptr(x), _ptr(out))
    v = list(x)
    np.testing.assert_array_equal(out, ((v[0] + v[1]) + (v[2] + v[3])) + v[4])  # float32 throughout: exact


def test_biased_adds_the_bias_only_where_there_is_one():
    def build(b, src, bsrc, out):
        b.store(biased(b, src, bsrc, c64(3)), b.gep(out, [c64(0)]))
        b.store(biased(b, src, None, c64(3)), b.gep(out, [c64(1)]))

    f = _jit([P(f32)] * 3, build)
    src, bias, out = np.arange(8, dtype=np.float32) + 0.25, np.full(8, 10.5, np.float32), np.zeros(2, np.float32)
    f(_ptr(src), _ptr(bias), _ptr(out))
    assert out.tolist() == [13.75, 3.25]


@pytest.mark.parametrize("count", [1, 37, 64])
def test_inv_rms(count):
    def build(b, src, bsrc, out):
        b.store(inv_rms(b, src, bsrc, count, 1e-5), b.gep(out, [c64(0)]))
        b.store(inv_rms(b, src, None, count, 1e-6), b.gep(out, [c64(1)]))

    f = _jit([P(f32)] * 3, build)
    rng = np.random.default_rng(count)
    src, bias = rng.standard_normal(count).astype(np.float32), rng.standard_normal(count).astype(np.float32)
    out = np.zeros(2, np.float32)
    f(_ptr(src), _ptr(bias), _ptr(out))
    ref = [1 / np.sqrt(np.mean((x.astype(np.float64)) ** 2) + eps) for x, eps in ((src + bias, 1e-5), (src, 1e-6))]
    np.testing.assert_allclose(out, ref, rtol=2e-6)


@pytest.mark.parametrize("normed", [False, True])
def test_rope_into_rotates_half_at_the_position(normed):
    half, pos, S = 8, 5, 7

    def build(b, src, bsrc, dst, cos, sin, w, inv_p, pos_p):
        row = b.mul(b.load(b.bitcast(pos_p, P(i64))), c64(half))
        norm = (w, b.load(inv_p)) if normed else None
        rope_into(b, src, bsrc, dst, cos, sin, row, half, norm)

    f = _jit([P(f32)] * 8, build)
    rng = np.random.default_rng(1)
    src, bias, w = (rng.standard_normal(2 * half).astype(np.float32) for _ in range(3))
    ang = rng.random((S, half)).astype(np.float32) * 6
    cos, sin = np.cos(ang), np.sin(ang)
    inv, dst = np.array([0.75], np.float32), np.zeros(2 * half, np.float32)
    f(_ptr(src), _ptr(bias), _ptr(dst), _ptr(cos), _ptr(sin), _ptr(w), _ptr(inv), _ptr(np.array([pos], np.int64)))
    x = src + bias
    if normed:
        x = x * inv[0] * w
    x1, x2, c, s = x[:half], x[half:], cos[pos], sin[pos]
    np.testing.assert_allclose(dst, np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("half_kv", [False, True])
def test_cache_entries_load_widened_and_store_rounded(half_kv):
    lanes = 8

    def build(b, src, dst, out):
        v = load_entries(b, src, c64(3), lanes, half_kv, HOST.isa)
        b.store(v, b.bitcast(out, P(V(f32, lanes))), align=4)
        store_entries(b, _vec(b, out, 0, lanes), dst, c64(5), half_kv, HOST.isa)

    ety = i16 if half_kv else f32
    f = _jit([P(ety), P(ety), P(f32)], build)
    rng = np.random.default_rng(2)
    dt = np.float16 if half_kv else np.float32
    src = rng.standard_normal(16).astype(dt)
    dst, out = np.zeros(16, dt), np.zeros(lanes, np.float32)
    f(_ptr(src), _ptr(dst), _ptr(out))
    np.testing.assert_array_equal(out, src[3:3 + lanes].astype(np.float32))
    np.testing.assert_array_equal(dst[5:5 + lanes], src[3:3 + lanes])
    assert not dst[:5].any() and not dst[5 + lanes:].any()
    if half_kv:  # rounding to nearest even, as numpy's astype
        x = np.array([1 + 2 ** -11, 1 + 3 * 2 ** -11, 65519.0, 1e-8, -2.5e-5, 3.14159, -7.77, 0.1], np.float32)
        f2 = _jit([P(f32), P(i16)], lambda b, xs, d: store_entries(b, _vec(b, xs, 0, lanes), d, c64(0), True, HOST.isa))
        got = np.zeros(lanes, np.float16)
        f2(_ptr(x), _ptr(got))
        np.testing.assert_array_equal(got.view(np.uint16), x.astype(np.float16).view(np.uint16))


def test_prefetch_ahead_covers_the_read_a_distance_on():
    def text(distance):
        m = ir.Module()
        fn = ir.Function(m, ir.FunctionType(void, [P(ir.IntType(8)), i64]), "f")
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        prefetch_ahead(b, fn.args[0], fn.args[1], 200, distance)
        b.ret_void()
        return str(m)

    assert "llvm.prefetch" not in text(0)
    t = text(4096)
    assert t.count('call void @"llvm.prefetch.p0"') == 4  # 200 bytes: four lines
    assert re.findall(r'add i64 %"\.2", (\d+)', t) == ["4096", "4160", "4224", "4288"]  # from `at`, a line apart


# --- the scans, on one kv head of a small geometry ---------------------------------------------------
H, KV, HD, S, POS = 4, 2, 32, 48, 37  # K blocks of 16: the tile unit fits (2 heads per kv head, head_dim 32)
G = 1  # the kv head the scans run for
CASES = [("f32", "", "host"), ("f32", "", "generic"), ("f16", "", "host"), ("bf16", "", "host")]
CASES += [("bf16", "dpbf16", "host")] if UNIT in ("dpbf16", "amx") else []
CASES += [("bf16", "amx", "host")] if UNIT == "amx" else []
IDS = [f"{kv}-{unit or 'fma'}-{t}" for kv, unit, t in CASES]


def _shape(kv, unit, target="host", window=0, softcap=0.0, bias=False, qk_norm=""):
    n = Attention(name="a", inputs=("x",), prefix="p", dim=H * HD, n_heads=H, n_kv_heads=KV, head_dim=HD,
                  rope_theta=1e4, bias=bias, qk_norm=qk_norm, softcap=softcap, window=window)
    isa = generic_target().isa if target == "generic" else HOST.isa
    return CoreShape(n, (0, H * HD, (H + KV) * HD), isa, kv, S, unit, 4096)


def _core(s: CoreShape, target: str, body, n_extra: int):
    """f(the core's 13 arguments up to pos, *n_extra f32 pointers): a CoreFrame over them, then body(frame,
    *extra); the tile state released at the end."""
    kvp = P(i16) if s.esz == 2 else P(f32)

    def build(b, *args):
        fr = CoreFrame(b, s, *args[:13])
        body(fr, *args[13:])
        if s.amx:
            _tile(b, "tilerelease")

    return _jit([P(f32)] * 6 + [kvp, kvp] + [P(f32)] * 4 + [i64] + [P(f32)] * n_extra, build,
                generic_target() if target == "generic" else HOST)


class _Buffers:
    """The core's arguments as arrays: the projection, biases, norm weights, the cache (random K and V at every
    position, in kv_layout), RoPE tables (identity unless rope), the output and the scores scratch (NaN)."""

    def __init__(self, s: CoreShape, seed=0, rope=False):
        rng = np.random.default_rng(seed)
        self.s = s
        self.qkv = rng.standard_normal((H + 2 * KV) * HD).astype(np.float32)
        self.bq, self.bk, self.bv = (rng.standard_normal(n * HD).astype(np.float32) for n in (H, KV, KV))
        self.qn = (1 + 0.1 * rng.standard_normal(H * HD if s.qk_norm == "proj" else HD)).astype(np.float32)
        self.kn = (1 + 0.1 * rng.standard_normal(KV * HD if s.qk_norm == "proj" else HD)).astype(np.float32)
        self.K = rng.standard_normal((KV, S, HD)).astype(np.float32)  # [g][s][d], as stored (rounded below)
        self.V = rng.standard_normal((KV, S, HD)).astype(np.float32)
        ang = (rng.random((S, HD // 2)) * 6 if rope else np.zeros((S, HD // 2))).astype(np.float32)
        self.cos, self.sin = np.cos(ang), np.sin(ang)
        self.att = np.zeros(H * HD, np.float32)
        self.scores = np.full(s.rep * s.SS, np.nan, np.float32)
        entries = S * KV * HD  # S is even: no pair padding
        self.kc, self.vc = self.cache_array(entries), self.cache_array(entries)
        k_at, v_at = kv_layout(S, KV, HD, s.kv)
        g, t, d = np.meshgrid(np.arange(KV), np.arange(S), np.arange(HD), indexing="ij")
        self.kc[k_at(t, g, d)] = self.stored(self.K)
        self.vc[v_at(t, g, d)] = self.stored(self.V)
        self.K, self.V = self.widened(self.kc[k_at(t, g, d)]), self.widened(self.vc[v_at(t, g, d)])

    def cache_array(self, n):
        return np.zeros(n, {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[self.s.kv])

    def stored(self, x):
        return bf16_bits(x) if self.s.kv == "bf16" else x.astype(self.cache_array(0).dtype)

    def widened(self, x):
        return bf16_to_f32(x) if self.s.kv == "bf16" else x.astype(np.float32)

    def args(self, pos):
        arrays = (self.qkv, self.bq, self.bk, self.bv, self.qn, self.kn, self.kc, self.vc, self.cos, self.sin,
                  self.att, self.scores)
        return [_ptr(a) for a in arrays] + [pos]

    def queries(self):
        """Kv head G's query heads (no bias, norm or rotation), the way the scans see them (bf16: rounded)."""
        q = self.qkv[:H * HD].reshape(H, HD)[G * self.s.rep:(G + 1) * self.s.rep].astype(np.float64)
        return bf16_to_f32(bf16_bits(q.astype(np.float32))).astype(np.float64) if self.s.kv == "bf16" else q


def _start(s):
    return max(0, POS + 1 - s.window) if s.window else 0


def _copy(b, src, dst, n):
    with Loop(b, c64(0), c64(n), "cp") as i:
        b.store(b.load(b.gep(src, [i])), b.gep(dst, [i]))


@pytest.mark.parametrize("kv, unit, target", CASES, ids=IDS)
def test_write_position_puts_k_roped_and_v_where_the_layout_says(kv, unit, target):
    s = _shape(kv, unit, target, bias=True, qk_norm="head")
    buf = _Buffers(s, rope=True)
    before_k, before_v = buf.kc.copy(), buf.vc.copy()
    f = _core(s, target, lambda fr: write_position(fr, c64(G * HD), c64(G * s.nb * HD * s.B), c64(G * s.S2 * HD)), 0)
    f(*buf.args(POS))
    k = buf.qkv[s.ko + G * HD: s.ko + (G + 1) * HD] + buf.bk[G * HD:(G + 1) * HD]
    k = k / np.sqrt(np.mean(k.astype(np.float64) ** 2) + 1e-6) * buf.kn
    c, sn, h = buf.cos[POS], buf.sin[POS], HD // 2
    k = np.concatenate([k[:h] * c - k[h:] * sn, k[h:] * c + k[:h] * sn]).astype(np.float32)
    v = buf.qkv[s.vo + G * HD: s.vo + (G + 1) * HD] + buf.bv[G * HD:(G + 1) * HD]
    k_at, v_at = kv_layout(S, KV, HD, kv)
    d = np.arange(HD)
    tol = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}[kv]
    np.testing.assert_allclose(buf.widened(buf.kc[k_at(POS, G, d)]), k, rtol=tol, atol=tol)
    np.testing.assert_array_equal(buf.vc[v_at(POS, G, d)], buf.stored(v))  # V: an add and one rounding, exact
    changed_k = np.flatnonzero(buf.kc != before_k)
    assert set(changed_k) <= set(k_at(POS, G, d))
    changed_v = set(np.flatnonzero(buf.vc != before_v))
    partner = set(v_at(POS + 1, G, d)) if kv == "bf16" and POS % 2 == 0 else set()
    assert changed_v <= set(v_at(POS, G, d)) | partner
    if partner:  # an even position zeroes its pair's partner: the pair scan reads it with weight 0
        assert not buf.vc[sorted(partner)].any()


@pytest.mark.parametrize("kv, unit, target", CASES, ids=IDS)
def test_load_queries_ropes_the_group_and_rounds_for_bf16(kv, unit, target):
    s = _shape(kv, unit, target, bias=True, qk_norm="proj")
    buf = _Buffers(s, rope=True)
    qr, qbf = np.zeros(s.rep * HD, np.float32), np.zeros(s.rep * HD, np.float32)  # qbf: rep * hd bf16 bits

    def body(fr, qr_out, qbf_out):
        load_queries(fr, c64(G))
        _copy(fr.b, fr.qr, qr_out, s.rep * HD)
        if s.bf:
            _copy(fr.b, fr.b.bitcast(fr.qbf, P(i32)), fr.b.bitcast(qbf_out, P(i32)), s.rep * HD // 2)

    _core(s, target, body, 2)(*buf.args(POS), _ptr(qr), _ptr(qbf))
    q = buf.qkv[:H * HD] + buf.bq
    q = q / np.sqrt(np.mean(q.astype(np.float64) ** 2) + 1e-6) * buf.qn  # 'proj': over the whole projection
    q = q.reshape(H, HD)[G * s.rep:(G + 1) * s.rep]
    c, sn, h = buf.cos[POS], buf.sin[POS], HD // 2
    q = np.concatenate([q[:, :h] * c - q[:, h:] * sn, q[:, h:] * c + q[:, :h] * sn], axis=1).ravel()
    np.testing.assert_allclose(qr, q, rtol=1e-5, atol=1e-5)
    if s.bf:
        np.testing.assert_array_equal(qbf.view(np.uint16)[:s.rep * HD], bf16_bits(qr))


@pytest.mark.parametrize("window, cap", [(0, 0.0), (19, 0.0), (0, 5.0)])
@pytest.mark.parametrize("kv, unit, target", CASES, ids=IDS)
def test_score_scan_scores_the_live_positions(kv, unit, target, window, cap):
    s = _shape(kv, unit, target, window=window, softcap=cap)
    buf = _Buffers(s, seed=3)
    mx = np.zeros(s.rep * s.B, np.float32)

    def body(fr, mx_out):
        load_queries(fr, c64(G))  # no bias or norm, identity rotation: the raw queries
        score_scan(fr, c64(G * s.nb * HD * s.B))
        for r in range(s.rep):
            fr.b.store(fr.b.load(fr.mx[r]), fr.b.bitcast(fr.b.gep(mx_out, [c64(r * s.B)]), P(V(f32, s.B))), align=4)

    _core(s, target, body, 1)(*buf.args(POS), _ptr(mx))
    start, B = _start(s), s.B
    ref = buf.queries() @ buf.K[G].astype(np.float64).T / math.sqrt(HD)  # [rep][S]
    if cap:
        ref = cap * np.tanh(ref / cap)
    scores = buf.scores.reshape(s.rep, s.SS)
    blocks = range(start // B, POS // B + 1)
    for r in range(s.rep):
        for j in blocks:
            for t in range(B):
                at = j * B + t
                if start <= at <= POS:
                    assert scores[r, at] == pytest.approx(ref[r, at], rel=1e-5, abs=1e-5), (r, at)
                else:
                    assert scores[r, at] == -np.inf, (r, at)
        lanes = np.full(B, -np.inf)
        for at in range(start, POS + 1):
            lanes[at % B] = max(lanes[at % B], ref[r, at])
        np.testing.assert_allclose(mx[r * B:(r + 1) * B], lanes, rtol=1e-5, atol=1e-5)
    assert np.isnan(scores[:, (POS // B + 1) * B:]).all()  # blocks past pos untouched


@pytest.mark.parametrize("window", [0, 19])
@pytest.mark.parametrize("kv, unit, target", CASES, ids=IDS)
def test_softmax_scan_exponentiates_sums_and_masks(kv, unit, target, window):
    s = _shape(kv, unit, target, window=window)
    buf = _Buffers(s)
    start, npos, L = _start(s), POS + 1, ATT_LANES
    rng = np.random.default_rng(4)
    raw = (rng.standard_normal((s.rep, s.SS)) * 3).astype(np.float32)
    raw[:, npos:] = 1e30  # past pos: must be masked, not exponentiated
    raw[:, 2 * s.B - 1] = 10.0  # the maximum in the last lane
    buf.scores[:] = raw.ravel()
    mxv = np.full((s.rep, s.B), -np.inf, np.float32)  # lane-wise maxima, as score_scan leaves them
    for at in range(start, npos):
        mxv[:, at % s.B] = np.maximum(mxv[:, at % s.B], raw[:, at])
    inv = np.zeros(s.rep, np.float32)

    def body(fr, mx_in, inv_out):
        b = fr.b
        for r in range(s.rep):
            b.store(b.load(b.bitcast(b.gep(mx_in, [c64(r * s.B)]), P(V(f32, s.B))), align=4), fr.mx[r])
        for r, x in enumerate(softmax_scan(fr)):
            b.store(x, b.gep(inv_out, [c64(r)]))

    _core(s, target, body, 2)(*buf.args(POS), _ptr(mxv), _ptr(inv))
    p = np.exp(raw[:, start:npos].astype(np.float64) - raw[:, start:npos].max(axis=1, keepdims=True))
    np.testing.assert_allclose(inv, 1 / p.sum(axis=1), rtol=1e-5)
    end = start + -(-(npos - start) // L) * L  # the last chunk's end: its lanes past pos hold 0
    if not s.bf:
        got = buf.scores.reshape(s.rep, s.SS)
        np.testing.assert_allclose(got[:, start:npos], p, rtol=1e-5)
        assert not got[:, npos:end].any()
        return
    w = buf.scores.view(np.uint16).reshape(s.rep, 2 * s.SS)  # head r's bf16 weights at i16 index 2 r SS + s
    np.testing.assert_allclose(bf16_to_f32(w[:, start:npos]), p, rtol=8e-3)
    assert not w[:, npos].any()  # the pair scan's neighbours of the end (and of an odd start) weigh 0
    if start % 2:
        assert not w[:, start - 1].any()
    if s.amx:  # the tile reads 32 weights at a time
        assert not w[:, npos:npos + 32].any()


@pytest.mark.parametrize("window", [0, 19])
@pytest.mark.parametrize("kv, unit, target", CASES, ids=IDS)
def test_weighted_sum_of_v(kv, unit, target, window):
    s = _shape(kv, unit, target, window=window)
    buf = _Buffers(s, seed=5)
    start, npos = _start(s), POS + 1
    p = np.random.default_rng(6).random((s.rep, npos - start)).astype(np.float32)
    if s.bf:  # as softmax_scan leaves them: bf16 weights, the pair neighbours of both ends 0
        p = bf16_to_f32(bf16_bits(p))
        w = np.zeros((s.rep, 2 * s.SS), np.uint16)
        w[:, start:npos] = bf16_bits(p)
        buf.scores[:] = w.view(np.float32).ravel()
    else:
        buf.scores.reshape(s.rep, s.SS)[:, start:npos] = p
    inv = np.array([0.5 + r for r in range(s.rep)], np.float32)

    def body(fr, inv_in):
        scale = [fr.b.load(fr.b.gep(inv_in, [c64(r)])) for r in range(s.rep)]
        (amx_weighted_sum if s.amx else weighted_sum)(fr, c64(G), c64(G * s.S2 * HD), scale)

    _core(s, target, body, 1)(*buf.args(POS), _ptr(inv))
    ref = p.astype(np.float64) @ buf.V[G, start:npos].astype(np.float64) * inv[:, None]
    got = buf.att.reshape(H, HD)
    np.testing.assert_allclose(got[G * s.rep:(G + 1) * s.rep], ref, rtol=2e-5, atol=2e-5)
    assert not np.delete(got, range(G * s.rep, (G + 1) * s.rep), axis=0).any()  # other kv heads' rows untouched


def test_amx_weighted_sum_runs_on_the_tile_unit():
    """The emitted tile scan on any host: per 16 dimensions one TDPBF16PS for the full chunks and one for the
    tail, one store of the output tile."""
    s = _shape("bf16", "amx")
    assert s.amx
    m = ir.Module()
    fn = ir.Function(m, ir.FunctionType(void, [P(f32)] * 6 + [P(i16)] * 2 + [P(f32)] * 4 + [i64]), "f")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    fr = CoreFrame(b, s, *fn.args)
    amx_weighted_sum(fr, c64(G), c64(G * s.S2 * HD), [ir.Constant(f32, 1.0)] * s.rep)
    b.ret_void()
    text = str(fn)
    assert text.count('@"llvm.x86.tdpbf16ps"') == 2 * HD // 16
    assert text.count('@"llvm.x86.tilestored64"') == HD // 16


def test_shape_names_the_function_as_before():
    s = _shape("f16", "", window=19, softcap=30.0, bias=True, qk_norm="head")
    fma = "mul" if HOST.isa == "generic" else "fma"
    assert "_".join(map(str, s.key())) == f"attn_4_2_32_0_128_192_1_{fma}_f16_S48_pf4096_head_1em06_cap30p0_win19"
    assert (s.B, s.nb, s.rep, s.SS, s.W, s.nc) == (16, 3, 2, 48 + 2 * ATT_LANES, 16, 2)
    with pytest.raises(ValueError, match="KV cache type"):
        _shape("f64", "")
