"""`cflow export-onnx` and `cflowc model.onnx`: the documented ONNX path end to end, and its failures."""

import onnx
import pytest

from cflow.cli import cflow_main, cflowc_main
from cflow.frontend import from_torch
from cflow.models import from_preset


def test_export_onnx_then_cflowc_emit_ir(arch24_onnx, capsys, tmp_path):
    assert arch24_onnx.is_file() and onnx.load(str(arch24_onnx)).graph.output[0].name == "logits"
    assert cflowc_main([str(arch24_onnx), "--emit", "ir"]) == 0
    assert capsys.readouterr().out == str(from_torch(from_preset("arch2_4_combined", "tiny")))


def test_external_data_export(knobs_onnx):
    _, path = knobs_onnx
    assert (path.parent / (path.name + ".data")).is_file()
    m = onnx.load(str(path), load_external_data=False)
    big = [t for t in m.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 4096]
    assert not big  # the weights live in the .data file


def test_export_onnx_bad_model_is_one_line(tmp_path, capsys):
    out = tmp_path / "x.onnx"
    assert cflow_main(["export-onnx", str(tmp_path / "nope"), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and not out.exists()
    assert cflow_main(["export-onnx", "preset:arch9", "-o", str(out)]) == 1
    assert "unknown preset" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("content", [b"garbage" * 100, None])
def test_cflowc_bad_onnx_writes_nothing(content, tmp_path, capsys, hf_onnx):
    src = tmp_path / "m.onnx"
    if content is None:  # an unsupported pattern: a Tanh soft-cap on the logits
        from onnx import helper

        m = onnx.load(str(hf_onnx("llama")[1]))
        g = m.graph
        prod = next(n for n in g.node if g.output[0].name in n.output)
        prod.output[0] = "raw"
        g.node.append(helper.make_node("Tanh", ["raw"], [g.output[0].name], name="cap"))
        onnx.save(m, str(src))
    else:
        src.write_bytes(content)
    out = tmp_path / "m.vflow"
    assert cflowc_main([str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
    if content is None:
        assert "node 'cap' (Tanh)" in err
