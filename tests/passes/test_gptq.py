"""Error feedback (passes/gptq.py): the input second moments are what the interpreter's matrices read; on the bundled
model's trained weights and real activations the fed-forward quantisation lowers every type's output error; its
bytes are the type's own; cflowc --imatrix TEXT uses it unless --no-gptq, and the compiled file runs as its twin."""

import numpy as np
import pytest

import cflow
from cflow.cli import cflowc_main
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.layout.blocks import dequantize_blocks
from cflow.layout.quant import DType, dequantize
from cflow.layout.quantize_blocks import WEIGHTED_TYPES, quantize_weighted
from cflow.models.bundled import default_model_dir
from cflow.passes import gptq
from cflow.passes import imatrix as I
from cflow.passes import mix as M
from cflow.runtime.tokenizer import Tokenizer

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog. "
        "One day, she saw a big red ball under a tree. She ran to get it, but a bird flew down and took it away. "
        "Lily was sad, so her mom gave her a hug and they went home to bake a cake together. ") * 6


@pytest.fixture(scope="module")
def bundled():
    g = load_graph(str(default_model_dir()))
    tok = Tokenizer(g.meta.tokenizer, g.meta.eos_token_ids, g.meta.special_tokens)
    ids = tok.encode(TEXT, add_special=False)
    return g, ids, I.collect(g, ids, 64, 4, gram_bytes=1 << 30)


def _dense(t):
    return dequantize(t) if hasattr(t, "scales") else dequantize_blocks(t)


def test_grams_are_the_mean_outer_product_of_each_matrix_input(bundled):
    g, ids, im = bundled
    run = Interpreter(g, max_seq_len=64)
    seen = {}
    real = run.matvec

    def spy(x, name, point=()):
        seen.setdefault(name, []).append(np.asarray(x, np.float64))
        return real(x, name, point)

    run.matvec = spy
    for c in range(4):
        run.reset()
        run.run(np.asarray(ids[64 * c : 64 * c + 64]))
    assert set(im.grams) == set(seen)
    for name, xs in seen.items():
        x = np.concatenate(xs)
        assert np.allclose(im.grams[name], x.T @ x / len(x), rtol=1e-6, atol=1e-9), name
        assert np.allclose(np.diag(im.grams[name]), im.values[name], rtol=1e-5)
    q, k, v = (im.grams[f"blocks.0.attn.{w}"] for w in ("wq", "wk", "wv"))
    assert q is k is v  # one input, one matrix


def test_gram_budget_keeps_the_diagonal_for_the_rest(bundled):
    g, ids, _ = bundled
    width = g.config.d_model
    im = I.collect(g, ids, 64, 1, gram_bytes=8 * width * width * 2)  # room for two inputs' grams
    assert 1 <= len({id(v) for v in im.grams.values()}) <= 2
    assert set(im.values) > set(im.grams)


def test_error_feedback_lowers_the_output_error_of_every_type(bundled):
    """Trained weights, real activations: for each type GPTQ's output error is below the importance-weighted fit's
    ; by a clear margin where the matrix has more than one block."""
    g, _, im = bundled
    curv = M.curvatures(im.grams)
    names = ["blocks.0.attn.wq", "blocks.1.ffn.w_down", "blocks.1.attn.wo"]
    for dt in WEIGHTED_TYPES:
        for n in names:
            w = np.asarray(g.weights[n], np.float32)
            if w.shape[1] % M.BLOCK_SIZES[dt][0]:
                continue
            c = curv[n]
            plain = gptq.output_error(w, quantize_weighted(w, dt, np.diag(c.h).astype(np.float32)), c)
            fed = gptq.output_error(w, t := gptq.quantize(w, dt, c), c)
            assert t.dtype == dt and t.shape == w.shape
            if M.BLOCK_SIZES[dt][0] < w.shape[1]:
                assert fed < 0.85 * plain, (dt, n, fed, plain)
            else:
                assert fed <= 1.02 * plain, (dt, n, fed, plain)


def test_uncorrelated_inputs_give_the_plain_fit():
    """With H = I nothing is fed forward: IQ4_NL's bytes are the importance-weighted quantiser's own (the block
    encoder writes the type's layout), Q4_0's values lie on each block's grid."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    c = gptq.Curvature(np.eye(96))
    a, b = gptq.quantize(w, DType.IQ4_NL, c), quantize_weighted(w, DType.IQ4_NL, np.ones(96, np.float32))
    assert np.array_equal(a.raw, b.raw)
    t = gptq.quantize(w, DType.Q4, c)
    d = t.scales.astype(np.float32)[..., None]
    assert np.array_equal(_dense(t).reshape(24, 3, 32), d * (t.q.astype(np.float32) - 8))


def test_cflowc_imatrix_text_feeds_errors_forward(bundled, tmp_path, capsys):
    g, ids, _ = bundled
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    src = str(default_model_dir())
    outs = {}
    for flag in ([], ["--no-gptq"]):
        out = tmp_path / f"m{len(flag)}.vflow"
        args = [src, "--imatrix", str(text), "--imatrix-ctx", "64", "--quant", "q4", "-o", str(out), *flag]
        assert cflowc_main(args) == 0
        err = capsys.readouterr().err
        assert ("error feedback (GPTQ) on" in err) == (not flag)
        outs[bool(flag)] = out
    ref = Interpreter(g, max_seq_len=64).prefill(np.asarray(ids[:48]))
    errs = {}
    for plain, out in outs.items():
        # two-plane activations: with trained weights a 1-ulp flip of an int8 activation code is frequent enough on
        # text to carry on through the cache; on the 256x finer grid it moves the logits by 1/256 as much
        with cflow.load(str(out), threads=1, kv="f32", activations="q8x2") as m:
            assert m.session.header["quant_mix"]["gptq"] is (not plain)
            got = m.session.prefill([int(t) for t in ids[:48]], all_logits=True)
            twin = Interpreter(m.ir, act_quant="q8x2").prefill(np.asarray(ids[:48]))
        e = np.abs(got - twin).max(axis=1) / twin.std()
        assert np.median(e) <= 5e-4 and e.max() <= 0.1, e
        errs[plain] = float(((twin - ref) ** 2).mean())
    assert errs[False] < errs[True]  # closer to the float model's logits on the text it was calibrated on


def test_a_singular_second_moment_still_factors():
    """Inputs the text never moved (zero rows and columns) and exactly repeated inputs: the damping keeps the
    factor defined, and the quantised matrix is still the type's own."""
    x = np.random.default_rng(4).standard_normal((200, 48))
    x[:, 5] = 0
    x[:, 7] = x[:, 6]
    c = gptq.Curvature(np.concatenate([x, np.zeros((200, 16))], 1).T @ np.concatenate([x, np.zeros((200, 16))], 1))
    w = np.random.default_rng(5).standard_normal((8, 64)).astype(np.float32)
    t = gptq.quantize(w, DType.Q4, c)
    assert np.isfinite(c.factor()).all() and np.isfinite(_dense(t)).all() and t.shape == (8, 64)
