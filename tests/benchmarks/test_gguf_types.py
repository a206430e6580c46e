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


def test_times_each_prefetch_distance_and_records_it(tmp_path, capsys):
    """--prefetch-units: each kernel also at that many of its units ahead (whole lines), labelled and recorded."""
    out = tmp_path / "r.json"
    assert gguf_types.main(["--types", "Q4_0,Q6_K", "--prefetch-units", "1,0.25", "--set-gb", "0.002", "--rounds",
                            "1", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Q6_K pf0.25u" in text and "Q4_0 pf1u" in text
    recs = json.loads(out.read_text())["records"]
    assert {(r["quant"], r["variant"]) for r in recs} == {
        (q, f"prefetch {u} units") for q in ("Q4_0", "Q6_K") for u in ("1", "0.25")}
    q6 = {r["variant"]: r["extra"]["knobs"]["prefetch"] for r in recs if r["quant"] == "Q6_K"}
    assert q6 == {"prefetch 1 units": 26880, "prefetch 0.25 units": 6720}  # 128-row tiles: 26,880-byte units


def test_refuses_a_bad_prefetch_distance():
    with pytest.raises(SystemExit):
        gguf_types.main(["--types", "Q4_0", "--prefetch-units", "x"])
