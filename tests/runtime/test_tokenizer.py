"""read_tokenizer_file: the one reader of --tokenizer / compile(tokenizer=...); bad files fail at compile time."""

import re

import pytest

from cflow.errors import CflowError
from cflow.runtime.tokenizer import Tokenizer, read_tokenizer_file

tokenizers = pytest.importorskip("tokenizers")


def _valid_json() -> str:
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tk.to_str()


def test_valid_file_round_trips(tmp_path):
    p = tmp_path / "tokenizer.json"
    p.write_text(_valid_json())
    text = read_tokenizer_file(p)
    assert text == p.read_text() and Tokenizer(text).encode("a b") == [0, 1]


@pytest.mark.parametrize("content, reason", [
    ("{not json", "not a valid tokenizer.json: "),
    ('{"version": "1.0"}', "not a valid tokenizer.json: "),
    (b"\xff\xfe{}", "not a valid tokenizer.json: not UTF-8"),
])
def test_invalid_file(tmp_path, content, reason):
    p = tmp_path / "tokenizer.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(CflowError, match=f"^--tokenizer {re.escape(str(p))}: {reason}"):
        read_tokenizer_file(p)


def test_missing_file(tmp_path):
    p = tmp_path / "nope.json"
    with pytest.raises(CflowError, match=f"^--tokenizer {re.escape(str(p))}: No such file or directory$"):
        read_tokenizer_file(p)


def test_cflowc_and_compile_check_the_file(tmp_path, capsys):
    import cflow
    from cflow.cli import cflowc_main

    bad = tmp_path / "tok.json"
    bad.write_text('{"model": 1}')
    out = tmp_path / "m.vflow"
    assert cflowc_main(["preset:arch1@tiny", "-o", str(out), "--tokenizer", str(bad)]) != 0
    assert "not a valid tokenizer.json" in capsys.readouterr().err and not out.exists()
    with pytest.raises(CflowError, match="not a valid tokenizer.json"):
        cflow.compile("preset:arch1@tiny", tokenizer=bad)
