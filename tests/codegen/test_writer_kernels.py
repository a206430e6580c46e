"""The writer's JIT loops against the NumPy steps they replace, bit for bit: PCG64's raw words and float32 draws
(codegen/pcg64.py), the float32 -> float16 conversion (codegen/half.py) and the Q4 tile packer
(codegen/q4pack.py)."""

import numpy as np
import pytest

from cflow.codegen.half import to_half
from cflow.codegen.pcg64 import LANES, MULT, advance, raw_masked, uniform_f32

MASK = 0x0F0F0F0F0F0F0F0F


@pytest.mark.parametrize("n", [0, 1, LANES - 1, LANES, 2 * LANES + 3, 4 * 3 * 17, 1 << 16])
@pytest.mark.parametrize("buffered", [False, True])
def test_raw_masked_is_numpys_words(n, buffered):
    """The words random_raw draws, masked, and the generator left where random_raw leaves it (its buffered 32-bit
    half too: an odd count of float32 draws before)."""
    ref, gen = (np.random.default_rng([7, 123456789, 3]) for _ in range(2))
    if buffered:
        ref.random(5, dtype=np.float32), gen.random(5, dtype=np.float32)
    want = ref.bit_generator.random_raw(n) & np.uint64(MASK)
    assert np.array_equal(raw_masked(gen.bit_generator, n, MASK), want)
    assert gen.bit_generator.state == ref.bit_generator.state
    assert np.array_equal(gen.random(9, dtype=np.float32), ref.random(9, dtype=np.float32))
    g2 = np.random.default_rng(99)
    assert np.array_equal(raw_masked(g2.bit_generator, n), np.random.default_rng(99).bit_generator.random_raw(n))


def test_raw_masked_refuses_another_generator():
    with pytest.raises(TypeError, match="PCG64"):
        raw_masked(np.random.MT19937(0), LANES)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 2 * LANES - 1, 2 * LANES, 2 * LANES + 1, 2 * LANES + 2, 49152, 100001])
@pytest.mark.parametrize("before", [0, 1, 2])
def test_uniform_f32_is_numpys_random(n, before):
    """Generator.random(n, dtype=float32)'s values and state afterwards, after `before` draws (an odd count leaves
    a half word kept, used first), and the draws after it."""
    ref, gen = (np.random.default_rng([5, n, before]) for _ in range(2))
    ref.random(before, dtype=np.float32), gen.random(before, dtype=np.float32)
    want = ref.random(n, dtype=np.float32)
    assert np.array_equal(uniform_f32(gen.bit_generator, n).view(np.uint32), want.view(np.uint32))
    assert gen.bit_generator.state == ref.bit_generator.state
    assert np.array_equal(gen.random(5, dtype=np.float32), ref.random(5, dtype=np.float32))


def test_advance_is_repeated_steps():
    a, c = advance(MULT, 12345, 0)
    assert (a, c) == (1, 0)
    s, inc = 987654321 << 70 | 5, 0xDEADBEEF << 1 | 1
    t = s
    for _ in range(13):
        t = (t * MULT + inc) % (1 << 128)
    a, c = advance(MULT, inc, 13)
    assert (a * s + c) % (1 << 128) == t


def _tie_cases() -> np.ndarray:
    """Every finite float16, the midpoints between neighbours (ties round to even) and one float32 ulp either
    side of each, overflow edges and subnormals."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    fs = np.unique(h[np.isfinite(h)])
    mids = ((fs[:-1].astype(np.float64) + fs[1:]) / 2).astype(np.float32)
    edges = np.array([65504, 65519.99, 65520, 1e6, -1e6, np.inf, -np.inf, 6e-8, 3e-8, 2.9e-8, 1e-10, -0.0],
                     np.float32)
    return np.concatenate([fs, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                           edges])


@pytest.mark.parametrize("n", [None, 1, 15, 17, 1000003])
def test_to_half_is_numpys_astype(n):
    x = _tie_cases() if n is None else (np.random.default_rng(n).standard_normal(n) * 300).astype(np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(to_half(x).view(np.uint16), want.view(np.uint16))
    out = np.empty((x.size,), np.float16)
    assert to_half(x, out) is out and np.array_equal(out.view(np.uint16), want.view(np.uint16))


def test_to_half_shapes_nan_and_refusals():
    x = np.array([[1.5, np.nan], [-np.nan, 2.0]], np.float32)
    h = to_half(x)
    assert h.shape == (2, 2) and np.isnan(h[0, 1]) and np.isnan(h[1, 0]) and h[0, 0] == 1.5
    with pytest.raises(ValueError, match="C-contiguous float16"):
        to_half(x, np.empty((4, 2), np.float16)[:, 0])
    with pytest.raises(ValueError, match="C-contiguous float16"):
        to_half(x, np.empty(4, np.float32))


@pytest.fixture
def numpy_packer(monkeypatch):
    """layout.tile with the NumPy packer (the oracle) while the test asks, the native one restored after."""
    from cflow.codegen import q4pack
    from cflow.layout import tile

    def use(native: bool) -> None:
        monkeypatch.setattr(tile, "Q4_BAND_PACKER", q4pack.pack_q4_band if native else None)

    return use


@pytest.mark.parametrize("rows, cols, tile, band", [(768, 2048, (128, 256), 1 << 21), (100, 96, (32, 64), 1 << 21),
                                                    (777, 4096, (64, 512), 1), (16, 32, (16, 32), 1 << 21),
                                                    (300, 320, (48, 96), 5000)])
def test_q4_packer_is_numpys(numpy_packer, monkeypatch, rows, cols, tile, band):
    """The native Q4 packer's streams equal the NumPy packer's: one matrix (padded rows and inputs, bands of one
    tile-row and more), gate+up's interleaved tile-rows and a QKV concatenation."""
    from cflow.layout import tile as T
    from cflow.layout.quant import quantize

    monkeypatch.setattr(T, "PACK_BAND_BYTES", band)
    rng = np.random.default_rng(rows)
    ws = [quantize(rng.standard_normal((rows + 16 * j, cols)).astype(np.float32), "q4") for j in range(3)]
    out = {}
    for native in (False, True):
        numpy_packer(native)
        out[native] = [T.pack(ws[0], "q4", tile), T.pack_gate_up(ws[0], ws[0], "q4", tile),
                       T.pack_concat(ws, "q4", tile)[0]]
    for a, b in zip(out[False], out[True]):
        assert np.array_equal(a, b)


def test_q4_packer_refuses_a_scattered_tile_row():
    from cflow.codegen.q4pack import pack_q4_band
    from cflow.layout.tile import TileLayout

    L = TileLayout("q4", 32, 64, (16, 32))
    units = np.zeros((2, 2, 1, 2 * L.unit_nbytes), np.uint8)[..., ::2]
    q, s = np.zeros((32, 2, 32), np.uint8), np.zeros((32, 2), np.float16)
    with pytest.raises(ValueError, match="each contiguous"):
        pack_q4_band(units, q, s, L)
    with pytest.raises(ValueError, match="do not fill"):
        pack_q4_band(np.zeros((2, 2, 1, L.unit_nbytes), np.uint8), q[:16], s[:16], L)
