"""passes.tile: the tile stream is exactly the documented byte layout, and pack/unpack round-trip."""

import numpy as np
import pytest

from cflow.layout import tile as T
from cflow.layout.quant import DType, QTensor, dequantize, quantize

DTYPES = ["q4", "q8", "f16", "f32"]
SHAPES = [(100, 70, (32, 64)), (48, 96, (16, 32)), (256, 512, (128, 256)), (130, 300, (64, 96))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,tile", SHAPES)
def test_round_trip_matches_quant_oracle(rng, dtype, rows, cols, tile):
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    buf = T.pack(w, dtype, tile)
    assert buf.dtype == np.uint8 and buf.size == T.packed_nbytes(dtype, rows, cols, tile)
    assert buf.ctypes.data % 64 == 0
    np.testing.assert_array_equal(T.unpack(buf, dtype, rows, cols, tile), dequantize(quantize(w, dtype)))


@pytest.mark.parametrize("dtype,nbytes", [("q4", 18432), ("q8", 34816), ("f16", 65536), ("f32", 131072)])
def test_default_tile_bytes(dtype, nbytes):
    L = T.TileLayout(dtype, 128, 256)
    bytes_per_32 = {"q4": 18, "q8": 34, "f16": 64, "f32": 128}[dtype]  # GGUF block sizes / plain floats
    assert L.tile_nbytes == nbytes == 128 * 256 // 32 * bytes_per_32
    assert T.packed_nbytes(dtype, 128, 256) == nbytes
    if dtype == "q4":
        assert L.unit_nbytes == 2304 and L.scales_offset == 2048


def test_odd_shape_is_padded_not_rejected(rng):
    w = rng.standard_normal((100, 70)).astype(np.float32)
    L = T.TileLayout("q4", 100, 70)
    assert (L.rows_p, L.cols_p, L.n_tile_rows, L.n_tile_cols) == (128, 256, 1, 1)
    buf = T.pack(w, "q4")
    assert buf.size == 18432
    full = T.unpack(buf, "q4", 128, 256)  # read the padded matrix back: padding is exactly zero
    assert not full[100:].any() and not full[:, 70:].any()
    padded = np.zeros((128, 256), np.float32)
    padded[:100, :70] = w
    # quantising before or after padding gives the same bytes (padded blocks = quantised zeros)
    np.testing.assert_array_equal(buf, T.pack(padded, "q4")[: buf.size])
    np.testing.assert_array_equal(buf, T.pack(quantize(w, "q4"), "q4"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_order_each_tile_is_its_own_submatrix(rng, dtype):
    """tile(tr, tc) lives at tile_offset(tr, tc) and holds exactly W[tr*TR:.., tc*TC:..]."""
    tile = (32, 64)
    w = rng.standard_normal((96, 192)).astype(np.float32)
    L = T.TileLayout(dtype, 96, 192, tile)
    buf = T.pack(w, dtype, tile)
    assert L.n_tile_rows == 3 and L.n_tile_cols == 3
    for tr in range(3):
        for tc in range(3):
            off = L.tile_offset(tr, tc)
            assert off == (tr * 3 + tc) * L.tile_nbytes
            sub = w[tr * 32 : (tr + 1) * 32, tc * 64 : (tc + 1) * 64]
            np.testing.assert_array_equal(buf[off : off + L.tile_nbytes], T.pack(sub, dtype, tile))
            # the kernel walks a tile-row unit by unit: unit (tr, kb) is inside tile (tr, kb // NB)
            kb = tc * L.blocks_per_tile + 1
            assert L.unit_offset(tr, kb) == off + L.unit_nbytes


def test_q4_byte_layout_matches_docstring():
    """Byte-level: code g*256 + c*64 + 4i + j = q[16g+i, 4c+j] | q[16g+i, 16+4c+j] << 4; scales after."""
    rng = np.random.default_rng(3)
    rows, cols = 32, 64  # one tile (32 x 64): 2 groups, 2 block units
    q = rng.integers(0, 16, (rows, 2, 32)).astype(np.uint8)
    s = rng.standard_normal((rows, 2)).astype(np.float16)
    buf = T.pack(QTensor(DType.Q4, rows, cols, s, q), "q4", (32, 64))
    L = T.TileLayout("q4", rows, cols, (32, 64))
    for b in range(2):
        unit = buf[b * L.unit_nbytes : (b + 1) * L.unit_nbytes]
        for g, i, c, j in [(0, 0, 0, 0), (1, 15, 3, 3), (0, 7, 2, 1), (1, 3, 1, 2)]:
            r = 16 * g + i
            assert unit[g * 256 + c * 64 + 4 * i + j] == q[r, b, 4 * c + j] | (q[r, b, 16 + 4 * c + j] << 4)
            d = unit[L.scales_offset + g * 32 + 2 * i : L.scales_offset + g * 32 + 2 * i + 2].view(np.float16)[0]
            assert d == s[r, b]


def test_q8_and_f32_byte_layout():
    w = np.arange(32 * 64, dtype=np.float32).reshape(32, 64)
    buf = T.pack(w, "f32", (32, 64)).view(np.float32)
    # unit b, group g, input k, row i at float index (b*2 + g) * 512 + k*16 + i
    for b, g, k, i in [(0, 0, 0, 0), (1, 1, 31, 15), (0, 1, 5, 2)]:
        assert buf[(b * 2 + g) * 512 + k * 16 + i] == w[16 * g + i, 32 * b + k]
    qt = quantize(np.random.default_rng(0).standard_normal((32, 64)), "q8")
    qb = T.pack(qt, "q8", (32, 64))
    L = T.TileLayout("q8", 32, 64, (32, 64))
    for b, g, c, i, j in [(0, 0, 0, 0, 0), (1, 1, 7, 15, 3)]:
        assert qb[b * L.unit_nbytes + g * 512 + c * 64 + 4 * i + j].view(np.int8) == qt.q[16 * g + i, b, 4 * c + j]


def test_concat_qkv(rng):
    parts = [rng.standard_normal((r, 96)).astype(np.float32) for r in (64, 20, 20)]
    buf, cl = T.pack_concat(parts, "q4", (32, 64))
    assert cl.row_offsets == (0, 64, 96)
    assert cl.layout.rows == 128 and cl.layout.nbytes == buf.size == cl.nbytes
    for p, off in zip(parts, cl.byte_offsets):
        s = T.pack(p, "q4", (32, 64))
        np.testing.assert_array_equal(buf[off : off + s.size], s)
    full = T.unpack(buf, "q4", 128, 96, (32, 64))
    for p, r in zip(parts, cl.row_offsets):
        np.testing.assert_array_equal(full[r : r + len(p)], dequantize(quantize(p, "q4")))
    with pytest.raises(ValueError):
        T.pack_concat([parts[0], rng.standard_normal((4, 50))], "q4", (32, 64))


@pytest.mark.parametrize("dtype", ["q4", "f16"])
def test_gate_up_interleaves_tile_rows(rng, dtype):
    g, u = (rng.standard_normal((70, 96)).astype(np.float32) for _ in range(2))
    buf = T.pack_gate_up(g, u, dtype, (32, 64))
    L = T.gate_up_layout(70, 96, dtype, (32, 64))
    assert buf.size == 2 * L.nbytes
    pg, pu = T.pack(g, dtype, (32, 64)), T.pack(u, dtype, (32, 64))
    n = L.tile_row_nbytes
    for t in range(L.n_tile_rows):  # gate tile-row t, then up tile-row t
        np.testing.assert_array_equal(buf[2 * t * n : (2 * t + 1) * n], pg[t * n : (t + 1) * n])
        np.testing.assert_array_equal(buf[(2 * t + 1) * n : (2 * t + 2) * n], pu[t * n : (t + 1) * n])
    gg, uu = T.unpack_gate_up(buf, dtype, 70, 96, (32, 64))
    np.testing.assert_array_equal(gg, dequantize(quantize(g, dtype)))
    np.testing.assert_array_equal(uu, dequantize(quantize(u, dtype)))


def test_bad_tiles_and_sizes_rejected():
    with pytest.raises(ValueError):
        T.TileLayout("q4", 10, 10, (24, 64))
    with pytest.raises(ValueError):
        T.TileLayout("q4", 10, 10, (32, 48))
    with pytest.raises(ValueError):
        T.unpack(np.zeros(10, np.uint8), "q4", 10, 10)
    with pytest.raises(IndexError):
        T.TileLayout("q4", 10, 10).tile_offset(1, 0)


@pytest.mark.parametrize("dtype", ["q4", "q8", "f16", "f32"])
def test_banded_packing_equals_one_band(rng, dtype, monkeypatch):
    """pack / pack_gate_up / pack_concat fill their output band by band (PACK_BAND_BYTES of tile-rows at a time):
    one tile-row per band, padding in the last band, gives the same bytes as one band for the whole matrix."""
    w, u = rng.standard_normal((2, 100, 200)).astype(np.float32)
    v = rng.standard_normal((40, 200)).astype(np.float32)
    tile = (32, 64)
    monkeypatch.setattr(T, "PACK_BAND_BYTES", 1 << 40)
    one = [T.pack(w, dtype, tile), T.pack_gate_up(w, u, dtype, tile), T.pack_concat([w, v], dtype, tile)[0]]
    monkeypatch.setattr(T, "PACK_BAND_BYTES", 1)
    many = [T.pack(w, dtype, tile), T.pack_gate_up(w, u, dtype, tile), T.pack_concat([w, v], dtype, tile)[0]]
    for a, b in zip(one, many):
        assert np.array_equal(a, b)
    assert np.array_equal(T.unpack(many[0], dtype, 100, 200, tile), T.unpack(one[0], dtype, 100, 200, tile))
