import json
import math
from pathlib import Path

import pytest
import torch

from cflow.models.bpe import load_tokenizer, train_bpe
from cflow.models.checkpoint import is_checkpoint_dir, load_checkpoint, read_config, tokenizer_json
from cflow.models.data import EOT, batches, encode_stories, eval_windows, split_stories, train_val_split
from cflow.models.train import TrainConfig, evaluate, generate_text, is_complete, lr_at, train

DATA = Path("/work/shared/data/tinystories_val.txt")


@pytest.fixture(scope="module")
def text():
    if DATA.is_file():
        return DATA.read_text(encoding="utf-8")[:24_000]
    return ("Once upon a time, there was a little girl named Lily. She liked to play with her ball.\n\n"
            'One day, Tom came to play. "Can I play too?" he asked. Lily said, "Yes!"\n\nThe end.\n\n') * 60


@pytest.fixture(scope="module")
def corpus(text):
    tr, va = train_val_split(split_stories(text), 0.15, seed=0)
    tok = train_bpe(tr, vocab_size=320)
    return tok, encode_stories(tok, tr), encode_stories(tok, va)


def cfg(**kw):
    base = {"preset": "arch2_4_combined", "size": "tiny", "steps": 40, "batch": 8, "seq": 48, "lr": 5e-3,
            "warmup": 5, "eval_every": 20, "ckpt_every": 10, "threads": 1, "seed": 3}
    return TrainConfig(**{**base, **kw})


# --- data ---------------------------------------------------------------------------------
def test_split_stories_boundaries():
    text = ("Once upon a time, a cat sat.\n\nIt was happy.\n\nThe end.\n\nTim had a kite.\n\nHe flew it.\n\n"
            "Once there was a dog.\n\nThe dog ran.\n")
    assert split_stories(text) == ["Once upon a time, a cat sat.\n\nIt was happy.\n\nThe end.",
                                   "Tim had a kite.\n\nHe flew it.", "Once there was a dog.\n\nThe dog ran."]
    assert split_stories(f"a\n\nb{EOT}c") == ["a\n\nb", "c"]


def test_train_val_split_is_fixed_and_disjoint():
    stories = [f"story {i}" for i in range(100)]
    tr, va = train_val_split(stories, 0.1, seed=0)
    assert len(va) == 10 and len(tr) == 90 and not set(tr) & set(va)
    assert (tr, va) == train_val_split(stories, 0.1, seed=0)
    assert va != train_val_split(stories, 0.1, seed=1)[1]


@pytest.mark.skipif(not DATA.is_file(), reason="needs the TinyStories data file")
def test_real_file_split():
    stories = split_stories(DATA.read_text(encoding="utf-8"))
    assert 700 <= len(stories) <= 900 and all(s.strip() for s in stories)
    _, va = train_val_split(stories)
    assert len(va) == round(0.1 * len(stories))


def test_batches_and_windows():
    ids = list(range(100))
    x, y = next(batches(ids, 4, 10, torch.Generator().manual_seed(0)))
    assert x.shape == (4, 10) and torch.equal(y, x + 1)
    w = eval_windows(ids, 10, 3)
    assert sum(len(b[0]) for b in w) == 9 and torch.equal(w[0][1], w[0][0] + 1)


def test_lr_schedule():
    c = TrainConfig(steps=100, warmup=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(1e-4) and lr_at(9, c) == pytest.approx(1e-3)
    assert lr_at(10, c) == pytest.approx(1e-3) and lr_at(100, c) == pytest.approx(1e-4)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 100))


