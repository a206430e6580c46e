"""Calibrated quantisation (passes/imatrix.py, passes/mix.py, cflowc --imatrix / --bpw): the importance matrix is
what the interpreter's matrices read, survives llama.cpp's .dat format, refuses another model's; the allocation
meets its budget or says it cannot; a mixed, importance-weighted compile runs and equals its twin."""

import struct

import numpy as np
import pytest

import cflow
from cflow.cli import cflowc_main
from cflow.errors import CflowError
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.layout.quant import DType
from cflow.passes import imatrix as I
from cflow.passes import mix as M
from tests._shared import SMALL_TILE


@pytest.fixture(scope="module")
def tiny():
    g = load_graph("preset:arch1@tiny")
    ids = np.random.default_rng(0).integers(0, g.config.vocab_size, 80)
    return g, ids, I.collect(g, ids, 32)


def test_imatrix_is_the_mean_square_of_each_matrix_input(tiny):
    g, ids, im = tiny
    assert im.chunks == 2 and set(M.matrices(g)) - {"tok_embeddings"} <= set(im.values)
    run = Interpreter(g, max_seq_len=32)
    seen = {}
    real = run.matvec

    def spy(x, name, point=()):
        seen.setdefault(name, []).append(np.asarray(x))
        return real(x, name, point)

    run.matvec = spy
    for c in range(2):
        run.reset()
        run.run(ids[32 * c : 32 * c + 32])
    for name in ("blocks.1.attn.wo", "blocks.2.moe.experts.1.w_down"):  # experts: the tokens routed to them
        x = np.concatenate(seen[name])
        assert np.allclose(im.values[name], (x.astype(np.float64) ** 2).mean(0), rtol=1e-5)


def test_dat_file_round_trip_and_other_models(tiny, tmp_path):
    g, _, im = tiny
    p = tmp_path / "m.imatrix.dat"
    I.write_dat(im, p)
    back = I.read(p, g)
    assert back.chunks == im.chunks and set(back.values) == set(im.values)
    for n, v in im.values.items():
        assert np.allclose(back.values[n], v, rtol=1e-6)
    raw = p.read_bytes()
    (ln,) = struct.unpack("<i", raw[4:8])
    assert raw[8 : 8 + ln].decode().startswith("blk.")  # llama.cpp's tensor names
    other = load_graph("preset:arch1@small")
    with pytest.raises(CflowError, match="another model"):
        I.read(p, other)
    q = tmp_path / "renamed.dat"
    q.write_bytes(raw.replace(b"blk.0.attn_q.weight", b"blk.0.attn_x.weight"))
    with pytest.raises(CflowError, match="attn_x.*not in"):
        I.read(q, g)
    junk = tmp_path / "junk.dat"
    junk.write_bytes(b"\x05\x00")
    with pytest.raises(CflowError, match="not an importance matrix"):
        I.read(junk, g)


def test_calibration_text_too_short(tiny):
    g, ids, _ = tiny
    with pytest.raises(CflowError, match="at least 32"):
        I.collect(g, ids[:20], 32)


def test_allocation_meets_the_budget_and_refuses_an_impossible_one():
    dts = (DType.Q4, DType.Q5_0, DType.Q8)
    rng = np.random.default_rng(2)
    options = {f"t{i}": [(b, e * s, dt) for b, e, dt in zip((45, 55, 85), (1.0, 0.25, 0.004), dts)]
               for i, s in enumerate(rng.uniform(0.1, 10, 12))}
    for budget in (12 * 45, 12 * 50, 12 * 70, 12 * 85):
        got = M.allocate(options, budget)
        used = sum(next(b for b, _, d in options[n] if d == dt) for n, dt in got.items())
        assert used <= budget
        if budget == 12 * 85:
            assert set(got.values()) == {DType.Q8}
    big = max(options, key=lambda n: options[n][0][1])
    assert M.allocate(options, 12 * 45 + 10)[big] == DType.Q5_0  # the first bits go where the error is largest
    with pytest.raises(CflowError, match="no type mix"):
        M.allocate(options, 12 * 45 - 1)


