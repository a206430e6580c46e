"""benchmarks/batch_files.py: a compiled file's single stream, batch and prompt, printed and recorded."""

import json

import pytest

from benchmarks import batch_files
from cflow.cli import cflowc_main


def test_one_round_prints_and_records(tmp_path, capsys):
    f = tmp_path / "m.vflow"
    assert cflowc_main(["preset:arch1@tiny", "--quant", "q4", "-o", str(f)]) == 0
    out = tmp_path / "b.json"
    recs = batch_files.main([str(f), "--threads", "1", "--rounds", "1", "--batch", "2", "--prompt", "24",
                             "--steps", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "ISA path" in text and "m.vflow" in text and "batch 2" in text
    assert {r["variant"] for r in recs} == {"decode step", "batch 2", "prompt 24"}
    rec = json.loads(out.read_text())["records"]
    assert len(rec) == 3 and all(r["tok_s"] > 0 for r in rec)


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        batch_files.main([str(tmp_path / "none.vflow")])
    assert "no such file" in capsys.readouterr().err
