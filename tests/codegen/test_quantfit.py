"""The native fitters (codegen/quantfit.py) against layout/quantize_blocks.py's NumPy fitters, bit for bit: every
search the quantisers run, on blocks shaped like real weights and on the edge cases (zeros, -0.0, blocks below
EPS, constant and one-signed blocks, ties, a count not a multiple of the lanes), through quantize_weighted at
every type, and on every ISA path this host can force."""

import numpy as np
import pytest

from cflow.codegen import quantfit as QF
from cflow.layout import quantize_blocks as QB
from cflow.layout.quant import BLOCK_SIZES, DType


def _blocks(n: int, N: int = 3001, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of n with a heavy-tailed spread of scales, and importance-like weights; the edge cases first."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, n)) * np.exp(2 * rng.standard_normal((N, 1)))).astype(np.float32)
    x[rng.random((N, n)) < 0.02] *= 40  # outliers
    x[0] = 0
    x[1] = -0.0
    x[2, :5] = -0.0
    x[3] = 3e-16  # below EPS
    x[4] = 0.25  # constant
    x[5] = np.abs(x[5])  # one-signed: the affine fit's positive minimum
    x[6] = -np.abs(x[6])
    x[7] = np.round(x[7] * 4) / 4  # on a grid: ties in the rounding
    x[8, 0] = 1e30
    x[9] = 1e-41  # subnormal
    x[10] = np.arange(n) - n / 2
    w = np.exp(rng.standard_normal((N, n))).astype(np.float32)
    w[11] = 0  # no weight at all
    w[12, ::2] = 0
    return x, w


def _same(a, b) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _same_bytes(a, b) -> bool:
    """Two quantised matrices hold the same bytes (a QTensor's codes and fp16 scales, a BlockTensor's blocks)."""
    if hasattr(a, "raw"):
        return np.array_equal(a.raw, b.raw)
    return np.array_equal(a.q, b.q) and np.array_equal(a.scales.view(np.uint16), b.scales.view(np.uint16))


SEARCHES = [  # (width, NumPy fitter, native, arguments): every call quantize_blocks makes
    *[(n, QB.fit_symmetric, QF.symmetric, (nmax,)) for n, nmax in ((32, 8), (32, 16), (16, 4), (16, 32))],
    (16, QB.fit_symmetric, QF.symmetric, (32, 3)),
    *[(32, QB.fit_affine, QF.affine, (nmax,)) for nmax in (15, 31)],
    (16, QB.fit_affine, QF.affine, (3, -0.5, 0.1, 15)),
    (16, QB.fit_affine, QF.affine, (15, -0.9, 0.05, 36)),
    (32, QB.fit_codebook, QF.codebook, ()),
    (32, QB.fit_codebook, QF.codebook, (3,)),
]


@pytest.mark.parametrize("n, ref, native, args", SEARCHES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("N", [3001, 16, 1])
def test_each_search_is_numpys_bit_for_bit(n, ref, native, args, N):
    x, w = _blocks(n, N=max(N, 13))
    x, w = x[:N], w[:N]
    with np.errstate(all="ignore"):  # the 1e30 block overflows a product in both (to the same inf)
        want, got = ref(x, w, *args), native(x, w, *args)
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert _same(b, a)


def test_no_blocks():
    x = np.zeros((0, 32), np.float32)
    d, l = QF.symmetric(x, x, 8)
    assert d.shape == (0,) and l.shape == (0, 32)
    assert QF.codebook(x, x).shape == (0,)


def test_a_width_it_has_no_kernel_for_is_refused():
    with pytest.raises(ValueError, match="blocks of"):
        QF.symmetric(np.zeros((4, 8), np.float32), np.ones((4, 8), np.float32), 8)


def test_gptq_codes_checks_before_passing_pointers():
    w, S, u = np.zeros((5, 32), np.float32), np.ones((5, 32), np.float32), np.eye(32, dtype=np.float32)
    for bad in ((w.astype(np.float16), S, None, S, u), (w, S[:4], None, S, u), (w, S, S[:, :16], S, u),
                (w, S, None, S, u[:16])):
        with pytest.raises(ValueError, match="gptq_codes"):
            QF.gptq_codes(*bad, -8, 7, 8, False)


@pytest.mark.parametrize("dt", QB.WEIGHTED_TYPES, ids=lambda d: d.gguf_name)
@pytest.mark.parametrize("weighted", [False, True])
def test_quantize_weighted_bytes_do_not_change(dt, weighted, monkeypatch):
    """The quantisers' bytes with the native fitters plugged in and with the NumPy ones."""
    rng = np.random.default_rng(3)
    cols = 576 if BLOCK_SIZES[dt][0] == 192 else 512
    w = (rng.standard_normal((24, cols)) * np.exp(rng.standard_normal((24, 1)))).astype(np.float32)
    im = np.exp(rng.standard_normal(cols)).astype(np.float32) if weighted else None
    assert QB.NATIVE_FITTERS is QF
    fast = QB.quantize_weighted(w, dt, im)
    monkeypatch.setattr(QB, "NATIVE_FITTERS", None)
    slow = QB.quantize_weighted(w, dt, im)
    assert _same_bytes(fast, slow)


def test_float64_blocks_and_nan_take_the_numpy_path(monkeypatch):
    """NumPy's argmax, min and max pick a NaN where the kernels' ordered compares pass it by: such blocks take the
    NumPy fitters, so the bytes stay NumPy's."""
    x, w = _blocks(32, N=20)
    assert QB._native(x, w) and not QB._native(x.astype(np.float64), w)
    x[3, 7] = np.nan
    assert not QB._native(x, w)
    rows = np.concatenate([x[:16], x[4:20]], axis=1)  # a 64-wide matrix, one NaN
    with np.errstate(all="ignore"):
        fast = QB.quantize_weighted(rows, DType.Q4)
        monkeypatch.setattr(QB, "NATIVE_FITTERS", None)
        slow = QB.quantize_weighted(rows, DType.Q4)
    assert _same_bytes(fast, slow)


def test_the_same_fits_on_every_isa_path():
    """Lanes are blocks (rows for the feedback codes) and nothing is fused: the kernels built for each ISA path this
    host can force give the same bits."""
    from tests._isa import outputs_on_each_path

    script = ("import hashlib, numpy as np; from cflow.codegen import quantfit as QF; "
              "from tests.codegen.test_quantfit import _blocks; h = hashlib.sha256(); "
              "x, w = _blocks(32, 999); s, t = _blocks(16, 999); "
              "[h.update(np.ascontiguousarray(a).tobytes()) for a in (*QF.symmetric(x, w, 8), *QF.affine(x, w, 15), "
              "QF.codebook(x, w), *QF.symmetric(s, t, 32), *QF.affine(s, t, 3, -0.5, 0.1, 15), "
              "*QF.gptq_codes(x[:37].copy(), w[:37] + 1, None, 1 / (w[:37] + 1), np.triu(w[:32] + 2), -8, 7, 8, "
              "False), *QF.gptq_codes(x[:37].copy(), w[:37] + 1, x[40:77], 1 / (w[:37] + 1), "
              "np.triu(w[:32] + 2), 0, 15, 0, True))]; "
              "print(h.hexdigest())")
    got = outputs_on_each_path(script)
    assert len(got) >= 2 and len(set(got.values())) == 1, got


@pytest.mark.parametrize("dt", QB.WEIGHTED_TYPES, ids=lambda d: d.gguf_name)
def test_gptq_codes_are_numpys(dt, monkeypatch):
    """Error feedback's input-by-input codes (passes/gptq.py _by_input) natively and in NumPy: the same bytes, the
    later blocks' bytes, which hang on the corrected weights (rows not a multiple of the lanes; correlated inputs)."""
    from cflow.passes import gptq

    rng = np.random.default_rng(5)
    cols = 576 if BLOCK_SIZES[dt][0] == 192 else 512
    mix = rng.standard_normal((cols, cols)).astype(np.float32) * 0.2 + np.eye(cols, dtype=np.float32)
    x = rng.standard_normal((700, cols)).astype(np.float32) @ mix
    curv = gptq.Curvature(x.T.astype(np.float64) @ x / len(x))
    w = (rng.standard_normal((37, cols)) * np.exp(rng.standard_normal((37, 1)))).astype(np.float32)
    assert gptq.NATIVE_CODES is QF.gptq_codes
    calls = []
    monkeypatch.setattr(gptq, "NATIVE_CODES", lambda *a: calls.append(1) or QF.gptq_codes(*a))
    fast = gptq.quantize(w, dt, curv)
    assert len(calls) == cols // BLOCK_SIZES[dt][0]  # every block took the native call
    monkeypatch.setattr(gptq, "NATIVE_CODES", None)
    slow = gptq.quantize(w, dt, curv)
    assert _same_bytes(fast, slow)
