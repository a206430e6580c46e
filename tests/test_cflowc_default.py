"""What cflowc does without --quant: a float model (a directory's or a float GGUF's weights) gets a type mix within
4.5 bits per weight, as --quant auto (the measured best at that size, docs/quantization.md "The default"); a GGUF
of quantised matrices keeps its types; a preset (random weights) stays q4."""

import numpy as np
import pytest

import cflow
from cflow.cli import cflowc_main
from cflow.frontend.load import load_graph
from cflow.ir import build_graph
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.models.bundled import default_model_dir
from cflow.passes.quantize import STORED, default_quant, float_source
from cflow.runtime.format import FileReader

LLAMA = ModelConfig(name="tiny_llama", vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)


def _header(path):
    """The file's header (no JIT: the reader alone)."""
    with FileReader(path) as r:
        return r.header


def test_a_float_directory_gets_a_mix_within_the_budget(tmp_path, capsys):
    out, asked, q4 = tmp_path / "m.vflow", tmp_path / "auto.vflow", tmp_path / "q4.vflow"
    assert cflowc_main([str(default_model_dir()), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "a float model without --quant" in err and "(error at the other types)" not in err  # no table
    h = _header(out)
    assert h["quant"] == STORED and h["quant_mix"]["budget"] == 4.5 and h["quant_mix"]["bpw"] <= 4.5
    assert len({t["type"] for t in h["quant_mix"]["tensors"].values()}) > 1
    assert cflowc_main([str(default_model_dir()), "--quant", "auto", "-o", str(asked)]) == 0
    assert "(error at the other types)" in capsys.readouterr().err  # asked for: the table
    assert out.read_bytes() == asked.read_bytes()
    assert cflowc_main([str(default_model_dir()), "--quant", "q4", "-o", str(q4)]) == 0
    h = _header(q4)
    assert h["quant"] == "q4" and "quant_mix" not in h
    with cflow.load(str(out), threads=1) as m:
        text = m.generate("Once upon a time", max_new_tokens=24)
    assert sum(c.isalpha() or c.isspace() or c in ".,!?'\"" for c in text) / len(text) > 0.9
    api = cflow.compile(str(default_model_dir()), quant="auto", threads=1)  # the API's auto: the same mix
    assert api.session.header["quant_mix"]["tensors"] == _header(out)["quant_mix"]["tensors"]
    assert api.generate("Once upon a time", max_new_tokens=24) == text
    api.close()


def test_asked_for_text_or_budget_and_text_emits(tmp_path, capsys):
    """--imatrix TEXT without --quant stays Q4_0 throughout (with feedback); --bpw prints its table; a text emit
    says what -o would do."""
    d = str(default_model_dir())
    text = tmp_path / "calib.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to play in the park. " * 8)
    out = tmp_path / "im.vflow"
    assert cflowc_main([d, "--imatrix", str(text), "--imatrix-ctx", "32", "-o", str(out)]) == 0
    assert _header(out)["quant_mix"]["type"] == "Q4_0"
    capsys.readouterr()
    assert cflowc_main([d, "--bpw", "5", "-o", str(tmp_path / "b.vflow")]) == 0
    assert "(error at the other types)" in capsys.readouterr().err
    assert cflowc_main([d, "--emit", "analysis"]) == 0
    assert "-o FILE compiles this float model as --quant auto" in capsys.readouterr().err


def test_a_preset_stays_q4(tmp_path):
    out = tmp_path / "p.vflow"
    assert cflowc_main(["preset:arch1@tiny", "-o", str(out)]) == 0
    h = _header(out)
    assert h["quant"] == "q4" and "quant_mix" not in h


def test_a_float_gguf_gets_the_mix_a_quantised_one_keeps_its_types(tmp_path):
    pytest.importorskip("gguf")
    from cflow.compiler import lower
    from cflow.runtime.format.gguf import export_gguf

    rng = np.random.default_rng(0)
    w = {n: (0.1 * rng.standard_normal(s) + (1 if len(s) == 1 else 0)).astype(np.float32)
         for n, s in weight_shapes(LLAMA).items()}
    g = build_graph(LLAMA, w, name="raw")
    export_gguf(g, tmp_path / "f32.gguf")
    export_gguf(lower(g, "q4").graph, tmp_path / "q4.gguf")
    f, q = load_graph(str(tmp_path / "f32.gguf")), load_graph(str(tmp_path / "q4.gguf"))
    assert float_source(f) and not float_source(q)
    assert default_quant(f) == default_quant(q) == STORED  # the API's default: what the file stores
    assert float_source(load_graph(str(default_model_dir())))
    for name, mixed in (("f32", True), ("q4", False)):
        out = tmp_path / f"{name}.vflow"
        assert cflowc_main([str(tmp_path / f"{name}.gguf"), "-o", str(out)]) == 0
        h = _header(out)
        assert h["quant"] == STORED and ("quant_mix" in h) == mixed
    f.meta.source_dtypes.pop("blocks.0.attn.wq")  # a matrix of a type cflow cannot execute is left out: not float
    assert not float_source(f)


def test_a_float_model_no_mix_can_take_keeps_the_former_default(tmp_path):
    """Widths that are not a multiple of 32 take no block type: the float GGUF is kept as stored, as before."""
    pytest.importorskip("gguf")
    from cflow.passes.mix import smallest_bpw
    from cflow.runtime.format.gguf import export_gguf

    c = LLAMA.evolve(name="narrow", d_model=48, n_heads=3, n_kv_heads=1, head_dim=16, ffn_dim=80)
    rng = np.random.default_rng(1)
    w = {n: (0.1 * rng.standard_normal(s) + (1 if len(s) == 1 else 0)).astype(np.float32)
         for n, s in weight_shapes(c).items()}
    export_gguf(build_graph(c, w, name="narrow"), tmp_path / "n.gguf")
    g = load_graph(str(tmp_path / "n.gguf"))
    assert float_source(g) and smallest_bpw(g) is None
    assert cflowc_main([str(tmp_path / "n.gguf"), "-o", str(tmp_path / "n.vflow")]) == 0
    h = _header(tmp_path / "n.vflow")
    assert h["quant"] == STORED and "quant_mix" not in h


def test_mix_types_gguf_leaves_cflows_own_types_out(tmp_path, capsys):
    """--mix-types gguf: a mix of llama.cpp's types only, which GGUF export takes; by default the own types are in."""
    from cflow.layout.blocks import OWN_TYPES

    own = {d.gguf_name for d in OWN_TYPES}
    d = str(default_model_dir())
    for flag, out in ((["--mix-types", "gguf"], tmp_path / "g.vflow"), ([], tmp_path / "a.vflow")):
        # (5 bpw: of llama.cpp's types of 4 bits and more, this model's cheapest mix is 4.51)
        assert cflowc_main([d, "--bpw", "5", *flag, "-o", str(out)]) == 0
        types = {t["type"] for t in _header(out)["quant_mix"]["tensors"].values()}
        assert bool(types & own) == (not flag), types
    capsys.readouterr()
    from cflow.passes import mix as M

    g = load_graph(d)
    q, plan = M.auto_mix(g, 5.0, types=M.GGUF_CANDIDATES)
    assert not set(plan.types.values()) & set(OWN_TYPES)
