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


def test_overlap_model_counts_guessed_reads():
    """Three segments (layer 1 routes in the first, layer 2 in the second); 1 ms of compute each; a read: 1 ms of
    latency, then 1 ms of transfer alone, shared with the others in flight. Layer 2's read started on a guess
    where layer 1 chose is in flight with layer 1's and is done before layer 2 needs it: 6 ms, against 7 ms when
    the same read starts at layer 2's own choice."""
    from benchmarks.common.overlap import predict

    run = {"segments": [[0, 1, [], [1]], [1, 2, [1], [2]], [2, 3, [2], []]], "segment_s": [1e-3] * 3,
           "host_s_per_token": 0.0, "misses_by_token": [{"1": 1, "2": 1}]}
    rp = {"q": 0.0, "d1": 2e-3, "s": 1e-3, "c": 0.0}
    assert abs(predict(run, rp, "async", io_threads=4) - 7e-3) < 1e-9
    guessed = {**run, "misses_by_token": [{"1": 1, "2": 0}], "guessed_by_token": [{"2": 1}],
               "guessed_used_by_token": [{"2": 1}]}
    assert abs(predict(guessed, rp, "async", io_threads=4) - 6e-3) < 1e-9
    wrong = {**guessed, "misses_by_token": [{"1": 1, "2": 1}], "guessed_used_by_token": [{}]}  # a wrong guess
    assert predict(wrong, rp, "async", io_threads=4) > 7e-3  # its read only slowed layer 1's and 2's
    assert abs(predict(run, rp, "sync", io_threads=4) - 7e-3) < 1e-9  # sync: read at the await, 2 ms each


def test_overlap_probe_on_a_run_with_experts_on_disk(tmp_path):
    """OverlapProbe around a real decode with the experts on disk: one entry per token, reads counted per layer
    as the tier counted them, and the model's prediction of the run (the run's own compute, host time, reads)."""
    import numpy as np

    import cflow
    from benchmarks.common.overlap import OverlapProbe
    from benchmarks.larger_than_ram import overlap_prediction

    vflow = tmp_path / "moe.vflow"
    compile_file(load_graph("preset:arch1@tiny"), vflow, "q4")
    with cflow.load(vflow, threads=1, experts="disk", expert_cache_mb=0.25) as m:
        s = m.session
        logits = s.prefill([5, 17, 3, 99])
        misses0 = sum(s.misses_by_layer().values())
        probe = OverlapProbe(s)
        for _ in range(4):
            logits = s.step(int(np.argmax(logits)))
            probe.token()
        run = probe.result()
        assert len(run["misses_by_token"]) == 4 and len(run["segment_s"]) == len(s.segments)
        assert sum(sum(t.values()) for t in run["misses_by_token"]) == sum(s.misses_by_layer().values()) - misses0
        assert run["trace"]["reads"] > 0 and run["host_s_per_token"] > 0
        r = overlap_prediction(run, s)
    assert r["predicted_tok_s"] > 0 and r["compute_ms_per_token"] > 0 and r["predicted_wait_ms_per_token"] >= 0
    assert set(r["read_params_ms"]) == {"q", "d1", "s", "c"}


def test_read_costs_from_a_trace():
    """One read alone takes 2 ms; three started together take 6 ms each: each other read in flight adds 2 ms
    (fitted with the crowd of 3, not assumed to be 2), and the model's disk reproduces both."""
    from benchmarks.common.overlap import Disk, read_params, trace_summary

    ms = 1e-3
    trace = [("read", 0, 0, 1, 0.0, 0.0, 2 * ms, 2.5 * ms)]
    trace += [("read", 0, e, 1, 10 * ms, 10 * ms, 16 * ms, 16.5 * ms) for e in (1, 2, 3)]
    run = trace_summary(trace, 1)
    assert run["trace"]["reads_alone"] == 1 and abs(run["trace"]["inflight_overlapped"] - 3) < 1e-9
    rp = read_params(run)
    assert abs(rp["d1"] - 2 * ms) < 1e-12 and abs(rp["s"] - 2 * ms) < 1e-12 and abs(rp["c"] - 0.5 * ms) < 1e-12
    disk = Disk({**rp, "q": 0.0, "c": 0.0}, threads=4)
    assert abs(disk.wait([disk.add(0.0)], 0.0) - 2 * ms) < 1e-9
    ids = [disk.add(1.0) for _ in range(3)]
    assert abs(disk.wait(ids, 1.0) - (1.0 + 6 * ms)) < 1e-9


def test_dispatch_time_from_the_reads_that_found_a_thread():
    """Five reads submitted together on four I/O threads: four start after 0.1 ms, the fifth waits for a thread
    (2 ms). The model's q is the 0.1 ms dispatch: its Disk queues the fifth read itself."""
    from benchmarks.common.overlap import read_params, trace_summary

    ms = 1e-3
    trace = [("read", 0, e, 1, 0.0, 0.1 * ms, 1.5 * ms, 2 * ms) for e in range(4)]
    trace.append(("read", 0, 4, 1, 0.0, 2 * ms, 3.5 * ms, 4 * ms))
    tr = trace_summary(trace, 1, io_threads=4)["trace"]
    assert tr["reads_free"] == 4 and abs(tr["queue_ms_free"] - 0.1) < 1e-9 and abs(tr["queue_ms"] - 0.48) < 1e-9
    assert abs(read_params({"trace": tr})["q"] - 0.1 * ms) < 1e-12


def test_read_mode_says_direct_or_buffered():
    from types import SimpleNamespace

    from benchmarks.larger_than_ram import _read_mode

    tier = SimpleNamespace(direct=True)
    assert _read_mode(SimpleNamespace(tier=tier, streamer=None)) == "direct"
    assert _read_mode(SimpleNamespace(tier=tier, streamer=SimpleNamespace(direct=False))) == "buffered"
    assert _read_mode(SimpleNamespace(tier=None, streamer=None)) == "mapped"
