from pathlib import Path

import pytest

from cflow.models.bpe import eot_id, load_tokenizer, train_bpe
from cflow.models.data import EOT, encode_stories, split_stories

DATA = Path("/work/shared/data/tinystories_val.txt")


def encode(tok, text):
    return tok.encode(text).ids


def decode(tok, ids, skip_special_tokens=False):
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def text():
    if DATA.is_file():
        return DATA.read_text(encoding="utf-8")[:30_000]
    return ("Once upon a time, there was a little girl named Lily. She liked to play outside.\n\n"
            '"Hello!" said Tom. "Can I play too?" Lily smiled and said, "Yes!"\n\nThe end.\n\n') * 40


@pytest.fixture(scope="module")
def tok(text):
    return train_bpe(split_stories(text), vocab_size=400)


def test_vocab_and_special_token(tok):
    assert tok.get_vocab_size() == 400
    assert eot_id(tok) == 0 and tok.id_to_token(0) == EOT
    ids = encode(tok, f"The end.{EOT}Once upon a time")
    assert ids.count(0) == 1  # one token, not spelled out in bytes
    assert decode(tok, ids) == f"The end.{EOT}Once upon a time"
    assert decode(tok, ids, skip_special_tokens=True) == "The end.Once upon a time"


def test_round_trip_tinystories(tok, text):
    for story in split_stories(text)[:20]:
        assert decode(tok, encode(tok, story)) == story
    odd = 'Café “naïve” — 日本語 \t tabs\n\nand â€œmojibakeâ€\x00 bytes'
    assert decode(tok, encode(tok, odd)) == odd  # byte-level: nothing is unknown


def test_compresses(tok, text):
    story = split_stories(text)[1]
    assert len(encode(tok, story)) < len(story.encode()) / 1.6


def test_save_load(tok, tmp_path):
    tok.save(str(tmp_path / "tokenizer.json"))
    s = "Once upon a time, Ben saw a big red ball."
    for src in (tmp_path / "tokenizer.json", tmp_path, tok.to_str()):
        assert load_tokenizer(src).encode(s).ids == tok.encode(s).ids


def test_encode_stories_separates_with_eot(tok):
    ids = encode_stories(tok, ["One day, Sam ran.", "Tim was sad."])
    assert ids[0] == 0 and ids[-1] == 0 and ids.count(0) == 3
    assert decode(tok, ids) == f"{EOT}One day, Sam ran.{EOT}Tim was sad.{EOT}"


def test_too_small_vocab():
    with pytest.raises(ValueError):
        train_bpe(["abc"], vocab_size=100)
