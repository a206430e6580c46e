"""Q4/Q8 are GGUF's Q4_0/Q8_0 bit for bit (checked against the PyPI gguf reference quantisers)."""

import numpy as np
import pytest

from cflow.layout.quant import DType, dequantize, quantize, quantize_activation_q8, to_gguf_bytes

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as G  # noqa: E402
from gguf import quants  # noqa: E402

PAIRS = [(DType.Q4, G.Q4_0), (DType.Q8, G.Q8_0)]


@pytest.mark.parametrize("ours, theirs", PAIRS)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])
def test_bit_identical_to_gguf(ours, theirs, scale, rng):
    x = (scale * rng.standard_normal((48, 256))).astype(np.float32)
    x[3, :32] = 0.0  # an all-zero block
    x[5, 40] = -7 * scale  # a negative extreme
    t = quantize(x, ours)
    ref = quants.quantize(x, theirs)
    assert np.array_equal(to_gguf_bytes(t), ref)
    assert np.array_equal(dequantize(t), quants.dequantize(ref, theirs).reshape(x.shape))


@pytest.mark.parametrize("dtype", [DType.Q4, DType.Q8])
def test_round_trip_error_bound(dtype, rng):
    """Per 32-block with step d = amax/8 (Q4) or amax/127 (Q8): |x - x'| <= d/2 from rounding plus
    |q| * (fp16 rounding of d) <= 8 resp. 127 * d * 2^-11. Q4 also clamps: the block's extreme sets
    d's sign, and an element near +amax on the other side lands on code 15 = 7d: error <= d."""
    x = rng.standard_normal((64, 512)).astype(np.float32)
    err = np.abs(dequantize(quantize(x, dtype)) - x).reshape(64, -1, 32)
    amax = np.abs(x).reshape(64, -1, 32).max(-1, keepdims=True)
    n = 8 if dtype == DType.Q4 else 127
    d = amax / n
    fp16 = n * d * 2.0**-11
    if dtype == DType.Q4:
        assert (err <= d + fp16 + 1e-7).all()
        assert np.mean(err <= d / 2 + fp16 + 1e-7) > 0.99  # all but the clamped elements
    else:
        assert (err <= d / 2 + fp16 + 1e-7).all()


def test_odd_widths_are_zero_padded(rng):
    x = rng.standard_normal((5, 70)).astype(np.float32)
    t = quantize(x, DType.Q4)
    assert t.q.shape == (5, 3, 32) and dequantize(t).shape == (5, 70)
    assert (t.q[:, 2, 6:] == 8).all()  # padding quantises to code 8 = 0.0


def test_activation_blocks_match_q8_numerics(rng):
    x = rng.standard_normal((3, 100)).astype(np.float32)
    q, d = quantize_activation_q8(x)
    t = quantize(x, DType.Q8)
    # Same rounding as Q8_0 except that the activation scale stays f32.
    assert np.abs(q.reshape(3, -1)[:, :100] * np.repeat(d, 32, -1)[:, :100] - x).max() <= np.abs(x).max() / 127
    assert q.shape == (3, 4, 32) and (q[:, 3, 4:] == 0).all()
    assert np.array_equal(np.sign(q.reshape(3, -1)[:, :100]), np.sign(t.q.reshape(3, -1)[:, :100]))


def test_f16_f32_passthrough(rng):
    x = rng.standard_normal((4, 8)).astype(np.float32)
    assert quantize(x, "f16").dtype == np.float16 and np.array_equal(quantize(x, "f32"), x)


def test_two_plane_activation_blocks(rng):
    """q8x2: the first plane is the int8 activation itself, the second its residual on d/256 (clipped to +-127),
    so a block's value d (q1 + q2/256) is within d/512 of x; act_planes keeps a K-quant reader's point at one plane."""
    from cflow.layout.quant import act_codes, act_planes, quantize_activation_q8x2

    x = rng.standard_normal((3, 100)).astype(np.float32)
    x[0, :4] = [4.0, 1.5, -1.5, 0.0]
    q, d = quantize_activation_q8x2(x)
    q8, d8 = quantize_activation_q8(x)
    assert q.shape == (3, 4, 2, 32) and np.array_equal(q[..., 0, :], q8) and np.array_equal(d, d8)
    c, s = act_codes(x, 2)
    err = np.abs((c * s[..., None]).reshape(3, -1)[:, :100] - x) / np.repeat(d, 32, -1)[:, :100]
    assert err.max() <= 1 / 512 + 1e-6 and np.abs(q[..., 1, :]).max() <= 127
    assert act_planes("q8x2", [DType.Q4, DType.Q5_0, DType.F32]) == 2
    assert act_planes("q8x2", [DType.Q5_0, DType.Q6_K]) == act_planes("q8", [DType.Q4]) == 1
