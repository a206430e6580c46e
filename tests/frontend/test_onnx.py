"""ONNX frontend: parity with onnxruntime for every family, delays/routing/sharing recovered from the
graph, and bad input (unsupported patterns, non-ONNX, truncated files, missing external data)."""

import numpy as np
import onnx
import pytest
from onnx import helper

from cflow.errors import CflowError, UnsupportedModelError
from cflow.frontend import from_onnx, from_torch
from cflow.frontend.hf import from_hf_module
from cflow.frontend.load import load_graph
from cflow.frontend.onnx_import import from_onnx as import_onnx
from cflow.ir import interpret
from cflow.passes.pipeline import check_native

from ._models import CONTEXT, hf_logits, incremental, ort_logits

IDS = np.random.default_rng(4).integers(0, 256, 20)


@pytest.mark.parametrize("family", ["llama", "mistral", "mixtral", "qwen2_moe", "qwen2"])
def test_hf_export_parity(family, hf_onnx):
    m, path = hf_onnx(family)
    ctx = CONTEXT.get(family)  # None: the file's own context
    g = import_onnx(path, max_seq_len=ctx)
    ref = ort_logits(path, IDS)
    assert np.abs(interpret(g, IDS) - ref).max() <= 1e-4
    assert np.abs(incremental(g, IDS, 7) - hf_logits(m, IDS)).max() <= 1e-4
    # The ONNX path finds the same model as the PyTorch path (names aside).
    assert str(g).splitlines()[1:] == str(from_hf_module(m, max_seq_len=ctx)).splitlines()[1:]
    assert g.config.max_seq_len == (ctx or 128)


def test_rope_scaling_in_an_onnx_file_is_refused_by_node(hf_onnx):
    """Llama 3.x through ONNX: the frequencies in the graph are not default RoPE; the node is named (the PyTorch
    and directory frontends read the scaling from the config instead)."""
    _, path = hf_onnx("llama3")
    with pytest.raises(UnsupportedModelError, match="RoPE frequencies are not theta"):
        import_onnx(path)


def test_arch2_4_round_trips_to_the_same_ir(arch24_onnx):
    from cflow.models import from_preset

    m = from_preset("arch2_4_combined", "tiny", seed=0)
    g_onnx, g_torch = from_onnx(arch24_onnx), from_torch(m)
    assert str(g_onnx) == str(g_torch)
    assert g_onnx.meta.delays == g_onnx.meta.trained_delays == (1, 2)
    assert g_onnx.config.max_seq_len == m.config.max_seq_len
    ids = IDS % m.config.vocab_size
    assert np.abs(interpret(g_onnx, ids) - ort_logits(arch24_onnx, ids)).max() <= 1e-4
    assert np.abs(interpret(g_onnx, ids) - interpret(g_torch, ids)).max() <= 1e-5


def test_sharing_routing_and_every_knob_recovered(knobs_onnx):
    """arch5 weight sharing, pre-dense routing, delays, biases, tying, gated shared expert, no renorm."""
    m, path = knobs_onnx
    g = from_onnx(path)
    assert str(g) == str(from_torch(m))
    assert g.config.n_blocks == 1 and g.config.routing == "pre" and g.config.delays == (1, 1)
    assert np.abs(interpret(g, IDS) - ort_logits(path, IDS)).max() <= 1e-4
    with __import__("torch").no_grad():
        ref = m(__import__("torch").tensor(IDS)).numpy()
    assert np.abs(incremental(g, IDS, 5) - ref).max() <= 1e-4


def test_external_data(hf_onnx, tmp_path):
    _, path = hf_onnx("mixtral")
    model = onnx.load(str(path))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="m.onnx.data", size_threshold=0)
    g = load_graph(tmp_path / "m.onnx")
    assert np.abs(interpret(g, IDS) - ort_logits(path, IDS)).max() <= 1e-4
    data = tmp_path / "m.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CflowError, match="truncated") as e:
        from_onnx(tmp_path / "m.onnx")
    assert "\n" not in str(e.value)
    data.unlink()
    with pytest.raises(CflowError, match="m.onnx.data.*missing"):
        from_onnx(tmp_path / "m.onnx")


@pytest.mark.parametrize("key, value, needle", [("location", "../../etc/passwd", "outside the model's directory"),
                                                 ("length", "12", "does not match its shape")])
def test_external_data_that_lies(key, value, needle, hf_onnx, tmp_path):
    model = onnx.load(str(hf_onnx("llama")[1]))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)
    m = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    t = next(t for t in m.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in t.external_data if e.key == key).value = value
    onnx.save(m, str(tmp_path / "m.onnx"))
    with pytest.raises(CflowError, match=needle):
        from_onnx(tmp_path / "m.onnx")


