"""Per-host tuning (codegen/tune.py): schedule-only knobs (bit-identical outputs), a deterministic choice,
a per-CPU cache that later loads only read, CFLOW_TUNE=off, the choices in the program, `cflow tune`."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import cflow
from cflow.codegen import attn_tune, tune
from cflow.codegen.target import host_target
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.layout.quant import DType
from cflow.layout.tile import TileLayout

MB = 2**20


@pytest.fixture(autouse=True)
def small_span(monkeypatch):
    """The timed set is the window itself here (the real one is twice the last-level cache: 960 MiB on a 480 MiB
    L3); test_the_timed_set_is_past_the_last_level_cache checks the real rule."""
    monkeypatch.setattr(tune, "stream_span", lambda nbytes: nbytes)


@pytest.fixture(autouse=True)
def no_shipped_family(monkeypatch):
    """A CPU without shipped choices (the search starts from the built-in default on every host); the tests of
    the shipped choices name their family."""
    from cflow.codegen import tune_defaults

    monkeypatch.setattr(tune_defaults, "host_family", lambda: "a-cpu-without-shipped-choices")


@pytest.fixture
def tuning_on(monkeypatch, tmp_path):
    monkeypatch.setenv("CFLOW_TUNE", "on")
    monkeypatch.setenv("CFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


# Decode-only programs for the loads below: the tuned choices reach the mat-vec kernels and the attention core, which
# a prompt block calls too (its mat-mat's tail tokens, here all of a 6-token prompt, go through the same mat-vec);
# a program with the multi-token body is twice the JIT.
DECODE = dict(prefill_block=1)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("tune") / "m.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
    return p


@pytest.mark.parametrize("dtype,gate_up", [("q4", False), ("q4", True), ("q8", False), ("f16", False)])
def test_candidates_are_bit_identical(dtype, gate_up):
    # 64-row tiles: four 16-row groups, so 2 groups per pass still makes two passes; half the 128-row tile's JIT
    L = TileLayout(DType.parse(dtype), 128, 512, (64, 256))
    res = tune.measure(L, gate_up, rounds=1, nbytes=MB)  # raises if any candidate's output differs
    isa = host_target().isa
    assert [r["knobs"] for r in res] == tune.candidates(L, isa) and res[0]["knobs"] == tune.default_for(L, isa)
    if isa == "avx512vnni" and dtype in ("q4", "q8"):  # the 256-bit kernel (and Q4's other unpack) among them
        assert any(r["knobs"]["vector_bits"] == 256 for r in res)
        assert any(r["knobs"]["unpack"] == 1 for r in res) == (dtype == "q4")
    assert all(r["gbps"] > 0 for r in res)


def test_the_timed_set_is_past_the_last_level_cache(monkeypatch):
    from cflow.codegen import target as T

    monkeypatch.undo()  # the real stream_span
    for llc in (0, 32 * MB, 480 * MB, 64 * 2**30):
        monkeypatch.setattr(T, "last_level_cache", lambda cpu=0, llc=llc: ("L3", llc))
        span = tune.stream_span(64 * MB)
        assert span >= 64 * MB and (span >= 2 * llc or span == tune.MAX_SPAN)
    level, size = T.last_level_cache()
    assert (level, size) == ("?", 0) or (level.startswith("L") and size > 0)


def test_timed_calls_cycle_through_windows(monkeypatch):
    """With a set of several windows, successive timed calls read successive windows (each from DRAM, not the
    cache the previous call filled), and every window gives the same numbers (the same tile-row repeated)."""
    monkeypatch.setattr(tune, "stream_span", lambda nbytes: 4 * nbytes)
    L = TileLayout(DType.Q4, 256, 512, (128, 256))
    cands = tune.candidates(L, host_target().isa)[:2]
    bench = tune.Candidates(L, False, cands, host_target(), MB, span=tune.stream_span(MB))
    ws = bench.wset
    assert ws.n_windows == 4 and ws.window_bytes >= MB
    assert bench.weights.ctypes.data % tune.PAGE == 0  # where a loaded file's tensors start
    shifted = tune.Candidates(L, False, cands[:1], host_target(), MB, phase=64)
    assert shifted.weights.ctypes.data % tune.PAGE == 64
    y0, y1 = np.zeros(bench.layout.rows_p, np.float32), np.zeros(shifted.layout.rows_p, np.float32)
    bench.call(0, y0, 0, 1)
    shifted.call(0, y1, 0, 1)
    np.testing.assert_array_equal(y0[:L.tile[0]], y1[:L.tile[0]])
    assert [ws.window_rows(w) for w in range(5)] == [(w % 4 * ws.window, (w % 4 + 1) * ws.window) for w in range(5)]
    ys = [np.zeros(bench.layout.rows_p, np.float32) for _ in range(4)]
    for w in range(4):
        bench.call(0, ys[w], *ws.window_rows(w))
    rows = ws.window * L.tile[0]
    for w in range(1, 4):
        np.testing.assert_array_equal(ys[w][w * rows:(w + 1) * rows], ys[0][:rows])
    res = tune.measure(L, False, cands=cands, rounds=3, nbytes=MB)
    assert len(res) == 2 and all(len(r["samples"]) == 3 for r in res)


def test_choice_needs_a_margin_and_ties_keep_the_earlier():
    k = [dict(tune.DEFAULT, unroll=u) for u in (2, 1, 4, 3)]
    pick = tune.choose
    assert pick([{"knobs": k[0], "gbps": 10.0}, {"knobs": k[1], "gbps": 10.2}]) == k[0]  # +2%: noise
    assert pick([{"knobs": k[0], "gbps": 10.0}, {"knobs": k[1], "gbps": 11.0}, {"knobs": k[2], "gbps": 11.0}]) == k[1]
    assert pick([{"knobs": k[0], "gbps": 10.0}, {"knobs": k[1], "gbps": 11.0}, {"knobs": k[3], "gbps": 12.0}]) == k[3]


def _fake_measure(score):
    def measure(layout, gate_up=False, cands=None, target=None, rounds=5, nbytes=None, check=True, wset=None):
        return [{"knobs": c, "gbps": score(c), "samples": []} for c in cands]
    return measure


def test_search_finds_knobs_that_only_pay_together(monkeypatch):
    """Zen 4's case: the 256-bit kernel is slower with the default prefetch and fastest without it, so one knob
    changed at a time from the default cannot find it; the descent does, in a second pass, and confirms it."""
    def score(c):
        gain = {(0, 256): 1.7, (0, 0): 1.1}.get((c["prefetch"], c["vector_bits"]), 1.0)
        return 10.0 * gain * (0.95 if c["vector_bits"] == 256 and c["prefetch"] else 1.0)

    monkeypatch.setattr(tune, "measure", _fake_measure(score))
    L = TileLayout(DType.Q4, 256, 512, (128, 256))
    monkeypatch.setattr(tune, "WeightSet", lambda *a, **k: None)  # measure is faked: no weights needed
    choice, log = tune.search(L, False, SimpleNamespace(isa="avx512vnni"))  # the space of an AVX-512 VNNI host
    assert choice == {**tune.DEFAULT, "prefetch": 0, "vector_bits": 256}
    assert [r["pass"] for r in log].count(0) >= 2 and max(r["pass"] for r in log) >= 2
    assert set(choice) == set(tune.KNOBS) and tune._valid_choice(choice) == choice


def test_search_descends_from_each_loop_kind(monkeypatch):
    """The AMX Xeon VM's case: the group loop is slower than the unit loop at the unit loop's prefetch distance and
    faster one line further, which no single knob change from the default shows; the descent from the group loop
    finds it, and it beats the default head to head."""
    L = TileLayout(DType.Q4, 256, 512, (128, 256))
    far = L.unit_nbytes + 64
    assert far in tune.space(L, "avx512vnni")["prefetch"]

    def score(c):
        if c["group_loop"]:
            return 15.6 if c["prefetch"] == far else 13.0
        return 14.3 if c["prefetch"] == tune.DEFAULT["prefetch"] else 14.0

    monkeypatch.setattr(tune, "measure", _fake_measure(score))
    choice, log = tune.search(L, False, host_target())
    assert choice == tune._normal({**tune.DEFAULT, "group_loop": 1, "prefetch": far})
    assert {r["seed"] for r in log if r["pass"]} == {0, 1}


def test_search_drift_is_caught_by_the_final_check(monkeypatch):
    """Every pass sees a 'better' neighbour (noise), but head to head the default is as fast: keep the default."""
    calls = []

    def measure(layout, gate_up=False, cands=None, target=None, rounds=5, nbytes=None, check=True, wset=None):
        calls.append(len(cands))
        if len(cands) <= len(tune.SEEDS) + 1:  # the final head-to-head
            return [{"knobs": c, "gbps": 10.0, "samples": []} for c in cands]
        return [{"knobs": c, "gbps": 10.0 + (1.0 if i == 1 else 0.0), "samples": []} for i, c in enumerate(cands)]

    monkeypatch.setattr(tune, "measure", measure)
    L = TileLayout(DType.Q8, 256, 512, (128, 256))
    choice, log = tune.search(L, False, host_target())
    assert choice == tune.default_for(L, host_target().isa) and len(calls) == len(tune.SEEDS) * tune.PASSES + 1
    calls.clear()  # passes=1 (`cflow tune --passes 1`): one pass per seed, and still the head-to-head
    tune.search(TileLayout(DType.Q8, 256, 512, (128, 256)), False, host_target(), passes=1)
    assert len(calls) == len(tune.SEEDS) + 1 and calls[-1] <= len(tune.SEEDS) + 1


def test_neighbours_are_one_knob_away_and_unique():
    L = TileLayout(DType.Q4, 256, 512, (128, 256))
    cur = {**tune.DEFAULT, "prefetch": 0}
    nb = tune.neighbours(cur, L, "avx512vnni")
    assert nb[0] == cur and len({tuple(c[k] for k in tune.KNOBS) for c in nb}) == len(nb)
    for c in nb[1:]:
        changed = [k for k in tune.KNOBS if c[k] != cur[k]]
        assert 1 <= len(changed) <= 3  # one knob, plus the prefetch hint/density reset when prefetch goes to 0
    assert all(c["prefetch_stride"] == 64 and c["prefetch_locality"] == 3 for c in nb if not c["prefetch"])
    assert any(c["prefetch_stride"] == L.unit_nbytes for c in tune.candidates(L, "avx512vnni"))


def test_group_loop_neighbours_have_one_spelling():
    """From a group-loop choice, changing unroll or groups per pass names the same kernel: never a candidate; the
    unit loop is one step back; the label says gloop, not u/g; a cached group_loop other than 0/1 is rejected."""
    L = TileLayout(DType.Q4, 256, 512, (128, 256))
    cur = tune._normal({**tune.DEFAULT, "group_loop": 1, "prefetch": 9216})
    nb = tune.neighbours(cur, L, "avx512vnni")
    assert nb[0] == cur and len({tuple(c[k] for k in tune.KNOBS) for c in nb}) == len(nb)
    assert all(c["unroll"] == tune.DEFAULT["unroll"] and c["max_groups"] == tune.DEFAULT["max_groups"]
               for c in nb if c["group_loop"])
    assert {**cur, "group_loop": 0} in nb
    assert tune.label(cur) == "gloop pf9216 L3" and tune.label({**cur, "unpack": 1}) == "gloop pf9216 L3 shift"
    assert tune._valid_choice(cur) == cur and tune._valid_choice({**cur, "group_loop": 2}) is None


def test_off_means_defaults(monkeypatch, model_file):
    monkeypatch.setenv("CFLOW_TUNE", "off")
    m = cflow.load(model_file, **DECODE)
    assert m.session.tuning == {}


def test_search_once_then_cached(tuning_on, monkeypatch, model_file):
    from cflow.passes.pipeline import plan_from_header
    from cflow.runtime.format import FileReader

    with FileReader(model_file) as r:
        tensors = list(plan_from_header(r.header, r.path).tensors.values())
    target = host_target()
    seen = []
    monkeypatch.setattr(tune, "space", small_space)  # the real pipeline, a tenth of the JIT
    got = tune.choices(tensors, target, search=True, rounds=1, nbytes=MB, passes=1, budget=0.01,
                       on_result=lambda k, rec: seen.append(k))  # the budget: one descent each, then the cache
    shapes = tune.kernel_shapes(tensors)
    assert seen == list(shapes) and len(shapes) >= 2  # every kernel shape measured, gate_up ones included
    assert any(k.endswith(":gate_up") for k in shapes)
    table = tune.read_table(target)
    assert set(table) == set(shapes)
    assert all(table[k]["choice"] == got.get(k, tune.default_for(shapes[k][0], target.isa)) for k in shapes)

    def no_search(*a, **k):
        raise AssertionError("a cached shape was measured again")

    monkeypatch.setattr(tune, "tune_kernel", no_search)
    assert tune.choices(tensors, target) == got  # deterministic given the cache


def test_a_first_search_says_so_once(tuning_on, monkeypatch, model_file):
    # a first load on a new CPU measures for seconds per shape: it must not sit silent; a cached load says nothing
    import warnings

    from cflow.passes.pipeline import plan_from_header
    from cflow.runtime.format import FileReader

    with FileReader(model_file) as r:
        tensors = list(plan_from_header(r.header, r.path).tensors.values())
    monkeypatch.setattr(tune, "tune_kernel", lambda *a, **k: {"choice": dict(tune.DEFAULT), "results": []})
    n = len(tune.kernel_shapes(tensors))
    with pytest.warns(UserWarning, match=f"measuring this CPU's mat-vec kernel variants for {n} kernel shapes "
                                         r"\(about 15 s,"):
        tune.choices(tensors, host_target(), search=True, budget=tune.BUDGET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tune.choices(tensors, host_target(), search=True)


def test_bad_table_is_ignored(tuning_on, monkeypatch):
    target = host_target()
    p = tune._path(target)
    p.parent.mkdir(parents=True)
    p.write_text("{not json")
    assert tune.read_table(target) == {}
    p.write_text(json.dumps({"schema": tune.SCHEMA, "host": "another CPU", "kernels": {"x": {}}}))
    assert tune.read_table(target) == {}
    assert tune._valid_choice({**tune.DEFAULT, "unroll": 10**9}) is None
    assert tune._valid_choice({**tune.DEFAULT, "prefetch": True}) is None


def test_a_tuned_program_gives_the_same_numbers(tuning_on, monkeypatch, model_file):
    """A non-default choice in the cache reaches the emitted kernels (other program) and changes no number."""
    ids = [5, 17, 3, 99, 1, 2]
    monkeypatch.setenv("CFLOW_TUNE", "off")
    ref = cflow.load(model_file, **DECODE)
    ref_logits = ref.session.prefill(ids)
    ref_toks = ref.generate(ids, max_new_tokens=6, stop=False)
    monkeypatch.setenv("CFLOW_TUNE", "on")
    from cflow.passes.pipeline import plan_from_header
    from cflow.runtime.format import FileReader

    with FileReader(model_file) as r:
        shapes = tune.kernel_shapes(plan_from_header(r.header, r.path).tensors.values())
    target = host_target()
    odd = {"unroll": 1, "prefetch": 4096, "prefetch_locality": 2, "prefetch_stride": 1024, "max_groups": 4,
           "vector_bits": 256, "unpack": 1, "group_loop": 0}
    from cflow.codegen import attn_tune

    attn = {attn_tune.attention_key(*g, ref.session.kv_dtype): {"choice": {"kv_prefetch": attn_tune.KV_PREFETCH}}
            for g in attn_tune.geometries(ref.session.compiled.graph.nodes())}  # cached: no attention search
    for choice in (odd, {**tune.DEFAULT, "prefetch": 4096, "group_loop": 1}):
        tune._write_table(target, {**{k: {"choice": choice} for k in shapes}, **attn})
        m = cflow.load(model_file, **DECODE)
        assert m.session.tuning == {k: choice for k in shapes}
        ir_text = m.session.program.module if isinstance(m.session.program.module, str) else str(
            m.session.program.module)
        ref_ir = ref.session.program.module if isinstance(ref.session.program.module, str) else str(
            ref.session.program.module)
        assert ir_text != ref_ir and "llvm.prefetch" in ref_ir
        np.testing.assert_array_equal(m.session.prefill(ids), ref_logits)
        assert m.generate(ids, max_new_tokens=6, stop=False) == ref_toks


_real_space = tune.space


def small_space(L, isa=None):
    """The search's space cut to two prefetch distances and both loop kinds: the JIT of ~20 candidates per shape is
    most of a search's time (test_candidates_are_bit_identical compiles the whole space)."""
    return {**{k: v[:1] for k, v in _real_space(L, isa).items()}, "prefetch": (0, L.unit_nbytes),
            "group_loop": (0, 1)}


