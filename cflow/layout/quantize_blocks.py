"""Importance-weighted quantisers for every block type cflow executes: float rows -> the GGUF block bytes.

Stage: layout. `quantize_weighted(x, dtype, imatrix)` returns a BlockTensor (a QTensor for Q4_0 / Q8_0) whose
bytes dequantise (layout/blocks.py, gguf.quants) to the weighted least-squares fit of x. The searches are the
field's (llama.cpp's quantize_row_*_impl with quant_weights), vectorised over blocks:

    symmetric codes     x ~ d * l,          l in [-nmax, nmax-1]: 19 trial inverse scales, each refit by weighted LS
                        (make_qx_quants: Q4_0, Q5_0, the 16-input sub-blocks of Q3_K and Q6_K)
    affine codes        x ~ d * l + m,      l in [0, nmax]:       37 trial scales, (d, m) by 2x2 weighted LS
                        (make_qkx3_quants: Q4_1, Q5_1, the sub-blocks of Q2_K, Q4_K, Q5_K)
    code book           x ~ d * v[l],       v the IQ4 values:     15 trial scales (IQ4_NL, IQ4_XS, IQ4_128/192)
    super-block scales  the sub-block scales themselves quantised by a weighted search (make_qp_quants for the
                        K-quants' 4/6-bit scales and mins, symmetric for Q3_K / Q6_K / IQ4_XS), the codes then
                        refit to the quantised scales. cflow's own types (layout/blocks.py): the smallest
                        E5M3 super-block scale that holds every sub-block scale, then each sub-block at the best
                        of its rounded 6-bit scale and the two next to it, its codes refit at each.

The per-element weight is the importance matrix's column value (mean x_j^2 of the matrix's inputs) times
sqrt(sigma2 + x^2), sigma2 the row's (super-block's) mean square, as llama.cpp weighs it; imatrix None: all ones
(the same searches, unweighted by the inputs). make_qp_quants' final per-scale coordinate refinement is left out:
a small difference in the search, not in the format. Q8_0 is the plain rounding (more search gains nothing there).
"""

from __future__ import annotations

import numpy as np

from .blocks import E5M3_MAX, FORMATS, IQ4_VALUES, OWN_TYPES, BlockTensor, e5m3_ceil, e5m3_value
from .quant import DType, QTensor, dequantize, quantize

EPS = 1e-15  # llama.cpp's GROUP_MAX_EPS: a block this small is all zeros
WEIGHTED_TYPES = (DType.Q4, DType.Q5_0, DType.Q4_1, DType.Q5_1, DType.IQ4_NL, DType.Q8, DType.Q2_K, DType.Q3_K,
                  DType.Q4_K, DType.Q5_K, DType.Q6_K, DType.IQ4_XS, *OWN_TYPES)
_ROWS = 1 << 16  # blocks quantised at once (bounds the temporaries)
# Native twins of fit_symmetric / fit_affine / fit_codebook for blocks of 16 and 32 (the same bits, 15-30x faster):
# codegen/quantfit.py sets this to itself when imported (the compiler and cflowc's calibration import it); None:
# the NumPy fitters below run, the oracle the tests compare it with (tests/codegen/test_quantfit.py).
NATIVE_FITTERS = None


def _safe_div(a, b):
    """a / b as float32, 0 where b is 0 (the division in the inputs' own precision, then rounded to float32; one
    ufunc call: the fitters make hundreds of thousands of these)."""
    a, b = np.asarray(a), np.asarray(b)
    out = np.zeros(np.broadcast_shapes(a.shape, b.shape), np.float32)
    np.divide(a, b, out=out, where=b != 0, casting="unsafe", dtype=np.result_type(a, b, np.float32))
    return out


def _peak(x):
    """Each row's value of largest magnitude (1 where the row is all below EPS) and whether it is above EPS."""
    mx = x[np.arange(x.shape[0]), np.abs(x).argmax(axis=1)]
    live = np.abs(mx) >= EPS
    return np.where(live, mx, 1).astype(np.float32), live


