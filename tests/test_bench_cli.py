"""`cflow bench` runs end to end (its numbers are a benchmark: nothing here asserts a speed)."""

import json
import subprocess
import sys


def test_cflow_bench_writes_records(tmp_path):
    out = tmp_path / "m.vflow"
    assert subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch1@tiny", "-o", str(out)]).returncode == 0
    rec = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())",
                        "bench", str(out), "--threads", "1", "--tokens", "4", "--reps", "1", "--json", str(rec)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    header, row = r.stdout.splitlines()[:2]
    assert header.split() == ["threads", "tok/s", "MB/token", "GB/s", "read", "GB/s", "%", "of", "read"]
    assert len(row.split()) == 6 and row.split()[0] == "1"
    d = json.loads(rec.read_text())
    assert d[0]["threads"] == 1 and d[0]["tok_s"] > 0 and d[0]["read_gbps"] > 0
