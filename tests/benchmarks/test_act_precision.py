"""benchmarks/act_precision.py: its rounding rules are what they say, its variants parse as documented, and its
emulator with the q8 rule is the interpreter's (and so the kernels') int8 arithmetic."""

import numpy as np
import pytest

from benchmarks import act_precision as A
from cflow.layout.quant import quantize_activation_q8


def _x(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[0, 5] = 40.0  # an outlier: its block's scale is large
    x[1, :32] = 0.0  # an all-zero block
    return x


def _block_amax(x):
    b, _ = A._blocks(x)
    return np.repeat(np.abs(b).max(-1), 32, axis=-1)[..., : x.shape[-1]]


def test_q8_is_the_kernels_rounding():
    x = _x()
    q, d = quantize_activation_q8(x)
    want = (q.astype(np.float32) * d[..., None]).reshape(3, -1)[:, : x.shape[1]]
    assert np.array_equal(A.q8(x), want)


@pytest.mark.parametrize("rule, bound", [(A.q8, 1 / 254), (A.q8x2, 1 / 254 / 254), (A.q8x2f, 1 / 127 / 256),
                                         (A.q16, 1 / 65534)])
def test_each_rule_is_within_its_step(rule, bound):
    """|x - rule(x)| <= amax * bound per block (q8x2f: its clipped codes at +-127 reach one grid step, 1/256 of
    q1's; the others half a step), up to f32 rounding (x / d carries ~2^-23 relative error: 0.4% of q16's half
    step at codes near 32767); zero blocks stay zero."""
    x = _x()
    got = rule(x)
    assert got.shape == x.shape and got.dtype == np.float32
    amax = _block_amax(x)
    assert (np.abs(got - x) <= amax * bound * 1.01).all()
    assert (got[1, :32] == 0).all()


def test_q8x2f_codes_are_two_int8_planes():
    x = _x()
    b, _ = A._blocks(x)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.where(d > 0, A._blocks(A.q8x2f(x))[0] / d * 256, 0)
    q1 = np.round(codes / 256)
    q2 = codes - 256 * q1
    assert np.allclose(codes, np.round(codes), atol=1e-2)
    assert np.abs(q1).max() <= 127 and np.abs(q2).max() <= 128  # q2 within int8 (+-127) up to f32 rounding


def test_variants_parse_as_documented():
    kind, o = A.parse_variant("shipped")
    assert kind == "runtime" and o == {"kv": "auto", "activations": "q8"}
    assert A.parse_variant("shipped-kv32") == ("runtime", {"kv": "f32", "activations": "q8"})
    assert A.parse_variant("shipped-q8x2") == ("runtime", {"kv": "auto", "activations": "q8x2"})
    _, o = A.parse_variant("q8x2f-kv16")
    assert o["rule"] is A.q8x2f and o["other"] is A.q8x2f and o["roles"] is None and o["kv"] == "f16"
    _, o = A.parse_variant("q8-but-head")  # f32 on the head, q8 elsewhere
    assert o["rule"] is None and o["other"] is A.q8 and o["roles"] == A.ROLES["head"]
    _, o = A.parse_variant("q8x2f-on-qkv+down")  # q8x2f there, q8 elsewhere
    assert o["rule"] is A.q8x2f and o["other"] is A.q8 and o["roles"] == A.ROLES["qkv"] + A.ROLES["down"]
    _, o = A.parse_variant("q16-only-wo")  # q16 there, f32 elsewhere
    assert o["rule"] is A.q16 and o["other"] is None
    for bad in ("q9", "q8-but-nothing"):
        with pytest.raises(SystemExit):
            A.parse_variant(bad)


def test_the_q8_emulator_is_the_interpreters_int8_arithmetic(tmp_path):
    """On a GGUF model of several block types: the emulator (q8 rule, then the dequantised weights) against
    Interpreter(act_quant='q8') (blocks.matvec_twin's exact integer sums): equal to float rounding where no
    activation code flips, and the same greedy choice where the margin is clear (as tests/runtime/test_gguf_types)."""
    pytest.importorskip("gguf")
    from cflow.frontend.load import load_graph
    from cflow.ir import Interpreter
    from cflow.layout.quant import DType
    from tests.runtime._gguf_blocks import write_llama

    types = {"token_embd": DType.Q8, "attn_q": DType.Q4_1, "attn_k": DType.Q4_1, "attn_v": DType.Q5_0,
             "attn_output": DType.Q4_K, "ffn_gate": DType.Q5_0, "ffn_up": DType.Q5_0, "ffn_down": DType.Q6_K}
    g = load_graph(str(write_llama(tmp_path / "m.gguf", types, layers=1)))
    ids = list(np.random.default_rng(1).integers(3, g.config.vocab_size, 12))
    ref = Interpreter(g, act_quant="q8").prefill(ids)
    em = A.make_interpreter(g, A.q8, "f32", None, A.q8)
    got = A.interp_chunk_logits(em, ids, 4)[4:]
    ref = ref[4:]
    err = np.abs(got - ref).max(axis=1) / ref.std()
    assert np.median(err) <= 1e-4 and err.max() <= 0.1, err
    exact = A.make_interpreter(g, None, "f32", None, None)
    assert not np.allclose(A.interp_chunk_logits(exact, ids, 4)[4:], ref, rtol=0, atol=1e-4 * ref.std())
