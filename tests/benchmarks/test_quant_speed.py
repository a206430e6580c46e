"""benchmarks/quant_speed.py: one round over a compiled file prints its row and writes a record with the bytes
per token and the read bandwidth of the same run."""

import json

from benchmarks import quant_speed
from cflow.cli import cflowc_main


def test_one_round_prints_and_records(tmp_path, capsys):
    f = tmp_path / "m.vflow"
    assert cflowc_main(["preset:arch1@tiny", "--quant", "q4", "-o", str(f)]) == 0
    out = tmp_path / "speed.json"
    assert quant_speed.main([str(f), "--threads", "1", "--rounds", "1", "--tokens", "4", "--reps", "1",
                             "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "m.vflow" in table and "of read" in table
    rec = json.loads(out.read_text())["records"][0]
    assert rec["engine"] == "cflow" and rec["tok_s"] > 0 and rec["bytes_per_token"] > 0 and rec["read_gbs"] > 0
    assert "profile" not in rec["extra"]  # only with --profile


def test_profile_splits_a_decode_step(tmp_path, capsys):
    """--profile: each kind of stage's ms a token and GB/s, printed and in the record; the kinds' times sum to the
    profiling build's step time."""
    f = tmp_path / "m.vflow"
    assert cflowc_main(["preset:arch1@tiny", "--quant", "q4", "-o", str(f)]) == 0
    out = tmp_path / "speed.json"
    assert quant_speed.main([str(f), "--threads", "1", "--rounds", "1", "--tokens", "4", "--reps", "1",
                             "--profile", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "profile, decode, m.vflow" in text and "GB/s" in text
    assert text.index("profile, decode") < text.index("of read")  # the profiles, then the table whole
    prof = json.loads(out.read_text())["records"][0]["extra"]["profile"]
    assert prof["decode"] and prof["batch"] == 1 and prof["gbps"]
    ms = prof["stages_ms_per_token"]
    assert abs(sum(ms.values()) - 1e3 / prof["tok_s"]) < 1e-6 * 1e3 / prof["tok_s"] + 1e-9
    assert all(k in ms and v > 0 for k, v in prof["gbps"].items())