def test_bpw_compile_runs_as_its_twin_and_stores_the_plan(tiny, tmp_path):
    from cflow.compiler import compile_file

    g, ids, im = tiny
    weights = M.column_weights(g, im.for_graph(g))
    errors = M.measure(g, weights, sample_rows=64)
    sens = M.sensitivities(g, weights, errors, ids[:24])
    plan = M.plan_mix(g, M.predicted(errors, sens), 5.0)
    assert plan.bpw <= 5.0 and len(set(plan.types.values())) > 1
    for members in M.groups(plan.types).values():  # gate and up: one fused kernel; a bank's experts: one type
        assert len({plan.types[n] for n in members}) == 1
    with pytest.raises(CflowError, match="no type mix .* smallest is"):
        M.plan_mix(g, errors, 3.0)
    out = tmp_path / "m.vflow"
    compile_file(M.apply_types(g, plan.types, weights, plan.to_json()), out, "stored", SMALL_TILE)
    with cflow.load(str(out), threads=1, kv="f32") as m:
        mix = m.session.header["quant_mix"]
        assert {n: t["type"] for n, t in mix["tensors"].items()} == {n: d.gguf_name for n, d in plan.types.items()}
        got = m.session.prefill([int(t) for t in ids[:12]], all_logits=True)
        ref = Interpreter(m.ir, act_quant="q8").prefill(ids[:12])
    err = np.abs(got - ref).max(axis=1) / ref.std()
    assert np.median(err) <= 1e-4 and err.max() <= 0.1, err


def test_cflowc_bad_calibration_inputs(tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text("Once upon a time")
    out = str(tmp_path / "m.vflow")
    assert cflowc_main(["preset:arch1@tiny", "--imatrix", str(text), "-o", out]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    assert cflowc_main(["preset:arch1@tiny", "--bpw", "4.5", "--quant", "q8", "-o", out]) == 1
    assert "does not combine" in capsys.readouterr().err
    assert cflowc_main(["preset:arch1@tiny", "--bpw", "2", "-o", out]) == 1
    assert "no type mix" in capsys.readouterr().err


def test_probe_replay_equals_a_full_run(tiny):
    """The KLD probe re-runs the interpreter from the first node reading a swapped weight: the same logits."""
    g, ids, _ = tiny
    r = M._Replay(g, ids[:16])
    for n in ("tok_embeddings", "blocks.2.attn.wv", "blocks.3.moe.experts.1.w_down"):
        w = np.asarray(r.weight(n)) * np.float32(1.01)
        full = Interpreter(g, max_seq_len=16)
        full._dense[n] = w
        assert np.array_equal(r.replay({n: w}), full.run(ids[:16]))
    assert np.array_equal(r.replay({"lm_head": r.weight("lm_head")}), r.logits)


def test_gguf_imatrix_is_read(tiny, tmp_path):
    """llama.cpp's newer GGUF imatrix: per tensor, in_sum2 (sum of x^2) and counts (rows seen)."""
    gguf = pytest.importorskip("gguf")
    g, _, im = tiny
    p = tmp_path / "m.imatrix.gguf"
    w = gguf.GGUFWriter(str(p), "imatrix")
    w.add_uint32("imatrix.chunk_count", 2)
    v = im.values["blocks.1.attn.wo"]
    w.add_tensor("blk.1.attn_output.weight.in_sum2", (v * 40).astype(np.float32))
    w.add_tensor("blk.1.attn_output.weight.counts", np.array([40], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    back = I.read(p, g)
    assert back.chunks == 2 and list(back.values) == ["blocks.1.attn.wo"]
    assert np.allclose(back.values["blocks.1.attn.wo"], v, rtol=1e-6)


def test_an_untied_block_type_embedding_is_weighed():
    """A GGUF source whose untied embedding is a K-quant / legacy block type (Qwen2.5's Q4_K): the mix weighs it by
    its dequantised rows (it once failed with float() of a BlockTensor)."""
    from cflow.layout.quantize_blocks import quantize_weighted

    g = load_graph("preset:arch1@tiny").copy()
    assert g["logits"].weight != "tok_embeddings"
    e = np.asarray(g.weights["tok_embeddings"], np.float32)
    g.weights = {**g.weights, "tok_embeddings": quantize_weighted(e, DType.Q5_0)}
    w = M.column_weights(g, {})["tok_embeddings"]
    assert w.shape == (e.shape[1],) and np.all(w > 0)
