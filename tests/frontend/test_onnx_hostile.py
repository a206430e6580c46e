"""Hand-edited ONNX graphs end in one CflowError naming the node and the input or attribute (issue 14).

The long fuzz run (docs/reliability.md) found three bugs in the importer, each an exception other than a CflowError
(`cflowc model.onnx` exited 2): a node whose op type was changed (an IndexError in onnx_patterns.linears), a node
input renamed away (an AttributeError on None in onnx_graph.const_shape), a Reshape input changed under a Transpose
(a NumPy ValueError in onnx_graph._fold). Each case below builds a small decoder by hand, with the weights folded
the way the exporter leaves shared weights (Constant -> Reshape -> Transpose -> Cast), makes one such edit and checks
the message. The unedited graph goes through segmentation and the dense block's weight extraction, so every edited
node is one the importer reads."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cflow.errors import CflowError
from cflow.frontend import from_onnx

D, V, F = 8, 16, 12  # d_model, vocab, dense FFN width


def _rms(name: str, x: str, w: str) -> list:
    return [helper.make_node("Pow", [x, "two"], [f"{name}_sq"], name=f"{name}_pow"),
            helper.make_node("ReduceMean", [f"{name}_sq", "axes"], [f"{name}_ms"], name=f"{name}_mean", keepdims=1),
            helper.make_node("Add", [f"{name}_ms", "eps"], [f"{name}_a"], name=f"{name}_add"),
            helper.make_node("Sqrt", [f"{name}_a"], [f"{name}_s"], name=f"{name}_sqrt"),
            helper.make_node("Reciprocal", [f"{name}_s"], [f"{name}_r"], name=f"{name}_rcp"),
            helper.make_node("Mul", [x, f"{name}_r"], [f"{name}_xn"], name=f"{name}_mul"),
            helper.make_node("Mul", [w, f"{name}_xn"], [f"{name}_out"], name=f"{name}_weight")]


def decoder() -> onnx.ModelProto:
    """Embedding -> RMSNorm -> SwiGLU dense block -> residual add -> RMSNorm -> head. No attention, so a valid
    import ends with 'dense block before the first attention' after the dense block's weights were extracted."""
    rng = np.random.default_rng(0)

    def f(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    inits = [numpy_helper.from_array(a, n) for n, a in [
        ("emb", f(V, D)), ("norm1_w", np.ones(D, np.float32)), ("norm2_w", np.ones(D, np.float32)),
        ("w_gate", f(D, F)), ("w_up", f(D, F)), ("w_down_flat", f(D * F).astype(np.float16)), ("w_head", f(D, V)),
        ("two", np.array(2.0, np.float32)), ("eps", np.array(1e-5, np.float32)), ("axes", np.array([-1], np.int64)),
    ]]
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["x0"], name="embed"),
        *_rms("norm1", "x0", "norm1_w"),
        helper.make_node("MatMul", ["norm1_out", "w_gate"], ["g"], name="ffn_gate"),
        helper.make_node("Sigmoid", ["g"], ["sg"], name="ffn_sigmoid"),
        helper.make_node("Mul", ["g", "sg"], ["act"], name="ffn_silu"),
        helper.make_node("MatMul", ["norm1_out", "w_up"], ["u"], name="ffn_up"),
        helper.make_node("Mul", ["act", "u"], ["m"], name="ffn_mul"),
        helper.make_node("Constant", [], ["down_shape"], name="down_shape_const",
                         value=numpy_helper.from_array(np.array([D, F], np.int64))),
        helper.make_node("Reshape", ["w_down_flat", "down_shape"], ["w_down_df"], name="w_down_reshape"),
        helper.make_node("Transpose", ["w_down_df"], ["w_down_h"], name="w_down_t", perm=[1, 0]),
        helper.make_node("Cast", ["w_down_h"], ["w_down"], name="w_down_cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["m", "w_down"], ["y"], name="ffn_down"),
        helper.make_node("Add", ["x0", "y"], ["x1"], name="residual"),
        *_rms("norm2", "x1", "norm2_w"),
        helper.make_node("MatMul", ["norm2_out", "w_head"], ["logits"], name="head"),
    ]
    g = helper.make_graph(nodes, "hostile", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", V])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def node(m: onnx.ModelProto, name: str):
    return next(n for n in m.graph.node if n.name == name)


def refused(m: onnx.ModelProto, *needles: str) -> str:
    with pytest.raises(CflowError) as e:
        from_onnx(m)
    msg = str(e.value)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, msg
    return msg


def test_the_unedited_graph_reaches_the_dense_block():
    refused(decoder(), "dense block before the first attention")


def _op_changed(m):  # fuzz case 4335 of seed 14: IndexError in onnx_patterns.linears
    node(m, "ffn_sigmoid").op_type = "MatMul"


def _input_emptied(m):  # case 10994: AttributeError on None in onnx_graph.const_shape
    node(m, "w_down_t").input[0] = ""


def _reshape_target_changed(m):  # case 1893: the Transpose under it no longer fits (ValueError in _fold)
    node(m, "w_down_reshape").input[1] = "axes"


def _reshape_data_changed(m):
    node(m, "w_down_reshape").input[0] = "norm1_w"


def _constant_without_value(m):
    del node(m, "down_shape_const").attribute[:]


def _cast_to_no_type(m):
    node(m, "w_down_cast").attribute[0].i = 999


def _perm_of_the_wrong_type(m):
    a = node(m, "w_down_t").attribute[0]
    a.type, a.floats[:] = onnx.AttributeProto.FLOATS, [1.0, 0.0]
    del a.ints[:]


def _required_attribute_dropped(m):
    del node(m, "w_down_cast").attribute[:]


def _perm_out_of_range(m):
    node(m, "w_down_t").attribute[0].ints[:] = [1, 2**62]


def _value_written_twice(m):
    node(m, "ffn_sigmoid").output[0] = "g"


def _initializer_twice(m):
    m.graph.initializer[1].name = m.graph.initializer[2].name


def _opset_out_of_range(m):
    m.opset_import[0].version = 2**40


def _op_not_in_opset(m):
    m.opset_import[0].version = 1  # ReduceMean of opset 1 takes its axes as an attribute: the schema checked


@pytest.mark.parametrize("edit, needles", [
    (_op_changed, ["node 'ffn_sigmoid' (MatMul) has 1 input; MatMul takes 2"]),
    (_input_emptied, ["node 'w_down_t' (Transpose): input 0 (data) has no name; it is required"]),
    (_reshape_target_changed, ["node 'w_down_t' (Transpose): attribute 'perm' = [1, 0] is not a permutation of the "
                               "1 axes of 'w_down_df' [96]"]),
    (_reshape_data_changed, ["node 'w_down_reshape' (Reshape): cannot reshape 'norm1_w' [8] to [8, 12]"]),
    (_constant_without_value, ["node 'down_shape_const' (Constant) has no numeric value"]),
    (_cast_to_no_type, ["node 'w_down_cast' (Cast): attribute 'to' = 999"]),
    (_perm_of_the_wrong_type, ["node 'w_down_t' (Transpose): attribute 'perm' is of type FLOATS; Transpose expects "
                               "INTS"]),
    (_required_attribute_dropped, ["node 'w_down_cast' (Cast): required attribute 'to' is missing"]),
    (_perm_out_of_range, ["node 'w_down_t' (Transpose): attribute 'perm' = [1, 4611686018427387904]"]),
    (_value_written_twice, ["node 'ffn_sigmoid' (Sigmoid) writes 'g', which is already defined"]),
    (_initializer_twice, ["initializer 'norm2_w' is defined twice"]),
    (_opset_out_of_range, ["default-domain opset 1099511627776 is out of range 1.."]),
    (_op_not_in_opset, ["node 'norm1_mean' (ReduceMean) has 2 inputs; ReduceMean takes 1"]),
], ids=lambda v: v.__name__.strip("_") if callable(v) else "")
def test_hand_edited_graph_is_one_error_naming_the_node(edit, needles):
    m = decoder()
    edit(m)
    refused(m, *needles)


def test_a_long_chain_of_foldable_ops_does_not_recurse():
    """3000 Identity nodes between a weight and its MatMul: constant folding walks them without recursion."""
    m = decoder()
    mm = node(m, "ffn_gate")
    chain = [helper.make_node("Identity", [f"wg{i}" if i else "w_gate"], [f"wg{i + 1}"], name=f"id{i}")
             for i in range(3000)]
    mm.input[1] = "wg3000"
    pos = list(m.graph.node).index(mm)
    for i, n in enumerate(chain):
        m.graph.node.insert(pos + i, n)
    refused(m, "dense block before the first attention")


def test_text_that_is_not_utf8_is_named(tmp_path):
    """A flipped byte inside an op type: protobuf returns the field as bytes, which no lookup can use."""
    blob = decoder().SerializeToString()
    assert blob.count(b"Sigmoid") == 1
    path = tmp_path / "flipped.onnx"
    path.write_bytes(blob.replace(b"Sigmoid", b"Sigm\xffid"))
    with pytest.raises(CflowError) as e:
        from_onnx(path)
    assert "the op type of node 9 ('ffn_sigmoid') is not valid UTF-8 text" in str(e.value)