def test_cli_tune(tuning_on, model_file, capsys):
    # the timed sets of both searches cut to one window (as small_span does in this process)
    # and the space cut (small_space)
    cmd = [sys.executable, "-c", "import sys; from cflow.codegen import tune; tune.stream_span = lambda n: n; "
           "from tests.codegen.test_tune import small_space; tune.space = small_space; "
           "from cflow.cli import cflow_main; sys.exit(cflow_main(sys.argv[1:]))",
           "tune", str(model_file), "--mb", "1", "--rounds", "1", "--passes", "1", "--budget", "1",
           "--json", str(tuning_on / "t.json")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "<- chosen" in r.stdout and "gate_up" in r.stdout and "GB/s" in r.stdout
    assert "kv_prefetch" in r.stdout and "attn:" in r.stdout  # the attention core's table too
    rec = json.loads((tuning_on / "t.json").read_text())
    assert rec["kernels"] and all("choice" in v for v in rec["kernels"].values())
    assert any(k.startswith("attn:") for k in rec["kernels"])
    assert "1 s for the model's searches" in r.stdout and " s)" in r.stdout  # the budget, each shape's time
    from cflow.cli import cflow_main

    for bad in ("--rounds", "--passes", "--budget"):
        with pytest.raises(SystemExit) as e:
            cflow_main(["tune", str(model_file), bad, "-1"])
        assert e.value.code == 1 and bad in capsys.readouterr().err


# --- the attention core's prefetch distance (codegen/attn_tune.py) --------------------------------------------
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16"])
def test_attention_prefetch_distances_are_bit_identical(kv):
    from cflow.codegen import attn_tune

    res = attn_tune.measure((4, 2, 16), kv, host_target(), rounds=1)  # raises if any distance's output differs
    assert [r["knobs"]["kv_prefetch"] for r in res] == list(attn_tune.DISTANCES)
    assert all(r["gbps"] > 0 for r in res)


def test_attention_choice_is_cached_reaches_the_program_and_keeps_the_numbers(tuning_on, monkeypatch, model_file):
    from cflow.codegen import attention, attn_tune

    ids = [5, 17, 3, 99, 1, 2]
    monkeypatch.setenv("CFLOW_TUNE", "off")
    ref = cflow.load(model_file, kv="f16", **DECODE)
    ref_logits = ref.session.prefill(ids)
    monkeypatch.setenv("CFLOW_TUNE", "on")
    geoms = attn_tune.geometries(ref.session.compiled.graph.nodes())
    assert len(geoms) == 1
    key = attn_tune.attention_key(*next(iter(geoms)), "f16")
    target = host_target()
    # the mat-vec shapes at their defaults (no search), the attention core with no prefetch
    from cflow.passes.pipeline import plan_from_header
    from cflow.runtime.format import FileReader

    with FileReader(model_file) as r:
        shapes = tune.kernel_shapes(plan_from_header(r.header, r.path).tensors.values())
    table = {k: {"choice": tune.default_for(shapes[k][0], target.isa)} for k in shapes}
    tune._write_table(target, {**table, key: {"choice": {"kv_prefetch": 0}}})
    m = cflow.load(model_file, kv="f16", **DECODE)
    assert m.session.tuning == {key: {"kv_prefetch": 0}}
    assert "pf0" in str(m.session.program.module) and f"pf{attention.KV_PREFETCH}" in str(ref.session.program.module)
    np.testing.assert_array_equal(m.session.prefill(ids), ref_logits)
    # a bad record is measured again, not used
    tune._write_table(target, {**table, key: {"choice": {"kv_prefetch": -5}}})
    seen = []
    got = attn_tune.choices(geoms, "f16", target, search=True, rounds=1, on_result=lambda k, rec: seen.append(rec))
    assert seen and seen[0]["choice"]["kv_prefetch"] in attn_tune.DISTANCES
    assert tune.read_table(target)[key]["choice"] == seen[0]["choice"]
    assert got == ({} if seen[0]["choice"]["kv_prefetch"] == attention.KV_PREFETCH else {key: seen[0]["choice"]})
    monkeypatch.setenv("CFLOW_TUNE", "off")
    assert attn_tune.choices(geoms, "f16", target) == {}


def test_attention_timed_set_is_past_the_last_level_cache_and_bounded_per_call(monkeypatch):
    from cflow.codegen import attn_tune
    from cflow.codegen import target as T

    monkeypatch.undo()  # the real stream_span
    for llc in (32 * MB, 480 * MB):
        monkeypatch.setattr(T, "last_level_cache", lambda cpu=0, llc=llc: ("L3", llc))
        for geom in ((32, 4, 64), (32, 32, 128), (4, 1, 16)):
            for kv in ("f16", "f32"):
                cache, layers, calls = attn_tune.timed_set(geom, kv)
                assert 1 <= layers <= attn_tune.LAYERS and calls >= 2
                assert layers * cache <= max(cache, 2 * tune.MIN_BYTES)  # a large model's call: one layer
                assert layers * calls * cache >= 2 * llc  # a slot has left the cache before it is read again
    assert attn_tune.timed_set((32, 32, 128), "f16")[1] == 1 and attn_tune.timed_set((32, 4, 64), "f16")[1] == 16


def test_attention_prefetch_knob_reaches_the_code():
    from llvmlite import ir

    from cflow.codegen import attention
    from cflow.ir import Attention

    n = Attention(name="a", inputs=("x",), prefix="p", dim=64, n_heads=4, n_kv_heads=2, head_dim=16,
                  rope_theta=1e4)
    for kv in ("f32", "f16", "bf16"):
        texts = {}
        for d in (0, 4096):
            m = ir.Module()
            attention.attention(m, n, (0, 64, 96), host_target().isa, kv, 64, "", d)
            texts[d] = str(m)
        assert "llvm.prefetch" not in texts[0] and "llvm.prefetch" in texts[4096]
        assert "4096" in texts[4096]


def test_attention_bad_records_are_ignored():
    from cflow.codegen import attn_tune

    for bad in ({"kv_prefetch": True}, {"kv_prefetch": 1.5}, {"kv_prefetch": "4096"}, {"kv_prefetch": -64},
                {"kv_prefetch": 100}, {"kv_prefetch": 4096, "x": 1}, [], None, "4096"):
        assert attn_tune._valid(bad) is None
    assert attn_tune._valid({"kv_prefetch": 0}) == {"kv_prefetch": 0}


def test_a_search_holds_the_table_lock_and_keeps_other_records(tuning_on):
    """Two processes loading at once: the second waits for the first's search and then finds its records (timing
    both on the same cores would mislead both), and one's write never drops the other's records."""
    import fcntl
    import os

    target = host_target()
    lock = tune._path(target).with_suffix(".lock")
    held = []

    def measure(arg, deadline):
        fd = os.open(lock, os.O_RDWR)
        try:  # another open file description must not get the lock while this search runs
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        # meanwhile another process stored its own record
        tune._write_table(target, {**tune.read_table(target), "other": {"choice": {"x": arg}}})
        return {"choice": {"v": arg}}

    got = tune.cached_choices(target, {"a": 1}, valid=lambda c: c if isinstance(c, dict) else None,
                              default={}, measure=measure, what=str, on_result=lambda k, r: None, search=True)
    assert got == {"a": {"v": 1}} and held == [True]
    table = tune.read_table(target)
    assert set(table) == {"a", "other"}


def test_records_written_while_waiting_are_not_measured_again(tuning_on, monkeypatch):
    target = host_target()
    reads = []
    real = tune.read_table

    def read_table(t):  # the first read finds nothing; by the time the lock is held another process wrote "a"
        reads.append(1)
        if len(reads) == 2:
            tune._write_table(t, {"a": {"choice": {"v": 7}}})
        return real(t) if len(reads) > 1 else {}

    monkeypatch.setattr(tune, "read_table", read_table)

    def measure(arg, deadline):
        raise AssertionError("measured although another process had just stored the record")

    got = tune.cached_choices(target, {"a": 1}, valid=lambda c: c if isinstance(c, dict) else None,
                              default={}, measure=measure, what=str, on_result=lambda k, r: None, search=True)
    assert got == {"a": {"v": 7}} and len(reads) == 2


def test_a_file_system_without_locks_still_searches(tuning_on, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    got = tune.cached_choices(host_target(), {"a": 1}, valid=lambda c: c if isinstance(c, dict) else None,
                              default={}, measure=lambda arg, deadline: {"choice": {"v": arg}}, what=str,
                              on_result=lambda k, r: None, search=True)
    assert got == {"a": {"v": 1}} and tune.read_table(host_target())["a"]["choice"] == {"v": 1}


# --- first use: shipped choices, no search at load, the budget --------------------------------------
def test_shipped_families_are_valid_choices_for_every_tile(monkeypatch):
    """Every shipped entry resolves to a valid, normalised choice inside the search's space for Q4 and Q8 at
    several tile shapes, and its symbolic prefetch lands where the measured tables had it (docs/results)."""

    from cflow.codegen import tune_defaults as D
    from cflow.layout.tile import TileLayout

    assert D.Pf(1, 1).nbytes(2304) == 2368 and D.Pf(D.Fraction(1, 4)).nbytes(4352) == 1088
    assert D.Pf(4).nbytes(2304) == 9216 and D.Pf(2).nbytes(4352) == 8704
    for fam_name, fam in D.FAMILIES.items():
        assert fam.isa in ("avx512vnni", "avxvnni", "avx2", "generic") and fam.source
        for name, knobs in fam.kernels.items():
            assert set(knobs) == set(tune.KNOBS), name
        for kv, d in fam.attention.items():
            assert attn_tune._valid({"kv_prefetch": d}), kv
        target = SimpleNamespace(isa=fam.isa)
        monkeypatch.setattr(D, "host_family", lambda name=fam_name: name)
        monkeypatch.setattr(D, "host_cpu", lambda f=fam: f.cpus[0] if f.cpus else "any")
        for dt in ("q4", "q8"):
            for tile in ((128, 256), (64, 512)):
                L = TileLayout(dt, 256, 2048, tile)
                for gu in (False, True):
                    c = tune._shipped(L, gu, target)
                    if c is None:  # not measured for this dtype: the built-in default
                        assert fam.kernels.get(dt) is None
                        continue
                    assert tune._valid_choice(c) == c and tune._normal(c) == c, (fam_name, dt, tile, gu)
                    sp = tune.space(L, fam.isa)  # inside the search's space: `cflow tune` can move from it
                    assert all(c[k] in sp[k] for k in sp), (fam_name, dt, tile, gu, c)


def test_shipped_choice_applies_on_its_own_family_and_its_isa_knobs_on_its_path(monkeypatch):

    from cflow.codegen import tune_defaults as D
    from cflow.layout.tile import TileLayout

    L = TileLayout("q4", 256, 2048, (128, 256))
    monkeypatch.setattr(D, "host_family", lambda: "intel-amx")
    monkeypatch.setattr(D, "host_cpu", lambda: "rocketlake")  # the masked VM measured
    vnni, avx2 = SimpleNamespace(isa="avx512vnni"), SimpleNamespace(isa="avx2")
    assert tune.start_for(L, False, vnni) == {**tune.DEFAULT, "group_loop": 1, "prefetch": 2368}
    # a forced path: the same loop and distance (the memory system's), the path's own dot and unpack
    assert tune.start_for(L, False, avx2) == {**tune.DEFAULT, "group_loop": 1, "prefetch": 2368}
    monkeypatch.setattr(D, "host_family", lambda: "znver4")
    assert tune.start_for(L, False, vnni)["vector_bits"] == 256 and tune.start_for(L, False, avx2)["vector_bits"] == 0
    monkeypatch.setattr(D, "host_family", lambda: "intel-amx")
    monkeypatch.setattr(D, "host_cpu", lambda: "rocketlake")  # the masked VM measured
    assert D.attention_choice("f16") == 1024 and D.attention_choice("f32") is None
    monkeypatch.setattr(D, "host_family", lambda: "some-future-cpu")
    assert tune.start_for(L, False, vnni) == tune.default_for(L, "avx512vnni")
    # another AMX core than the one the family was measured on: the built-ins (model 207 decodes faster with them)
    monkeypatch.setattr(D, "host_family", lambda: "intel-amx")
    monkeypatch.setattr(D, "host_cpu", lambda: "emeraldrapids")
    assert D.shipped_family() is None and D.attention_choice("f16") is None
    assert tune.start_for(L, False, vnni) == tune.default_for(L, "avx512vnni")
    assert tune.start_for(L, False, avx2) == tune.default_for(L, "avx2")
    # a GGUF block type keeps its built-in prefetch (one whole block ahead) and its path's built-in loop kind
    monkeypatch.setattr(D, "host_family", lambda: "intel-amx")
    monkeypatch.setattr(D, "host_cpu", lambda: "rocketlake")  # the masked VM measured
    LK = TileLayout("q4_k", 256, 2048, (128, 256))
    assert tune.start_for(LK, False, vnni) == tune.default_for(LK, "avx512vnni")
    LK5 = TileLayout("q5_k", 256, 2048, (128, 256))
    assert tune.start_for(LK5, False, vnni)["group_loop"] == 0 and tune.start_for(LK5, False, avx2)["group_loop"] == 1


def test_the_built_in_loop_kind_per_isa_path():
    """The group loop (and for some types the L2 prefetch) is the built-in for the block types BUILTIN_KNOBS names
    per path (measured there; none on AVX-512), the unit loop for everything else; default_for, the search's first
    candidate and the kernel's own default agree."""
    from cflow.codegen import kernels as K
    from cflow.layout.tile import TileLayout

    cases = {("q4", "avx2"): (0, 3), ("q4_k", "avx2"): (1, 2), ("q4_k", "avxvnni"): (1, 2), ("q3_k", "avx2"): (1, 3),
             ("q6_k", "avx512vnni"): (0, 3), ("q5_k", "avx512vnni"): (0, 3), ("iq4_192", "avx2"): (1, 2),
             ("iq4_192", "avxvnni"): (0, 3),
             ("iq4_128", "avx2"): (0, 3), ("q3_128", "avxvnni"): (1, 3), ("iq4_nl", "avx2"): (0, 3),
             ("q4_k", "generic"): (0, 3)}
    for (dt, isa), (gl, loc) in cases.items():
        wide = dt.endswith("192")
        L = TileLayout(dt, 256, 1920 if wide else 2048, (128, 192 if wide else 256))
        d = tune.default_for(L, isa)
        assert (d["group_loop"], d["prefetch_locality"]) == (gl, loc), (dt, isa)
        assert {**{"group_loop": 0, "prefetch_locality": 3}, **K.builtin_knobs(L, isa)} == {
            "group_loop": gl, "prefetch_locality": loc}
        assert tune.candidates(L, isa)[0] == d
    # Q4 / Q8 two units ahead on the 256-bit paths (BUILTIN_KNOBS' prefetch_units), one Q4 unit (2,304 B) elsewhere
    for dt, unit in (("q4", 2304), ("q8", 4352)):
        L = TileLayout(dt, 256, 2048, (128, 256))
        assert L.unit_nbytes == unit
        for isa, want in (("avx2", 2 * unit), ("avxvnni", 2 * unit), ("avx512vnni", 2304), ("generic", 2304)):
            assert tune.default_for(L, isa)["prefetch"] == want == K.default_prefetch(L, isa), (dt, isa)
    # a fused gate+up kernel's own built-ins where they differ (kernels.BUILTIN_GATE_UP_KNOBS): on AVX-512 Q5_K and
    # Q3_K take the group loop with the L2 prefetch there, their plain kernels the unit loop
    for dt, isa, gl, loc in (("q5_k", "avx512vnni", 1, 2), ("q3_k", "avx512vnni", 1, 2), ("q4_k", "avx512vnni", 0, 3),
                             ("q5_k", "avx2", 1, 2), ("q3_k", "avx2", 1, 3)):
        L = TileLayout(dt, 256, 2048, (128, 256))
        d = tune.default_for(L, isa, gate_up=True)
        assert (d["group_loop"], d["prefetch_locality"]) == (gl, loc), (dt, isa)
        assert d["prefetch"] == K.default_prefetch(L, isa, gate_up=True)
        assert {**{"group_loop": 0, "prefetch_locality": 3}, **K.builtin_knobs(L, isa, gate_up=True)} == {
            "group_loop": gl, "prefetch_locality": loc}
    assert tune.default_for(TileLayout("q5_k", 256, 2048, (128, 256)), "avx512vnni")["group_loop"] == 0
    # Q5_K / Q6_K a quarter unit ahead on the 256-bit paths, in whole lines (a 64-row tile's quarter is not one);
    # one unit on AVX-512 and for Q4_K everywhere
    for dt, rows, quarter in (("q5_k", 128, 5632), ("q6_k", 128, 6720), ("q6_k", 64, 3328), ("q4_k", 128, None)):
        L = TileLayout(dt, 256, 2048, (rows, 256))
        for isa in ("avx2", "avxvnni", "avx512vnni"):
            want = quarter if quarter and isa != "avx512vnni" else L.unit_nbytes
            assert tune.default_for(L, isa)["prefetch"] == want == K.default_prefetch(L, isa), (dt, rows, isa)


def test_a_load_never_searches_and_takes_the_shipped_choice(tuning_on, monkeypatch, model_file):
    """First use: no search at load (it took seconds per shape); the shipped choice for this host's family is in
    the program, the cache stays empty, and nothing is printed. CFLOW_TUNE=search brings the search back."""
    import warnings

    from cflow.codegen import tune_defaults as D

    def no_search(*a, **k):
        raise AssertionError("a load searched")

    monkeypatch.setattr(tune, "tune_kernel", no_search)
    monkeypatch.setattr(attn_tune, "tune_attention", no_search)
    monkeypatch.setattr(D, "host_family", lambda: "intel-amx")
    monkeypatch.setattr(D, "host_cpu", lambda: "rocketlake")  # the masked VM measured
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = cflow.load(model_file, kv="f16", **DECODE)
    assert m.session.tuning and all(
        c.get("group_loop") == 1 or c == {"kv_prefetch": 1024} for c in m.session.tuning.values())
    assert tune.read_table(m.session.target) == {}
    monkeypatch.setenv("CFLOW_TUNE", "search")
    searched = []
    monkeypatch.setattr(tune, "tune_kernel", lambda *a, **k: searched.append(k["deadline"]) or {
        "choice": dict(tune.DEFAULT), "results": []})
    monkeypatch.setattr(attn_tune, "tune_attention", lambda *a, **k: {"choice": {"kv_prefetch": 0}, "results": []})
    with pytest.warns(UserWarning, match=r"kernel shapes \(about 12 s"):  # the budget less start-up and attention
        cflow.load(model_file, kv="f16", **DECODE)
    assert searched and all(d is not None for d in searched)


def test_the_budget_is_shared_and_stops_passes(tuning_on, monkeypatch):
    """Each shape's deadline is an equal share of what is left; a descent starts no pass after it, but the
    head to head of the start and a moved descent still runs."""
    from cflow.layout.tile import TileLayout

    L = TileLayout("q4", 128, 256, (128, 256))
    calls = []

    def fake_measure(layout, gate_up, cands, target, rounds, wset):
        calls.append(len(cands))
        return [{"knobs": c, "gbps": 1.0 + 0.1 * (i == 1), "samples": []} for i, c in enumerate(cands)]

    monkeypatch.setattr(tune, "measure", fake_measure)
    monkeypatch.setattr(tune, "WeightSet", lambda *a, **k: None)
    choice, log = tune.search(L, False, SimpleNamespace(isa="avx512vnni"), passes=3, deadline=0.0)  # long past
    assert calls == [1 + tune.CHUNK, 2]  # the first chunk of pass 1, then the head to head (it moved)
    assert {r["pass"] for r in log} == {1, 0}
    calls.clear()
    tune.search(L, False, SimpleNamespace(isa="avx512vnni"), passes=3, deadline=None)
    assert len(calls) == 3 * 2 + 1  # two descents of three passes each, then the head to head
    deadlines = []
    keys = {"a": 1, "b": 2, "c": 3}
    t0 = __import__("time").perf_counter()
    tune.cached_choices(host_target(), keys, tune._valid_choice, tune.DEFAULT,
                        lambda arg, deadline: deadlines.append(deadline) or {"choice": dict(tune.DEFAULT)},
                        lambda n: "x", search=True, on_result=lambda k, r: None, budget=30.0)
    shares = [d - t0 for d in deadlines]
    assert 9.0 < shares[0] <= 10.5 and shares[0] < shares[1] < shares[2] <= 30.5
