"""GGUF block types kept as stored (layout/blocks.py): the NumPy twin equals gguf.quants bit for bit on random
blocks (every code and scale pattern), the tile layout round-trips the file's bytes and adds none, scale folding
keeps the codes, and bad shapes are refused by name."""

import numpy as np
import pytest

from cflow.layout import blocks as B
from cflow.layout import tile as T
from cflow.layout.quant import BLOCK_SIZES, DType, quantize_activation_q8
from tests.runtime._gguf_blocks import random_blocks

gguf = pytest.importorskip("gguf")
TYPES = list(B.FORMATS)


def _ggml(dt):
    return getattr(gguf.GGMLQuantizationType, dt.gguf_name)


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_format_matches_ggml(dt):
    fmt = B.FORMATS[dt]
    assert (fmt.qk, fmt.nbytes) == gguf.GGML_QUANT_SIZES[_ggml(dt)] == BLOCK_SIZES[dt]
    assert fmt.group_nbytes == 16 * fmt.nbytes and all(n % 4 == 0 or n == 2 for _, n in fmt.fields)


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_twin_equals_gguf_dequantisation_bit_for_bit(dt):
    rng = np.random.default_rng(1)
    t = random_blocks(dt, 37, 512, rng, 1.0)
    want = gguf.quants.dequantize(t.raw, _ggml(dt)).reshape(37, 512)
    assert np.array_equal(t.dequantize(), want)


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
@pytest.mark.parametrize("tile", [(32, 256), (128, 128), (16, 32)])
def test_tile_stream_round_trips_and_holds_the_file_bytes(dt, tile):
    rng = np.random.default_rng(2)
    rows, cols = 48, 1024
    t = random_blocks(dt, rows, cols, rng, 1.0)
    s = T.pack(t, dt, tile)
    L = T.TileLayout(dt, rows, cols, tile)
    assert s.size == L.nbytes
    back = T.unpack_blocks(s, dt, rows, cols, tile)
    assert np.array_equal(back.raw, t.raw)
    if rows % tile[0] == 0:  # no row padding: exactly the GGUF's bytes
        assert L.nbytes == t.nbytes
    assert L.cols_p % B.FORMATS[dt].qk == 0


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_matvec_twin_is_the_int8_activation_product(dt):
    """matvec_twin == dequantised weights times the int8-quantised activation (float64), to float rounding."""
    rng = np.random.default_rng(3)
    t = random_blocks(dt, 40, 512, rng, 0.05)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    qa, da = quantize_activation_q8(x)
    xq = (qa.astype(np.float64) * da[..., None]).reshape(3, 512)
    want = xq @ t.dequantize().astype(np.float64).T
    got = B.matvec_twin(t, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_scaled_keeps_codes_and_scales_the_values(dt):
    rng = np.random.default_rng(4)
    t = random_blocks(dt, 8, 256, rng, 1.0)
    s = t.scaled(3.5)
    fmt = t.format
    sl = fmt.field_slices()
    a, b = (x.raw.reshape(8, -1, fmt.nbytes) for x in (t, s))
    for name, _ in fmt.fields:
        if name not in fmt.f16_scales:
            assert np.array_equal(a[..., sl[name]], b[..., sl[name]]), name
    want = t.dequantize() * 3.5
    assert np.abs(s.dequantize() - want).max() <= 2**-10 * np.abs(want).max()
    with pytest.raises(ValueError, match="overflows an fp16"):
        t.scaled(1e9)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="640 inputs per row is not a whole number of 256-input blocks"):
        B.BlockTensor(DType.Q4_K, 2, 640, np.zeros((2, 360), np.uint8))
    with pytest.raises(ValueError, match="expected uint8"):
        B.BlockTensor(DType.Q4_K, 2, 512, np.zeros((2, 100), np.uint8))
    with pytest.raises(ValueError, match="a Q4_K stream is packed from Q4_K blocks, not from ndarray"):
        T.pack(np.zeros((16, 256), np.float32), DType.Q4_K)