# --- training -----------------------------------------------------------------------------
def test_loss_falls_and_checkpoint_loads_back(corpus, tmp_path):
    tok, tr, va = corpus
    res = train(cfg(), tr, va, tok.to_str(), tmp_path / "run", progress="none")
    h = res.history
    first = sum(v for _, v in h["train"][:5]) / 5
    last = sum(v for _, v in h["train"][-5:]) / 5
    assert last < first - 1.0
    assert h["final"]["loss"] < h["val"][0]["loss"] - 1.0
    assert h["final"]["ppl"] == pytest.approx(math.exp(h["final"]["loss"]))
    out = tmp_path / "run"
    assert is_checkpoint_dir(out) and is_complete(out, 40)
    assert read_config(out).vocab_size == tok.get_vocab_size() == 320
    assert load_tokenizer(tokenizer_json(out)).get_vocab_size() == 320
    assert "CDLA-Sharing-1.0" in (out / "NOTICE").read_text()
    loaded = load_checkpoint(out)
    ids = torch.tensor(tr[:40])
    with torch.no_grad():
        assert torch.equal(loaded(ids), res.model(ids))
    windows = eval_windows(va, 48, 8)
    assert evaluate(loaded, windows)["loss"] == pytest.approx(h["final"]["loss"], rel=1e-5)


def test_resume_is_exact(corpus, tmp_path):
    tok, tr, va = corpus
    straight = train(cfg(steps=16), tr, va, tok.to_str(), tmp_path / "a", progress="none")
    part = train(cfg(steps=16), tr, va, tok.to_str(), tmp_path / "b", progress="none", stop_after=7)
    assert part.history["step"] == 7 and "final" not in part.history and not is_complete(tmp_path / "b")
    resumed = train(cfg(steps=16), tr, va, tok.to_str(), tmp_path / "b", resume=True, progress="none")
    assert resumed.history["step"] == 16
    for (k, v), (k2, v2) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k
    assert [v for _, v in straight.history["train"]] == [v for _, v in resumed.history["train"]]


def test_existing_run_needs_resume_or_force(corpus, tmp_path):
    from cflow.errors import CflowError

    tok, tr, va = corpus
    train(cfg(steps=2), tr, va, tok.to_str(), tmp_path / "r", progress="none")
    with pytest.raises(CflowError, match="--resume"):
        train(cfg(steps=2), tr, va, tok.to_str(), tmp_path / "r", progress="none")
    with pytest.raises(CflowError, match="batch"):
        train(cfg(steps=4, batch=4), tr, va, tok.to_str(), tmp_path / "r", resume=True, progress="none")
    assert train(cfg(steps=2), tr, va, tok.to_str(), tmp_path / "r", force=True, progress="none").history["step"] == 2


def test_cli_train(text, tmp_path, capsys):
    from cflow.cli import cflow_main

    data = tmp_path / "stories.txt"
    data.write_text(text)
    out = tmp_path / "ck"
    def argv(steps):
        return ["train", "arch5_shared", "--size", "tiny", "--data", str(data), "--vocab", "300", "--steps", str(steps),
                "--batch", "2", "--seq", "32", "--threads", "1", "--out", str(out), "--progress", "none"]

    assert cflow_main(argv(3)) == 0
    assert is_complete(out, 3) and read_config(out).vocab_size == 300
    assert cflow_main(argv(5) + ["--resume"]) == 0  # extend the run to 5 steps
    assert json.loads((out / "history.json").read_text())["step"] == 5
    assert cflow_main(argv(5)) == 1 and "--resume" in capsys.readouterr().err
    assert cflow_main(["train", "nope", "--data", str(data)]) == 1


# --- the bundled model --------------------------------------------------------------------
def test_bundled_default_model_generates():
    from cflow.models.bundled import default_model_dir

    d = default_model_dir()
    assert "CDLA-Sharing-1.0" in (d / "NOTICE").read_text()
    assert (d / "model.safetensors").stat().st_size < 20e6
    m = load_checkpoint(d)
    tok = load_tokenizer(d)
    assert m.config.name == "arch2_4_combined" and m.config.vocab_size == tok.get_vocab_size()
    ids = tok.encode("Once upon a time").ids
    out = m.generate(ids, 8)
    assert len(out) == len(ids) + 8 and all(0 <= i < m.config.vocab_size for i in out)
    text = generate_text(m, tok, "Once upon a time", max_new_tokens=12)
    assert text.startswith("Once upon a time") and len(text) > len("Once upon a time") + 10
