"""benchmarks.compare on two small synthetic result files: records paired on (engine, model, quant, isa_path,
threads, variant), repeated records as their median, B / A per pair, the columns every row shares printed once."""

import json
import subprocess

import pytest

from benchmarks import compare
from benchmarks.common import ROOT
from benchmarks.common.record import FIELDS, SCHEMA


def rec(threads, tok_s, engine="cflow", variant=None, bpt=500_000_000, read=20.0, **extra):
    r = dict.fromkeys(FIELDS)
    r.update(engine=engine, model="tinyllama_geometry", quant="q4", isa_path="avx512vnni", threads=threads,
             variant=variant, tok_s=tok_s, bytes_per_token=bpt, read_gbs=read, cpu_model="CPU", command="python -m x",
             commit="abc", date="2025-01-01T00:00:00Z", extra=extra)
    return r


def write(path, records):
    path.write_text(json.dumps({"schema": SCHEMA, "records": records}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    a = write(tmp_path / "a.json", [rec(1, 10.0), rec(2, 16.0), rec(2, 20.0), rec(2, 18.0),  # 2 threads: median 18
                                    rec(1, 8.0, engine="llama.cpp"), rec(1, 5.0, variant="kv-f16", gbps=1.0)])
    b = write(tmp_path / "b.json", [rec(1, 15.0), rec(2, 27.0), rec(1, 4.0, engine="llama.cpp"),
                                    rec(1, 5.0, variant="kv-f16", gbps=3.0), rec(4, 30.0)])
    return a, b


def rows(text):
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| ")]


def test_pairs_medians_and_ratios(files, capsys):
    assert compare.main(list(files)) == 0
    out = capsys.readouterr().out
    assert "same in every row: model tinyllama_geometry, quant q4, ISA path avx512vnni" in out
    head, *body = rows(out)
    assert head == ["engine", "threads", "variant", "tok/s A", "tok/s B", "B/A", "of read A", "of read B"]
    got = {(r[0], r[1], r[2]): r[3:6] for r in body}
    assert got == {("cflow", "1", "-"): ["10.00", "15.00", "1.500"],
                   ("cflow", "2", "-"): ["18.00", "27.00", "1.500"],
                   ("llama.cpp", "1", "-"): ["8.00", "4.00", "0.500"],
                   ("cflow", "1", "kv-f16"): ["5.00", "5.00", "1.000"]}
    # 10 tok/s x 0.5 GB/token = 5 GB/s of a 20 GB/s read bandwidth
    assert next(r for r in body if r[:3] == ["cflow", "1", "-"])[6:] == ["25.0%", "37.5%"]
    assert "only in B: cflow, tinyllama_geometry, q4, avx512vnni, 4" in out
    assert out.startswith(f"A: {files[0]} (abc; 2025-01-01T00:00:00Z; CPU)")


def test_another_metric_from_extra(files):
    a, b = (compare.load_results(f)[0] for f in files)
    body = rows(compare.table(a, b, "extra.gbps"))[1:]
    assert body == [["1.00", "3.00", "3.000", "12.5%", "12.5%"]]  # the one pair that has the figure
    assert "no records" in compare.table(a, b, "extra.nothing")


def test_older_files_compare_with_new_ones(tmp_path, files):
    old = tmp_path / "old.json"
    old.write_text(json.dumps([{"engine": "cflow", "geometry": "tinyllama_geometry", "quant": "q4", "threads": 1,
                                "tok_s": 12.0, "bytes_per_token": 500_000_000, "read_gbps": 20.0,
                                "isa": "avx512vnni"}]))
    a = compare.load_results(str(old))[0]
    b = compare.load_results(files[1])[0]
    assert rows(compare.table(a, b))[1] == ["12.00", "15.00", "1.250", "30.0%", "37.5%"]


def test_usage_errors(files, capsys):
    with pytest.raises(SystemExit):
        compare.main([files[0]])
    assert "two result files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main([*files, "--commits", "HEAD", "HEAD"])
    assert "not both" in capsys.readouterr().err


def _head_has_the_package() -> bool:
    r = subprocess.run(["git", "-C", ROOT, "cat-file", "-e", "HEAD:benchmarks/common/record.py"],
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.skipif(not _head_has_the_package(), reason="not a git checkout whose HEAD has benchmarks.common")
def test_commits_runs_the_benchmark_in_worktrees(tmp_path, capsys):
    """The same commit twice (a checkout of HEAD per side, removed afterwards): the read loop's records pair up."""
    before = subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True, text=True).stdout
    assert compare.main(["--commits", "HEAD", "HEAD", "--metric", "read_gbs", "--save", str(tmp_path), "--",
                         "bandwidth", "--gib", "0.01", "--threads", "1", "--reps", "1", "--max-wait", "0"]) == 0
    out = capsys.readouterr().out
    assert rows(out)[0] == ["read_gbs A", "read_gbs B", "B/A"] and len(rows(out)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bandwidth-A0.json", "bandwidth-B0.json"]
    assert subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True, text=True).stdout == before