# --- bad input ------------------------------------------------------------------------------
def test_not_onnx_and_truncated(tmp_path, hf_onnx):
    p = tmp_path / "x.onnx"
    p.write_text("this is not a model\n" * 10)
    with pytest.raises(CflowError) as e:
        from_onnx(p)
    assert "not an ONNX model" in str(e.value) and "\n" not in str(e.value)
    _, path = hf_onnx("llama")
    data = path.read_bytes()
    for cut in (len(data) // 3, len(data) - 100):
        p.write_bytes(data[:cut])
        with pytest.raises(CflowError) as e:
            from_onnx(p)
        assert "\n" not in str(e.value)
    with pytest.raises(CflowError, match="no such"):
        from_onnx(tmp_path / "missing.onnx")


def _edited(path, edit):
    m = onnx.load(str(path))
    edit(m.graph)
    return m


def _softcap(g):
    """logits = 30 * tanh(logits / 30): a Gemma-style soft-cap the IR does not model."""
    out = g.output[0].name
    prod = next(n for n in g.node if out in n.output)
    prod.output[0] = "raw_logits"
    g.initializer.extend([helper.make_tensor("cap", onnx.TensorProto.FLOAT, [], [30.0])])
    g.node.extend([helper.make_node("Div", ["raw_logits", "cap"], ["l1"], name="softcap_div"),
                   helper.make_node("Tanh", ["l1"], ["l2"], name="softcap_tanh"),
                   helper.make_node("Mul", ["l2", "cap"], [out], name="softcap_mul")])


def _qk_norm(g):
    """An RMSNorm on the query projection (Qwen3-style q-norm), inserted after the first q MatMul."""
    q = next(n for n in g.node if n.op_type == "MatMul" and n.input[1].startswith("val_") and
             any(c.op_type == "Reshape" for c in g.node if n.output[0] in c.input))
    y = q.output[0]
    q.output[0] = "q_raw"
    g.initializer.extend([helper.make_tensor("two", onnx.TensorProto.FLOAT, [], [2.0]),
                          helper.make_tensor("qeps", onnx.TensorProto.FLOAT, [], [1e-6]),
                          helper.make_tensor("axes", onnx.TensorProto.INT64, [1], [-1])])
    new = [helper.make_node("Pow", ["q_raw", "two"], ["qn1"], name="qnorm_pow"),
           helper.make_node("ReduceMean", ["qn1", "axes"], ["qn2"], name="qnorm_mean"),
           helper.make_node("Add", ["qn2", "qeps"], ["qn3"], name="qnorm_add"),
           helper.make_node("Sqrt", ["qn3"], ["qn4"], name="qnorm_sqrt"),
           helper.make_node("Div", ["q_raw", "qn4"], [y], name="qnorm_div")]
    pos = list(g.node).index(q) + 1
    for i, n in enumerate(new):
        g.node.insert(pos + i, n)


def _double_scale(g):
    """Scale the attention scores twice as much: same op pattern, different function."""
    mul = next(n for n in g.node if n.op_type == "Mul" and any(c.op_type == "MatMul" and n.output[0] in c.input
                                                               and c.name.startswith("node_MatMul") for c in g.node))
    scale = next(i for i in g.initializer if i.name in mul.input)
    v = onnx.numpy_helper.to_array(scale) * 2
    scale.CopyFrom(onnx.numpy_helper.from_array(v.astype(np.float32), scale.name))


def _extra_input(g):
    g.input.extend([helper.make_tensor_value_info("attention_mask", onnx.TensorProto.INT64, [1, "T"])])


def _sigmoid_router(g):
    """DeepSeek-V3-style sigmoid routing instead of softmax -> top-k."""
    topk = next(n for n in g.node if n.op_type == "TopK")
    next(n for n in g.node if topk.input[0] in n.output).op_type = "Sigmoid"


@pytest.mark.parametrize(
    "family, edit, needle",
    [
        ("llama", _softcap, "node 'softcap_tanh' (Tanh): in the LM head"),
        ("llama", _qk_norm, "node 'qnorm_pow' (Pow): in the attention (layer 1): q/k norms"),
        ("llama", _double_scale, "does not compute what its pattern says"),
        ("llama", _extra_input, "graph input 'attention_mask'"),
        ("mixtral", _sigmoid_router, "(TopK): MoE of layer 1: expected TopK over softmax(router logits)"),
    ],
)
def test_unsupported_patterns_are_named(family, edit, needle, hf_onnx):
    _, path = hf_onnx(family)
    with pytest.raises(UnsupportedModelError) as e:
        from_onnx(_edited(path, edit))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sliding_window_that_bites_is_rejected(hf_onnx):
    """The mask is checked at the full context: Mistral's window of 64 < 128 tokens is refused (the
    parity test above imports the same file for a 64-token context, where it is exact)."""
    m, path = hf_onnx("mistral")
    with pytest.raises(UnsupportedModelError, match="is not causal at T=128") as e:
        from_onnx(path)
    assert "sliding window" in str(e.value)
    g = from_torch(m)  # the PyTorch path models the window (IR, interpreter and the native attention core)
    assert g.config.sliding_window == 64
    check_native(g)  # the native runtime runs sliding windows (tests/runtime/test_families.py)