def _rint(x):
    return np.rint(x).astype(np.float32)


def fit_symmetric(x: np.ndarray, w: np.ndarray, nmax: int, ntry: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """x, w [N, n] -> (d [N], l [N, n] in [-nmax, nmax-1]) minimising sum w (x - d l)^2 over 2*ntry+1 trial scales."""
    mx, live = _peak(x)
    best = np.full(x.shape[0], -np.inf, np.float32)
    d = np.zeros(x.shape[0], np.float32)
    inv = np.zeros(x.shape[0], np.float32)
    wx = w * x
    for k in [0] + [i for i in range(-ntry, ntry + 1) if i]:
        iscale = (-(nmax + 0.1 * k) / mx).astype(np.float32)
        l = np.clip(_rint(iscale[:, None] * x), -nmax, nmax - 1)
        sumlx, suml2 = (wx * l).sum(1), (w * l * l).sum(1)
        scale = _safe_div(sumlx, suml2)
        score = scale * sumlx
        take = (suml2 > 0) & (score > best) if k else np.ones_like(live)
        best, d, inv = np.where(take, score, best), np.where(take, scale, d), np.where(take, iscale, inv)
    L = np.clip(_rint(inv[:, None] * x), -nmax, nmax - 1)  # the codes of the winning trial
    return np.where(live, d, 0).astype(np.float32), np.where(live[:, None], L, 0)


def fit_affine(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float = -0.9, rdelta: float = 0.05, nstep: int = 36
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, w [N, n] -> (d [N] >= 0, m [N] <= 0, l [N, n] in [0, nmax]) minimising sum w (x - d l - m)^2."""
    lo = np.minimum(x.min(1), 0)
    hi = x.max(1)
    live = hi > lo
    span = np.where(live, hi - lo, 1).astype(np.float32)
    sw, sx, sx2 = w.sum(1), (w * x).sum(1), (w * x * x).sum(1)
    wx = w * x
    xm = x - lo[:, None]

    def err_of(d, m, sl, sl2, sxl):  # sum w (d l + m - x)^2, expanded in the sums
        return sx2 + d * d * sl2 + m * m * sw - 2 * d * sxl - 2 * m * sx + 2 * d * m * sl

    def sums(l):
        wl = w * l
        return wl.sum(1), (wl * l).sum(1), (wx * l).sum(1)

    iscale = (nmax / span).astype(np.float32)
    d, m = 1 / iscale, lo
    best = err_of(d, m, *sums(np.clip(_rint(iscale[:, None] * xm), 0, nmax)))
    best_inv = iscale
    for k in range(nstep + 1):
        inv = ((rmin + rdelta * k + nmax) / span).astype(np.float32)
        sl, sl2, sxl = sums(np.clip(_rint(inv[:, None] * xm), 0, nmax))
        D = sw * sl2 - sl * sl
        dd, mm = _safe_div(sw * sxl - sx * sl, D), _safe_div(sl2 * sx - sl * sxl, D)
        pos = mm > 0  # a positive minimum: the codes start at 0, refit the scale alone
        dd, mm = np.where(pos, _safe_div(sxl, sl2), dd), np.where(pos, 0, mm)
        err = err_of(dd, mm, sl, sl2, sxl)
        take = (D > 0) & (err < best)
        best, best_inv = np.where(take, err, best), np.where(take, inv, best_inv)
        d, m = np.where(take, dd, d), np.where(take, mm, m)
    L = np.clip(_rint(best_inv[:, None] * xm), 0, nmax)  # the codes of the winning trial
    return (np.where(live, d, 0).astype(np.float32), np.where(live, m, lo).astype(np.float32),
            np.where(live[:, None], L, 0))


def fit_positive(x: np.ndarray, w: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Scales or mins x >= 0 [N, n] -> (d [N], l [N, n] in [0, nmax]): the super-block scale of make_qp_quants."""
    mx = x.max(1)
    live = mx > 0
    mx = np.where(live, mx, 1).astype(np.float32)
    best, inv = np.full(x.shape[0], np.inf, np.float32), nmax / mx
    for k in range(-4, 5):
        iscale = (0.1 * k + nmax) / mx
        l = np.minimum(nmax, _rint(iscale[:, None] * x))
        err = (w * (x - l / iscale[:, None]) ** 2).sum(1)
        take = err < best
        best, inv = np.where(take, err, best), np.where(take, iscale, inv)
    l = np.minimum(nmax, _rint(inv[:, None] * x))
    d = _safe_div((w * x * l).sum(1), (w * l * l).sum(1))
    return np.where(live, d, 0).astype(np.float32), np.where(live[:, None], l, 0)


_IQ4 = IQ4_VALUES.astype(np.float32)
_IQ4_MID = (_IQ4[1:] + _IQ4[:-1]) / 2
# The code book's values are integers, so its midpoints are multiples of 1/2: a midpoint m lies below x exactly when
# 2m <= ceil(2x) - 1, and the count of those (the nearest value's index, ties to the lower one, as searchsorted
# gives it) is a table lookup on ceil(2x): a few passes instead of a binary search per value (4-9x faster).
_IQ4_M2 = (2 * _IQ4_MID).astype(np.int64)
_IQ4_LO, _IQ4_HI = int(_IQ4_M2[0]), int(_IQ4_M2[-1]) + 1  # ceil(2x) beyond these gives index 0 / 15
_IQ4_TABLE = np.array([np.count_nonzero(_IQ4_M2 <= k - 1) for k in range(_IQ4_LO, _IQ4_HI + 1)], np.uint8)


def iq4_index(x: np.ndarray) -> np.ndarray:
    """Index of the nearest IQ4 code-book value (ties to the lower; np.searchsorted(_IQ4_MID, x) bit for bit)."""
    x = np.asarray(x)
    k = np.ceil(x + x)  # 2x exactly, in x's own precision
    k = np.fmin(np.fmax(k, _IQ4_LO), _IQ4_HI, out=k)  # (fmax/fmin: NaN becomes a bound)
    return _IQ4_TABLE[k.astype(np.int64) - _IQ4_LO]


def fit_codebook(x: np.ndarray, w: np.ndarray, ntry: int = 7) -> np.ndarray:
    """x, w [N, 32] -> d [N] minimising sum w (x - d v[l])^2 over 2*ntry+2 trial scales (IQ4 code book)."""
    mx, live = _peak(x)
    best = np.full(x.shape[0], -np.inf, np.float32)
    d = np.zeros(x.shape[0], np.float32)
    wx = w * x
    trials = [-_IQ4[0] / mx] + [(t + _IQ4[0]) / mx for t in range(-ntry, ntry + 1)]  # both signs of the range
    for k, inv in enumerate(trials):
        q = _IQ4[iq4_index(inv[:, None] * x)]
        sqx, sq2 = (wx * q).sum(1), (w * q * q).sum(1)
        scale = _safe_div(sqx, sq2)
        take = (sq2 > 0) & ((scale * sqx > best) | (k == 0))
        best, d = np.where(take, scale * sqx, best), np.where(take, scale, d)
    return np.where(live, d, 0).astype(np.float32)


def _native(x, w) -> bool:
    """Whether the native fitters take these blocks (float32, 16 or 32 wide, no NaN: NumPy's argmax, min and max
    pick a NaN where the kernels' ordered compares pass it by; anything else: NumPy)."""
    return (NATIVE_FITTERS is not None and x.dtype == w.dtype == np.float32 and x.shape == w.shape
            and x.shape[1] in NATIVE_FITTERS.SIZES and not np.isnan(x).any())


def _symmetric(x, w, nmax):
    return (NATIVE_FITTERS.symmetric if _native(x, w) else fit_symmetric)(x, w, nmax)


def _affine(x, w, nmax, *search):
    return (NATIVE_FITTERS.affine if _native(x, w) else fit_affine)(x, w, nmax, *search)


def _codebook(x, w):
    return (NATIVE_FITTERS.codebook if _native(x, w) else fit_codebook)(x, w)


def _f16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(np.float16)


def _bytes16(a) -> np.ndarray:
    """fp16 values [N] -> u8 [N, 2]."""
    return np.ascontiguousarray(_f16(a)).view(np.uint8).reshape(-1, 2)


def _element_weights(x: np.ndarray, imatrix: np.ndarray | None, per: int) -> np.ndarray:
    """imatrix column weight * sqrt(sigma2 + x^2), sigma2 the mean square over runs of `per` inputs (x: [B, per])."""
    sigma2 = (x * x).mean(1, keepdims=True) * (2 if per > 32 else 1)
    q = np.ones_like(x) if imatrix is None else imatrix
    return (q * np.sqrt(sigma2 + x * x)).astype(np.float32)


def _nibbles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return (lo.astype(np.uint8) & 0xF) | ((hi.astype(np.uint8) & 0xF) << 4)


def _bits(u: np.ndarray, bit: int) -> np.ndarray:
    """u [N, 32] -> the 32 bits (u >> bit) & 1 as little-endian u8[N, 4]."""
    b = ((u.astype(np.uint32) >> bit) & 1) << np.arange(32, dtype=np.uint32)
    return np.ascontiguousarray(b.sum(1, dtype=np.uint32).astype("<u4")).view(np.uint8).reshape(-1, 4)


def code_fields(dt: DType, u: np.ndarray) -> dict[str, np.ndarray]:
    """The fields of a block type that hold its codes, from the stored code of every input u [N, qk] (0..umax; for
    the IQ4 types the code-book index): the inverse of the code part of blocks.decompose. The fitters below and the
    error feedback (passes/gptq.py, which picks codes input by input under a block's fitted scales) share it."""
    u = np.asarray(u).astype(np.uint8)
    N = u.shape[0]
    if dt in (DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.IQ4_NL):
        out = {"qs": _nibbles(u[:, :16], u[:, 16:])}
        if dt in (DType.Q5_0, DType.Q5_1):
            out["qh"] = _bits(u, 4)
        return out
    if dt in (DType.Q4_K, DType.Q5_K):
        q = u.reshape(N, 4, 2, 32)  # sub-block 2c in the low nibble of qs[c*32 + l], 2c+1 in the high one
        out = {"qs": _nibbles(q[:, :, 0], q[:, :, 1]).reshape(N, 128)}
        if dt == DType.Q5_K:
            hb = (u.reshape(N, 8, 32) >> 4) & 1  # bit j of qh[l]: high bit of sub-block j's element l
            out["qh"] = (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)
        return out
    if dt == DType.Q2_K:
        q = u.reshape(N, 2, 4, 32)  # element n*128 + j*32 + l: bits 2j of qs[n*32 + l]
        return {"qs": (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(N, 64)}
    if dt in (DType.Q3_128, DType.Q3_192):  # blocks.py: input b + 8k at bits 2k of qs byte b, b + 4k at bit k of qh
        q = u.reshape(N, -1, 4, 8)
        qs = (q & 3) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
        h = (u.reshape(N, -1, 8, 4) >> 2) & 1
        qh = h << np.arange(8, dtype=np.uint8).reshape(8, 1)
        return {"qh": qh.sum(2, dtype=np.uint8).reshape(N, -1), "qs": qs.sum(2, dtype=np.uint8).reshape(N, -1)}
    if dt == DType.IQ4_XS or dt in OWN_TYPES:
        q = u.reshape(N, -1, 32)
        return {"qs": _nibbles(q[..., :16], q[..., 16:]).reshape(N, -1)}
    if dt == DType.Q6_K:
        q = u.reshape(N, 2, 2, 2, 32)  # [n, nib, half, l]: element n*128 + (2 nib + half)*32 + l
        ql = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(N, 128)  # ql[n*64 + half*32 + l], nibble nib
        hi = (u.reshape(N, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
        return {"ql": ql, "qh": hi.sum(2, dtype=np.uint8).reshape(N, 64)}
    if dt == DType.Q3_K:
        q = u.reshape(N, 2, 4, 32)  # low 2 bits at bit 2j of qs[n*32 + l], the third bit in hmask
        qs = ((q[:, :, 0] & 3) | ((q[:, :, 1] & 3) << 2) | ((q[:, :, 2] & 3) << 4) | ((q[:, :, 3] & 3) << 6))
        hb = (u.reshape(N, 8, 32) >> 2) & 1
        return {"hmask": (hb << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8),
                "qs": qs.reshape(N, 64)}
    raise ValueError(f"no code fields for {dt.gguf_name}")


def _assemble(dt: DType, fields: dict[str, np.ndarray]) -> np.ndarray:
    """A block type's fields [N, bytes] each -> its blocks [N, nbytes], in GGUF's field order."""
    return np.concatenate([fields[name] for name, _ in FORMATS[dt].fields], axis=1)


def with_codes(t: BlockTensor, u: np.ndarray) -> BlockTensor:
    """t with every input's stored code replaced by u [rows, cols] (its scales kept)."""
    fmt = FORMATS[t.dtype]
    nb = t.cols // fmt.qk
    raw = t.raw.reshape(t.rows * nb, fmt.nbytes).copy()
    sl = fmt.field_slices()
    for name, v in code_fields(t.dtype, np.asarray(u).reshape(t.rows * nb, fmt.qk)).items():
        raw[:, sl[name]] = v
    return BlockTensor(t.dtype, t.rows, t.cols, raw.reshape(t.rows, nb * fmt.nbytes))


def _legacy(dt: DType, x: np.ndarray, q: np.ndarray | None) -> np.ndarray:
    """32-input types, x [N, 32] -> block bytes [N, nbytes]."""
    w = _element_weights(x, None if q is None else q, 32)
    if dt in (DType.Q4, DType.Q5_0):
        nmax = 8 if dt == DType.Q4 else 16
        d, l = _symmetric(x, w, nmax)
        u = (l + nmax).astype(np.uint8)
        if dt == DType.Q4:  # Q4_0: IQ4_NL's layout, its codes as integers
            return np.concatenate([_bytes16(d), code_fields(DType.IQ4_NL, u)["qs"]], axis=1)
        return _assemble(dt, {"d": _bytes16(d), **code_fields(dt, u)})
    if dt in (DType.Q4_1, DType.Q5_1):
        d, m, l = _affine(x, w, 15 if dt == DType.Q4_1 else 31)
        return _assemble(dt, {"d": _bytes16(d), "m": _bytes16(m), **code_fields(dt, l)})
    assert dt == DType.IQ4_NL
    d = _codebook(x, w)
    u = iq4_index(_safe_div(x, d[:, None]))
    return _assemble(dt, {"d": _bytes16(d), **code_fields(dt, u)})


def _k4_pack(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [N, 8] -> Q4_K/Q5_K's 12 bytes (inverse of blocks._k4_scales)."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return out


def _q3_pack(s: np.ndarray) -> np.ndarray:
    """16 six-bit unsigned scales [N, 16] -> Q3_K's 12 bytes (inverse of blocks._q3_scales)."""
    s = s.astype(np.uint8)
    out = np.zeros((s.shape[0], 12), np.uint8)
    out[:, 0:4] = (s[:, 0:4] & 0xF) | ((s[:, 8:12] & 0xF) << 4)
    out[:, 4:8] = (s[:, 4:8] & 0xF) | ((s[:, 12:16] & 0xF) << 4)
    out[:, 8:12] = (s[:, 0:4] >> 4) | ((s[:, 4:8] >> 4) << 2) | ((s[:, 8:12] >> 4) << 4) | ((s[:, 12:16] >> 4) << 6)
    return out


def _k_affine(dt: DType, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q2_K / Q4_K / Q5_K: affine sub-blocks, quantised scales and mins. x, w [N, 256] -> bytes [N, nbytes]."""
    sub, nmax, sbits = {DType.Q2_K: (16, 3, 15), DType.Q4_K: (32, 15, 63), DType.Q5_K: (32, 31, 63)}[dt]
    N, ns = x.shape[0], 256 // sub
    xs, ws = x.reshape(N * ns, sub), w.reshape(N * ns, sub)
    sc, mn, _ = _affine(xs, ws, nmax, -0.5 if dt == DType.Q2_K else -0.9, 0.1 if dt == DType.Q2_K else 0.05,
                           15 if dt == DType.Q2_K else 36)
    sw = ws.sum(1).reshape(N, ns)
    d, ls = fit_positive(sc.reshape(N, ns), sw, sbits)
    dm, lm = fit_positive(-mn.reshape(N, ns), sw, sbits)
    d16, dm16 = _f16(d).astype(np.float32), _f16(dm).astype(np.float32)
    S = (d16[:, None] * ls).reshape(N * ns, 1)
    M = (dm16[:, None] * lm).reshape(N * ns, 1)
    u = np.clip(_rint(_safe_div(xs + M, np.broadcast_to(S, xs.shape))), 0, nmax).astype(np.uint8).reshape(N, 256)
    if dt == DType.Q2_K:
        scales = (ls.astype(np.uint8) & 0xF) | (lm.astype(np.uint8) << 4)
        return _assemble(dt, {"scales": scales, "d": _bytes16(d), "dmin": _bytes16(dm), **code_fields(dt, u)})
    return _assemble(dt, {"d": _bytes16(d), "dmin": _bytes16(dm), "scales": _k4_pack(ls, lm), **code_fields(dt, u)})


def _k_symmetric(dt: DType, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q3_K / Q6_K / IQ4_XS: symmetric sub-blocks (or the IQ4 code book) with signed 6/8-bit scales."""
    N = x.shape[0]
    sub = 32 if dt == DType.IQ4_XS else 16
    ns = 256 // sub
    xs, ws = x.reshape(N * ns, sub), w.reshape(N * ns, sub)
    if dt == DType.IQ4_XS:
        sc = _codebook(xs, ws).reshape(N, ns)
    else:
        sc = _symmetric(xs, ws, 32 if dt == DType.Q6_K else 4)[0].reshape(N, ns)
    big = sc[np.arange(N), np.abs(sc).argmax(1)]  # the sub-block scale of largest magnitude, signed
    if dt == DType.Q3_K:
        d, l = _symmetric(sc, ws.sum(1).reshape(N, ns), 32)
        stored = (l + 32).astype(np.uint8)
    else:
        lim = 128 if dt == DType.Q6_K else 32
        d = _safe_div(big, -lim * np.ones_like(big))
        l = np.clip(_rint(_safe_div(sc, d[:, None])), -lim, lim - 1)
        stored = (l + (0 if dt == DType.Q6_K else 32)).astype(np.int8 if dt == DType.Q6_K else np.uint8)
    S = (_f16(d).astype(np.float32)[:, None] * l).reshape(N * ns, 1)
    if dt == DType.IQ4_XS:
        u = iq4_index(_safe_div(xs, np.broadcast_to(S, xs.shape))).reshape(N, 256)
        lsb = stored.astype(np.uint16)
        sh = ((lsb >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(1, dtype=np.uint16)
        sl = _nibbles(stored[:, 0::2], stored[:, 1::2])
        return _assemble(dt, {"d": _bytes16(d), "scales_h": np.ascontiguousarray(sh.astype("<u2")).view(np.uint8)
                              .reshape(N, 2), "scales_l": sl, **code_fields(dt, u)})
    bias = 32 if dt == DType.Q6_K else 4
    u = (np.clip(_rint(_safe_div(xs, np.broadcast_to(S, xs.shape))), -bias, bias - 1) + bias).astype(np.uint8)
    u = u.reshape(N, 256)
    scales = stored.view(np.uint8) if dt == DType.Q6_K else _q3_pack(stored)
    return _assemble(dt, {"scales": scales, "d": _bytes16(d), **code_fields(dt, u)})


class OwnRangeError(ValueError):
    """Values one of cflow's own types cannot hold (beyond its 8-bit super-block scale's range, or not finite)."""


def own_limit(dt: DType) -> float:
    """The largest |x| one of cflow's own types holds: the E5M3 scale's top times 32 times the largest code."""
    return E5M3_MAX * 32 * (127 if FORMATS[dt].signed else 4)


def _own(dt: DType, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """cflow's own types (blocks.py): x, w [N, qk] -> the blocks [N, nbytes]. Each 32-input sub-block's scale from
    the type's search (the IQ4 code book, or symmetric 3-bit codes), then the smallest E5M3 super-block scale D at
    which every one rounds into -32..31, then each sub-block at the best of its rounded scale and the two next to
    it, its codes refit at each."""
    N, qk = x.shape
    if not np.isfinite(x).all():
        raise OwnRangeError(f"{dt.gguf_name} takes finite values only")
    big = float(np.abs(x).max()) if x.size else 0.0
    if big > own_limit(dt):
        raise OwnRangeError(f"{dt.gguf_name}: a value of {big:.4g} is beyond its 8-bit super-block scale's range "
                            f"(|x| up to {own_limit(dt):.0f})")
    ns = qk // 32
    book = FORMATS[dt].signed
    xs, ws = x.reshape(N * ns, 32), w.reshape(N * ns, 32)
    sc = (_codebook(xs, ws) if book else _symmetric(xs, ws, 4)[0]).reshape(N, ns)
    # D: the smallest E5M3 value at which every sub-block scale rounds into -32..31 (a positive one needs sc / 31)
    # (values within own_limit can still ask for a larger D, a fit whose peak code is not the extreme one: the top
    # value then, the sub-block's scale clipped and its codes refit below)
    need = np.minimum(np.where(sc < 0, -sc / np.float32(32), sc / np.float32(31)).max(1), np.float32(E5M3_MAX))
    db = e5m3_ceil(need)
    D = e5m3_value(db)[:, None]
    l0 = np.clip(_rint(_safe_div(sc, D)), -32, 31)
    best = l = u = None
    for step in (0, -1, 1):
        lt = np.clip(l0 + step, -32, 31)
        S = np.broadcast_to((D * lt).reshape(N * ns, 1), xs.shape)
        if book:
            ut = iq4_index(_safe_div(xs, S))
            e = (ws * (xs - S * _IQ4[ut]) ** 2).sum(1)
        else:
            ut = (np.clip(_rint(_safe_div(xs, S)), -4, 3) + 4).astype(np.uint8)
            e = (ws * (xs - S * (ut.astype(np.float32) - 4)) ** 2).sum(1)
        e = e.reshape(N, ns)
        if best is None:
            best, l, u = e, lt, ut.reshape(N, ns, 32)
        else:
            take = e < best
            best, l = np.where(take, e, best), np.where(take, lt, l)
            u = np.where(take[..., None], ut.reshape(N, ns, 32), u)
    stored = (l + 32).astype(np.uint32)
    word = (stored & 0xF) << (4 * np.arange(ns, dtype=np.uint32))
    hi = ((stored >> 4) << (2 * np.arange(ns, dtype=np.uint32))).sum(1, dtype=np.uint32)
    word = word.sum(1, dtype=np.uint32) | (db.astype(np.uint32) << 24)
    fields = code_fields(dt, u.reshape(N, qk))
    if "scales_h" in dict(FORMATS[dt].fields):
        fields["scales_h"] = np.ascontiguousarray(hi.astype("<u2")).view(np.uint8).reshape(N, 2)
    else:  # four sub-blocks: their high 2 bits above the low nibbles
        word |= hi << 16
    fields["scales"] = np.ascontiguousarray(word.astype("<u4")).view(np.uint8).reshape(N, 4)
    return _assemble(dt, fields)


def quantize_weighted(x: np.ndarray, dtype: DType, imatrix: np.ndarray | None = None) -> BlockTensor | QTensor:
    """A float matrix [rows, cols] at `dtype` (WEIGHTED_TYPES), each block fit to minimise the squared error weighted
    by the importance matrix (mean x_j^2 per input column, [cols]; None: unweighted)."""
    x = np.ascontiguousarray(x, np.float32)
    rows, cols = x.shape
    if imatrix is not None:
        imatrix = np.asarray(imatrix, np.float32)
        if imatrix.shape != (cols,):
            raise ValueError(f"importance matrix of {imatrix.shape[0]} values for a matrix of {cols} inputs")
    if dtype == DType.Q8:
        return quantize(x, dtype)
    if dtype == DType.Q4:
        qk, nbytes = 32, 18
    else:
        if dtype not in FORMATS:
            raise ValueError(f"no importance-weighted quantiser for {dtype.gguf_name}")
        qk, nbytes = FORMATS[dtype].qk, FORMATS[dtype].nbytes
    if cols % qk:
        raise ValueError(f"{dtype.gguf_name}: {cols} inputs per row is not a whole number of {qk}-input blocks")
    nb = cols // qk
    blocks = x.reshape(rows * nb, qk)
    q = None if imatrix is None else np.broadcast_to(imatrix.reshape(nb, qk), (rows, nb, qk)).reshape(rows * nb, qk)
    out = np.empty((rows * nb, nbytes), np.uint8)
    step = max(1, _ROWS // qk)
    for s in range(0, rows * nb, step):
        xb, qb = blocks[s : s + step], None if q is None else q[s : s + step]
        if qk == 32:
            out[s : s + step] = _legacy(DType.Q4 if dtype == DType.Q4 else dtype, xb, qb)
        else:
            w = _element_weights(xb, qb, 256)
            if dtype == DType.Q6_K:  # llama.cpp weighs Q6_K by the importance alone
                w = xb * xb if qb is None else np.ascontiguousarray(qb)
            fn = (_k_affine if dtype in (DType.Q2_K, DType.Q4_K, DType.Q5_K) else _own if dtype in OWN_TYPES
                  else _k_symmetric)
            out[s : s + step] = fn(dtype, xb, w)
    raw = out.reshape(rows, nb * nbytes)
    if dtype == DType.Q4:
        scales = raw.reshape(rows, nb, 18)[..., :2].copy().view(np.float16)[..., 0]
        qs = raw.reshape(rows, nb, 18)[..., 2:]
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
        return QTensor(dtype=DType.Q4, rows=rows, cols=cols, scales=np.ascontiguousarray(scales),
                       q=np.ascontiguousarray(codes))
    return BlockTensor(dtype, rows, cols, np.ascontiguousarray(raw))


def weighted_error(x: np.ndarray, t, imatrix: np.ndarray | None) -> float:
    """sum_rows sum_j imatrix_j (x - dequant(t))^2: the expected squared output error for inputs of that second
    moment (imatrix None: plain squared error)."""
    d = (np.asarray(x, np.float32) - dequantize(t)) ** 2
    return float(d.sum(0) @ (np.ones(d.shape[1], np.float32) if imatrix is None else imatrix))
