"""benchmarks/larger_than_ram.py: the cache-policy replay, and a run through its cgroup path (a stand-in
controller directory: the limit is then not enforced, but every file the harness writes and reads is)."""

import json

from benchmarks.larger_than_ram import main, policy_hits
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph


def test_policy_replay_known_cases():
    # three experts in turn through two slots: LRU always evicts the one needed next (no hit), MIN keeps one,
    # half the slots pinned to the most chosen expert hits it every third time
    cyc = [[0, 1], [0, 2], [0, 3]] * 20
    h = policy_hits(cyc, 2)
    assert h["lru"] == 0.0 and h["lfu"] >= 0.0 and h["min"] >= 0.45 and abs(h["lru+pinned"] - 1 / 3) < 0.05
    rep = [[0, 1, 2]] * 10  # two experts that always come back: everything hits once warm
    assert policy_hits(rep, 2) == {"lru": 1.0, "lfu": 1.0, "lru+pinned": 1.0, "min": 1.0}
    assert policy_hits([], 4) == {} and policy_hits(rep, 0) == {}
    blocks = [[0, 5], [1, 5]] * 10  # the same expert id in two blocks is two experts
    assert policy_hits(blocks, 1)["lru"] == 0.0


def test_run_in_a_memory_group(tmp_path):
    vflow = tmp_path / "moe.vflow"
    compile_file(load_graph("preset:arch1@tiny"), vflow, "q4")
    parent = tmp_path / "memory"
    parent.mkdir()
    out = tmp_path / "r.json"
    main(["--vflow", str(vflow), "--budget", "1G", "--engines", "cflow-mmap,cflow-ram", "--tokens", "4",
          "--threads", "1", "--reps", "2", "--json", str(out), "--cgroup-parent", "v1", str(parent)])
    doc = json.loads(out.read_text())
    recs = {r["engine"]: r for r in doc["records"]}
    assert set(recs) == {"cflow-mmap", "cflow-ram"}
    assert recs["cflow-mmap"]["extra"]["tokens"] == recs["cflow-ram"]["extra"]["tokens"]
    assert recs["cflow-mmap"]["extra"]["tokens_equal_to_ram"] == 4 and recs["cflow-mmap"]["tok_s"] > 0
    assert recs["cflow-mmap"]["extra"]["reads"] == "mapped"  # no disk tier: which read mode ran, per engine
    assert "cgroup" in recs["cflow-mmap"]["extra"] and "cgroup" not in recs["cflow-ram"]["extra"]
    (group,) = parent.iterdir()  # one group, for the engine with a budget, its limit written
    assert (group / "memory.limit_in_bytes").read_text() == str(2**30)
    assert doc["extra"]["budget"] == 2**30 and doc["extra"]["disk_gbs_one"] > 0
    assert len(recs["cflow-mmap"]["extra"]["tok_s_runs"]) == 2  # two alternating runs, the median recorded


def test_disk_rate_while_waiting_from_a_trace():
    from types import SimpleNamespace

    from benchmarks.larger_than_ram import disk_while_waiting

    rng = SimpleNamespace(nbytes=4096 * 250)  # one range of 1,024,000 bytes per expert
    tier = SimpleNamespace(layout={(0, e): [("w", 0, rng)] for e in range(3)})
    trace = [("read", 0, 0, 1, 0.0, 0.0, 1.0, 1.1),  # on the disk 0..1 s: half of it inside the wait
             ("read", 0, 1, 1, 0.0, 2.0, 3.0, 3.1),  # 2..3 s: all inside
             ("wait", 0, 0.5, 1.5), ("wait", 0, 2.0, 3.0)]
    r = disk_while_waiting(trace, tier)
    assert r["wait_s_traced"] == 2.0
    assert abs(r["gbs_disk_while_waiting"] - 1.5 * 1024000 / 2.0 / 1e9) < 1e-12
    assert abs(r["wait_share_disk_idle"] - 0.25) < 1e-12  # 1.0..1.5 s of the first wait: nothing on the disk
    assert disk_while_waiting([], tier) == {"wait_s_traced": 0.0}


def test_summary_line(capsys):
    from benchmarks.larger_than_ram import summary

    rec = lambda e, t, toks: {"engine": e, "tok_s": t, "extra": {"tokens": toks}}  # noqa: E731
    summary([rec("cflow", 7.2, [1, 2]), rec("llama", 0.45, [1, 2]), rec("cflow-ram", 30.0, [1, 2])])
    summary([rec("cflow", 1.0, [1, 2]), rec("llama", 2.0, [1, 3])])
    assert capsys.readouterr().out.splitlines() == ["cflow / llama.cpp = 16.00x, tokens identical: yes",
                                                    "cflow / llama.cpp = 0.50x, tokens identical: no"]


def test_read_mode_says_direct_or_buffered():
    from types import SimpleNamespace

    from benchmarks.larger_than_ram import _read_mode

    tier = SimpleNamespace(direct=True)
    assert _read_mode(SimpleNamespace(tier=tier, streamer=None)) == "direct"
    assert _read_mode(SimpleNamespace(tier=tier, streamer=SimpleNamespace(direct=False))) == "buffered"
    assert _read_mode(SimpleNamespace(tier=None, streamer=None)) == "mapped"
