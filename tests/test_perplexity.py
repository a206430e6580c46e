"""`cflow perplexity`: llama-perplexity's protocol and its base-logits file.

The protocol against a direct computation (chunks, BOS first where the model adds it, the second half scored, the
error as llama.cpp prints it); the base file written from a run, read back by a KL-divergence run (KLD of a model
against itself is ~0 (only the file's 16-bit rounding), against another quantisation positive); the statistics
against NumPy; the file validated before use (every lie named by its offset); the CLI end to end on the bundled
model with real text."""

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from cflow.cli import cflow_main
from cflow.errors import CflowError
from cflow.models.bundled import default_model_dir
from cflow.runtime import perplexity as P

TEXT = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "tinystories_excerpt.txt"


def test_protocol_against_a_direct_computation():
    rng = np.random.default_rng(0)
    n_ctx, vocab = 16, 11
    tokens = list(rng.integers(0, vocab, 3 * n_ctx + 5))
    chunks = list(P.chunk_inputs(tokens, n_ctx, -1, bos=7))
    assert [s for s, _ in chunks] == [0, 16, 32] and all(ids[0] == 7 for _, ids in chunks)
    ppl, nlls = P.Perplexity(), []
    for start, _ in chunks:
        logits = rng.standard_normal((n_ctx, vocab)).astype(np.float32)
        ppl.add(logits, tokens[start : start + n_ctx])
        for j in range(n_ctx // 2, n_ctx - 1):  # llama.cpp: positions first .. n_ctx - 2 predict the next token
            lp = logits[j].astype(np.float64) - np.log(np.exp(logits[j].astype(np.float64)).sum())
            nlls.append(-lp[tokens[start + j + 1]])
    assert ppl.count == len(nlls) == 3 * (n_ctx - 1 - n_ctx // 2)
    assert math.isclose(ppl.ppl, math.exp(np.mean(nlls)), rel_tol=1e-9)
    assert math.isclose(ppl.error, ppl.ppl * np.std(nlls) / math.sqrt(len(nlls) - 1), rel_tol=1e-9)
    with pytest.raises(CflowError, match="needs at least 32"):
        P.check_text_length(31, 16)


def test_base_file_round_trip_and_kld_statistics(tmp_path):
    rng = np.random.default_rng(1)
    n_ctx, vocab, n_chunk = 16, 50, 3
    tokens = list(rng.integers(0, vocab, n_ctx * n_chunk))
    base = [rng.standard_normal((n_ctx, vocab)).astype(np.float32) * 3 for _ in range(n_chunk)]
    other = [b + rng.standard_normal(b.shape).astype(np.float32) * 0.3 for b in base]
    w = P.LogitsWriter(tmp_path / "b.kld", n_ctx, vocab, n_chunk, tokens)
    for b in base:
        w.add(b)
    w.close()
    f = P.BaseLogits.open(tmp_path / "b.kld")
    assert (f.n_ctx, f.n_vocab, f.n_chunk) == (n_ctx, vocab, n_chunk) and list(f.tokens) == tokens
    first = n_ctx // 2
    for i, b in enumerate(base):  # the stored log-probabilities are the model's to 16-bit rounding
        lp = P.log_softmax(b[first : n_ctx - 1])
        got = P.base_log_probs(np.asarray(f.data[i]), vocab)
        keep = lp > -P.LOG_RANGE + 0.01
        assert np.abs(got[keep] - lp[keep]).max() < 16 / 65535 * 1.01
    same, diff = P.KLDivergence(), P.KLDivergence()
    want = []
    for i in range(n_chunk):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        same.add(base[i], chunk, np.asarray(f.data[i]))
        diff.add(other[i], chunk, np.asarray(f.data[i]))
        p = P.log_softmax(base[i][first : n_ctx - 1])
        q = P.log_softmax(other[i][first : n_ctx - 1])
        want += list((np.exp(p) * (p - q)).sum(axis=1))
    assert same.kld()[0] < 1e-4
    assert math.isclose(diff.kld()[0], float(np.mean(want)), rel_tol=2e-3)
    assert same.same_top()[0] == 1.0
    report = diff.report()
    for line in ("Mean    KLD:", "99.0%   KLD:", "Same top p:", "RMS Δp    :", "Mean PPL(Q)/PPL(base)"):
        assert line in report


@pytest.mark.parametrize("lie, at, value, needle", [
    ("magic", 0, b"_logitz_", "no '_logits_' magic"),
    ("n_vocab", 12, struct.pack("<i", 0), "n_vocab=0 at offset 12"),
    ("n_chunk", 16, struct.pack("<i", 9), "bytes, but n_ctx=16"),
    ("token", 20, struct.pack("<i", 999), "token 999 at offset 20"),
])
def test_a_lying_base_file_is_refused_by_offset(tmp_path, lie, at, value, needle):
    w = P.LogitsWriter(tmp_path / "b.kld", 16, 50, 1, list(range(16)))
    w.add(np.zeros((16, 50), np.float32))
    w.close()
    blob = bytearray((tmp_path / "b.kld").read_bytes())
    blob[at : at + len(value)] = value
    (tmp_path / "x.kld").write_bytes(bytes(blob))
    with pytest.raises(CflowError, match=needle):
        P.BaseLogits.open(tmp_path / "x.kld")


def test_cli_on_the_bundled_model(tmp_path, capsys):
    """cflow perplexity DIR TEXT (compiled first), the base file it writes, a KL run of q4 against it."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    base = tmp_path / "q8.kld"
    assert cflow_main(["perplexity", str(default_model_dir()), str(text), "-c", "128", "--chunks", "4", "--quant",
                       "q8", "--kl-divergence-base", str(base), "--json"]) == 0
    out = capsys.readouterr().out
    assert "[1]" in out and "[4]" in out and "Final estimate: PPL = " in out
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["chunks"] == 4 and rec["bos"] == 0 and 1 < rec["ppl"] < 100
    assert base.stat().st_size == 20 + 4 * 4 * 128 + 2 * 4 * 63 * P.row_words(2048)
    assert cflow_main(["perplexity", str(default_model_dir()), "--quant", "q4", "--kl-divergence-base", str(base),
                       "--kl-divergence", "--json"]) == 0
    out = capsys.readouterr().out
    kl = json.loads(out.strip().splitlines()[-1])
    assert 0 < kl["kl_kld_mean"] < 0.5 and kl["kl_same_top"] > 0.7
    assert "====== KL divergence statistics ======" in out


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert cflow_main(["perplexity", str(default_model_dir()), "--kl-divergence"]) == 1
    assert "needs --kl-divergence-base" in capsys.readouterr().err
    short = tmp_path / "s.txt"
    short.write_text("Once upon a time.", encoding="utf-8")
    assert cflow_main(["perplexity", str(default_model_dir()), str(short), "--quant", "q8"]) == 1
    err = capsys.readouterr().err
    assert "-c 512: the model's context is 256 tokens" in err and err.count("\n") == 1
    assert cflow_main(["perplexity", str(default_model_dir()), str(short), "--quant", "q8", "-c", "128"]) == 1
    err = capsys.readouterr().err
    assert "needs at least 256" in err and err.count("\n") == 1
