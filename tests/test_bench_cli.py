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
    header, row, blank, *legend = r.stdout.splitlines()
    assert header.split() == ["threads", "tok/s", "MB/token", "GB/s", "read", "GB/s", "%", "of", "read"]
    assert len(row.split()) == 6 and row.split()[0] == "1" and blank == ""
    # every column explained under the table, with this run's settings
    for column in ("threads:", "tok/s:", "MB/token:", "GB/s:", "read GB/s:", "% of read:"):
        assert any(column in line for line in legend), (column, legend)
    assert "the best of 1 run of 4 tokens" in r.stdout
    # arch1@tiny streams 1 MB per token: cache-resident wherever the kernel reports the last-level cache
    from cflow.codegen.target import last_level_cache

    assert ("note: the 1.0 MB of weights" in r.stdout) == (last_level_cache()[1] >= 1_000_000)
    d = json.loads(rec.read_text())
    assert d[0]["threads"] == 1 and d[0]["tok_s"] > 0 and d[0]["read_gbps"] > 0


def test_bench_explains_a_fraction_above_the_read_bandwidth():
    from cflow.cli.bench import cache_note

    fits = cache_note(28_410_000, 1.44, ("L3", 32 << 20))  # the 114m preset on a 32 MiB L3
    assert fits.startswith("note: the 28.4 MB of weights each step reads fit in this CPU's L3 cache (32 MiB)")
    assert "not DRAM" in fits and "can exceed 100" in fits
    partly = cache_note(106_360_000, 1.15, ("L3", 480 << 20 >> 3))  # larger than the L3, above 100% all the same
    assert partly.startswith("note: above 100% of read") and "L3 cache (60 MiB)" in partly
    assert "the caches" in cache_note(600_000_000, 1.2, ("?", 0))  # no cache size exposed
    assert cache_note(582_000_000, 0.85, ("L3", 32 << 20)) is None  # streams from DRAM: nothing to explain
    assert cache_note(582_000_000, 0.85, ("?", 0)) is None
