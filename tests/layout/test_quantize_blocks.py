"""Importance-weighted quantisers (layout/quantize_blocks.py): every type's bytes are GGUF's (gguf.quants
dequantises them as the twin does), and weighing by an importance matrix lowers the weighted error below the same
search unweighted and below gguf-py's reference quantiser."""

import numpy as np
import pytest

from cflow.layout.blocks import FORMATS, OWN_TYPES, BlockTensor
from cflow.layout.quant import DType, to_gguf_bytes
from cflow.layout.quantize_blocks import WEIGHTED_TYPES, quantize_weighted, weighted_error

gguf = pytest.importorskip("gguf")


def _data(rows=16, cols=512, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * np.exp(0.5 * rng.standard_normal((1, cols)))).astype(np.float32)
    imat = np.exp(1.5 * rng.standard_normal(cols)).astype(np.float32)
    return x, imat


@pytest.mark.parametrize("dt", WEIGHTED_TYPES, ids=[d.gguf_name for d in WEIGHTED_TYPES])
def test_bytes_are_ggufs_and_weighting_helps(dt):
    x, imat = _data(cols=576 if FORMATS.get(dt) and FORMATS[dt].qk == 192 else 512)
    t = quantize_weighted(x, dt, imat)
    if dt in OWN_TYPES:  # cflow's own: its bytes as blocks.py documents them
        from tests.layout.test_blocks import own_reference

        assert np.array_equal(own_reference(dt, t.raw, *x.shape), t.dequantize())
        assert t.raw.nbytes * 8 == (4.25 if FORMATS[dt].signed else 3.25) * x.size
        assert weighted_error(x, t, imat) < weighted_error(x, quantize_weighted(x, dt, None), imat)
        return
    ggml = getattr(gguf.GGMLQuantizationType, dt.gguf_name)
    raw = t.raw if isinstance(t, BlockTensor) else to_gguf_bytes(t)
    assert np.array_equal(gguf.quants.dequantize(raw, ggml).reshape(x.shape), t.dequantize())
    weighted = weighted_error(x, t, imat)
    if dt == DType.Q8:  # plain rounding: the importance changes nothing
        return
    assert weighted < weighted_error(x, quantize_weighted(x, dt, None), imat)
    try:
        ref = gguf.quants.dequantize(gguf.quants.quantize(x, ggml), ggml).reshape(x.shape)
    except NotImplementedError:  # gguf-py quantises the legacy types only
        return
    assert weighted < float(((x - ref) ** 2).sum(0) @ imat)


def test_zero_rows_and_bad_shapes():
    x = np.zeros((2, 768), np.float32)  # a whole number of every type's blocks
    for dt in WEIGHTED_TYPES:
        assert not quantize_weighted(x, dt, np.ones(768, np.float32)).dequantize().any()
    with pytest.raises(ValueError, match="256-input blocks"):
        quantize_weighted(np.ones((2, 96), np.float32), DType.Q4_K)
    with pytest.raises(ValueError, match="importance matrix of 3 values"):
        quantize_weighted(np.ones((2, 64), np.float32), DType.Q4, np.ones(3, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_iq4_index_is_the_nearest_value_ties_to_the_lower(dtype):
    """The table lookup gives np.searchsorted over the midpoints bit for bit: random values, each midpoint and
    its neighbours, the range's ends and infinities."""
    from cflow.layout.quantize_blocks import _IQ4_MID, iq4_index

    x = (np.random.default_rng(3).standard_normal(50_000) * 90).astype(dtype)
    down, up = dtype(-np.inf), dtype(np.inf)
    edges = [v for m in _IQ4_MID.astype(dtype) for v in (np.nextafter(m, down), m, np.nextafter(m, up))]
    x = np.concatenate([x, np.array(edges + [-1e30, 1e30, -np.inf, np.inf, 0.0, -0.0], dtype)])
    assert np.array_equal(iq4_index(x), np.searchsorted(_IQ4_MID, x).astype(np.uint8))
    assert np.array_equal(iq4_index(x.reshape(-1, 1)), np.searchsorted(_IQ4_MID, x).astype(np.uint8).reshape(-1, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_safe_div_is_the_guarded_division_rounded_to_float32(dtype):
    from cflow.layout.quantize_blocks import _safe_div

    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((40, 3)).astype(dtype), rng.standard_normal((40, 3)).astype(dtype)
    b[::5] = 0
    def want(a, b):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)

    got = _safe_div(a, b)
    assert got.dtype == np.float32 and np.array_equal(got, want(a, b))
    assert np.array_equal(_safe_div(a[:, :1], b), want(a[:, :1], b))  # broadcast
