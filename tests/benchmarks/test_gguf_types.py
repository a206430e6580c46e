"""benchmarks.gguf_types: each block type's mat-vec timed against the read loop, in either loop kind."""

import json

import pytest

from benchmarks import gguf_types


def test_times_both_loop_kinds_and_records_them(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert gguf_types.main(["--types", "Q4_0,IQ4_NL", "--loops", "unit,group", "--set-gb", "0.002", "--rounds", "1",
                            "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Q4_0 unit" in text and "IQ4_NL group" in text
    recs = json.loads(out.read_text())["records"]
    assert {(r["quant"], r["variant"]) for r in recs} == {("Q4_0", "unit loop"), ("Q4_0", "group loop"),
                                                          ("IQ4_NL", "unit loop"), ("IQ4_NL", "group loop")}
    assert all(r["extra"]["over_q4_0"] is not None for r in recs)  # Q4_0's unit loop is the yardstick


@pytest.mark.parametrize("loops", ["fast", "builtin,unit", ""])
def test_refuses_an_unknown_loop_kind(loops):
    with pytest.raises(SystemExit):
        gguf_types.main(["--types", "Q4_0", "--loops", loops])
