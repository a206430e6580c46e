"""GGUF block types kept as stored (layout/blocks.py): the NumPy twin equals gguf.quants bit for bit on random
blocks (every code and scale pattern), and cflow's own types' twin equals a block-by-block reading of their
documented bytes; the tile layout round-trips the file's bytes and adds none, scale folding keeps the codes, and bad
shapes are refused by name."""

import numpy as np
import pytest

from cflow.layout import blocks as B
from cflow.layout import tile as T
from cflow.layout.quant import BLOCK_SIZES, DType, quantize_activation_q8
from tests.runtime._gguf_blocks import random_blocks

gguf = pytest.importorskip("gguf")
TYPES = list(B.FORMATS)
GGUF_TYPES = [d for d in TYPES if d not in B.OWN_TYPES]


def _cols(dt, n: int) -> int:
    """n inputs, or the next multiple of the type's block (IQ4_192: 512 -> 576)."""
    qk = B.FORMATS[dt].qk
    return -(-n // qk) * qk


def _ggml(dt):
    return getattr(gguf.GGMLQuantizationType, dt.gguf_name)


@pytest.mark.parametrize("dt", GGUF_TYPES, ids=[d.name for d in GGUF_TYPES])
def test_format_matches_ggml(dt):
    fmt = B.FORMATS[dt]
    assert (fmt.qk, fmt.nbytes) == gguf.GGML_QUANT_SIZES[_ggml(dt)] == BLOCK_SIZES[dt]
    assert fmt.group_nbytes == 16 * fmt.nbytes and all(n % 4 == 0 or n == 2 for _, n in fmt.fields)


@pytest.mark.parametrize("dt", GGUF_TYPES, ids=[d.name for d in GGUF_TYPES])
def test_twin_equals_gguf_dequantisation_bit_for_bit(dt):
    rng = np.random.default_rng(1)
    t = random_blocks(dt, 37, 512, rng, 1.0)
    want = gguf.quants.dequantize(t.raw, _ggml(dt)).reshape(37, 512)
    assert np.array_equal(t.dequantize(), want)


def own_reference(dt, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """cflow's own types read block by block, bit by bit, as blocks.py's docstring lays their bytes out."""
    fmt = B.FORMATS[dt]
    ns = fmt.qk // 32
    out = np.zeros((rows, cols), np.float32)
    blocks = raw.reshape(rows, cols // fmt.qk, fmt.nbytes)
    for r in range(rows):
        for k in range(cols // fmt.qk):
            blk = blocks[r, k]
            word = int.from_bytes(bytes(blk[0:4]), "little")
            e, m = word >> 27, (word >> 24) & 7
            D = np.float32(0) if e == 0 else np.float32((1 + m / 8) * 2.0 ** (e - 29))
            sl = fmt.field_slices()
            for s in range(ns):
                if "scales_h" not in sl:
                    hi = (word >> (16 + 2 * s)) & 3
                else:
                    hi = (int.from_bytes(bytes(blk[sl["scales_h"]]), "little") >> (2 * s)) & 3
                scale = D * np.float32(((word >> (4 * s)) & 0xF | hi << 4) - 32)
                x0 = k * fmt.qk + 32 * s
                if fmt.signed:  # the IQ4 code book, two inputs a byte
                    qs = blk[sl["qs"]][16 * s : 16 * s + 16]
                    for i in range(16):
                        out[r, x0 + i] = scale * np.float32(B.IQ4_VALUES[qs[i] & 0xF])
                        out[r, x0 + 16 + i] = scale * np.float32(B.IQ4_VALUES[qs[i] >> 4])
                    continue
                qs, qh = blk[sl["qs"]][8 * s : 8 * s + 8], blk[sl["qh"]][4 * s : 4 * s + 4]
                for i in range(32):  # 3-bit codes: low 2 bits in qs, the third in qh, minus 4
                    code = ((int(qs[i % 8]) >> (2 * (i // 8))) & 3) | (((int(qh[i % 4]) >> (i // 4)) & 1) << 2)
                    out[r, x0 + i] = scale * np.float32(code - 4)
    return out


@pytest.mark.parametrize("dt", B.OWN_TYPES, ids=[d.name for d in B.OWN_TYPES])
def test_own_types_twin_is_their_documented_bytes(dt):
    rng = np.random.default_rng(1)
    cols = _cols(dt, 512)
    t = random_blocks(dt, 5, cols, rng, 1.0)
    raw = t.raw.copy()
    raw.reshape(5, -1, t.format.nbytes)[0, 0, 3] = 7  # a zero super-block scale (e = 0)
    t = B.BlockTensor(dt, 5, cols, raw)
    bpw = 4.25 if B.FORMATS[dt].signed else 3.25
    assert (B.FORMATS[dt].qk, B.FORMATS[dt].nbytes * 8 / B.FORMATS[dt].qk) == (BLOCK_SIZES[dt][0], bpw)
    assert np.array_equal(t.dequantize(), own_reference(dt, t.raw, 5, cols))
    assert not t.dequantize()[0, : B.FORMATS[dt].qk].any()


def test_e5m3_rounds_up_and_keeps_its_range():
    d = np.array([0, 2.0**-40, 2.0**-28, 1e-3, 0.00099, 7.5, 8, 100], np.float32)
    b = B.e5m3_ceil(d)
    v = B.e5m3_value(b)
    assert v[0] == 0 and v[1] == v[2] == 2.0**-28 and v[-1] == v[-2] == 7.5 == v[-3] == B.E5M3_MAX
    assert (v[3:5] >= d[3:5]).all() and (v[3:5] < d[3:5] * 1.125).all()
    every = B.e5m3_value(np.arange(8, 256))
    assert (np.diff(every) > 0).all() and np.array_equal(B.e5m3_ceil(every), np.arange(8, 256))


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
@pytest.mark.parametrize("tile", [(32, 256), (128, 128), (16, 32)])
def test_tile_stream_round_trips_and_holds_the_file_bytes(dt, tile):
    rng = np.random.default_rng(2)
    rows, cols = 48, _cols(dt, 1024)
    t = random_blocks(dt, rows, cols, rng, 1.0)
    s = T.pack(t, dt, tile)
    L = T.TileLayout(dt, rows, cols, tile)
    assert s.size == L.nbytes
    back = T.unpack_blocks(s, dt, rows, cols, tile)
    assert np.array_equal(back.raw, t.raw)
    if rows % tile[0] == 0 and L.cols_p == cols:  # no padding: exactly the GGUF's bytes
        assert L.nbytes == t.nbytes
    assert L.cols_p % B.FORMATS[dt].qk == 0


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_matvec_twin_is_the_int8_activation_product(dt):
    """matvec_twin == dequantised weights times the int8-quantised activation (float64), to float rounding."""
    rng = np.random.default_rng(3)
    cols = _cols(dt, 512)
    t = random_blocks(dt, 40, cols, rng, 0.05)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    qa, da = quantize_activation_q8(x)
    xq = (qa.astype(np.float64) * da[..., None]).reshape(3, cols)
    want = xq @ t.dequantize().astype(np.float64).T
    got = B.matvec_twin(t, x)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("dt", TYPES, ids=[d.name for d in TYPES])
def test_scaled_keeps_codes_and_scales_the_values(dt):
    rng = np.random.default_rng(4)
    t = random_blocks(dt, 8, _cols(dt, 256), rng, 1.0)
    if dt in B.OWN_TYPES:  # an 8-bit super-block scale takes no arbitrary factor: refused, not rounded
        with pytest.raises(ValueError, match="no fp16 scale to fold a multiplier of 3.5 into"):
            t.scaled(3.5)
        return
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
