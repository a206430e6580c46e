"""The disk expert tier: experts read on demand (O_DIRECT, checksummed) give exactly the all-in-RAM logits."""

import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

import cflow
from cflow.compiler import compile_file
from cflow.errors import CflowError, RuntimeFault
from cflow.frontend.load import load_graph
from cflow.runtime.experts import ExpertReadError
from cflow.runtime.format import FileReader
from cflow.runtime.native_step import NativeStep

IDS = [5, 17, 3, 99, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tier")
    out = {}
    for name in ("arch1", "arch4_async_experts", "arch5_shared"):
        out[name] = d / f"{name}.vflow"
        compile_file(load_graph(f"preset:{name}@tiny"), out[name], "q4")
    for de in (0, 1, 2, 3):  # arch2_4_combined's geometry at every expert delay (random weights)
        out[f"de{de}"] = d / f"de{de}.cflow"
        with warnings.catch_warnings():  # de != 2 rewrites the trained model: it warns, and that is fine here
            warnings.simplefilter("ignore")
            compile_file(load_graph("preset:arch2_4_combined@tiny"), out[f"de{de}"], "q4", delays=(1, de))
    return out


def _greedy(m, n=12):
    return m.generate(IDS, max_new_tokens=n, stop=False)


@pytest.mark.parametrize("key", ["arch1", "arch4_async_experts", "arch5_shared", "de0", "de1", "de2", "de3"])
def test_disk_tier_equals_ram(files, key):
    # the RAM reference decode-only, as the disk tier runs (its segmented program has no multi-token body): a
    # program with it would be twice the JIT for each delay's schedule (tests/runtime/test_prefill.py compares the
    # bodies bit for bit)
    with cflow.load(files[key], threads=2, prefill_block=1) as ram:
        want_logits = ram.logits(IDS).copy()
        want = _greedy(ram)
    for io in ("async", "sync"):
        with cflow.load(files[key], threads=2, experts="disk", expert_cache_mb=0.5, expert_io=io) as m:
            assert np.array_equal(m.logits(IDS), want_logits), io  # bit-identical: same kernels, same bytes
            assert _greedy(m) == want
            st = m.expert_stats
            assert st.misses > 0 and st.bytes_read > 0 and 0.0 <= st.hit_rate < 1.0


def test_untied_embedding_stays_mapped_on_disk_tiers(files):
    """With the experts on disk the dense weights are read into RAM, but an untied embedding stays mapped: a step
    reads one row of it per token, so the memory estimate counts the rows a context can touch, not the table."""
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5) as m:
        s = m.session
        assert s.lookup_tensors == {"tok_embeddings"}
        emb = s._tensor("tok_embeddings")
        assert not emb.flags.owndata  # a view of the file's mapping, not a copy
        parts = s.memory_parts()
        rows = parts["the embedding rows a context reads (mapped)"]
        t = s.compiled.tensors["tok_embeddings"]
        assert 0 < rows <= t.nbytes
        dense = next(v for k, v in parts.items() if k.startswith("the non-expert weights"))
        assert dense == sum(x.nbytes for n, x in s.compiled.tensors.items() if x.expert < 0 and n != "tok_embeddings")


def test_one_thread_and_small_cache_evicts(files):
    with cflow.load(files["de2"], threads=1) as ram:
        want = _greedy(ram, 24)
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.35) as m:
        assert _greedy(m, 24) == want
        st = m.expert_stats
        n_slots = len(m.session.tier.slots)
        assert st.misses > n_slots  # more distinct reads than slots: the LRU evicted and read again
        rss_budget = n_slots * m.session.tier.slot_bytes
        assert rss_budget <= 0.35 * 2**20


@pytest.mark.parametrize("key", ["de2", "arch5_shared"])
def test_adjacent_ranges_read_as_one_request(files, monkeypatch, key):
    """Ranges that follow each other in the file are read by one preadv scattering into their slots (O_DIRECT:
    every piece aligned), the same bytes as read one range at a time: an expert's own ranges ("expert", the
    default), or also those of other experts the layer misses ("layer"). A .cflow file keeps an expert's ranges
    together and its experts in order (three experts: one request each, or one in all), a .vflow file a layer's
    gate_up matrices together and its down matrices together (two requests in all, else one per range)."""
    calls = []
    real = os.preadv

    def counting(fd, bufs, offset, *a):
        calls.append(len(bufs))
        return real(fd, bufs, offset, *a)

    with cflow.load(files[key], threads=1, experts="disk", expert_cache_mb=2) as m:
        tier = m.session.tier
        assert tier.direct
        monkeypatch.setattr(os, "preadv", counting)
        raw = files[key].read_bytes()
        requests = {"off": 6, "expert": 3 if key == "de2" else 6, "layer": 1 if key == "de2" else 2}
        for coalesce, n in requests.items():
            tier.coalesce = coalesce
            calls.clear()
            tier.issue(0, [0, 1, 2])
            tier.wait(0, [0, 1, 2])
            ranges = sum(len(tier.layout[(0, e)]) for e in (0, 1, 2))
            assert sum(calls) == ranges  # every range read once
            assert ranges == 6 and len(calls) == n, (coalesce, calls)
            for e in (0, 1, 2):
                buf = tier.slots[tier.where[(0, e)]].buf
                for _, off, r in tier.layout[(0, e)]:
                    assert buf[off : off + r.nbytes].tobytes() == raw[r.file_offset : r.file_offset + r.nbytes]
            tier.release(0, [0, 1, 2])
            for e in (0, 1, 2):  # dropped: the next round reads them again
                tier._forget((0, e))
    with cflow.load(files[key], threads=1) as ram:
        want = _greedy(ram)
    with cflow.load(files[key], threads=1, experts="disk", expert_cache_mb=2) as m:
        assert _greedy(m) == want


def test_budget_below_one_window_is_refused(files, tmp_path):
    with pytest.raises(CflowError, match="decoding needs .* at once"):
        cflow.load(files["de2"], experts="disk", expert_cache_mb=0.01)
    import torch

    from cflow.frontend import from_torch
    from cflow.models import PipelineNativeLM, get_preset

    torch.manual_seed(0)
    dense = tmp_path / "dense.vflow"
    cfg = get_preset("arch1", "tiny").evolve(n_experts=0, top_k=0, expert_dim=0, expert_delay=0)
    compile_file(from_torch(PipelineNativeLM(cfg).eval()), dense, "q4")
    with pytest.raises(CflowError, match="no experts"):
        cflow.load(dense, experts="disk")


def _fail_at(n: int):
    """A fail_hook (expert tier or weight streamer) whose n-th read raises an I/O error."""
    calls = 0

    def fail(*_):
        nonlocal calls
        calls += 1
        if calls == n:
            raise OSError(5, "Input/output error")

    return fail


def test_injected_read_failure_then_usable(files):
    with cflow.load(files["de2"], threads=2) as ram:
        want = _greedy(ram)
    with cflow.load(files["de2"], threads=2, experts="disk", expert_cache_mb=0.5) as m:
        m.session.tier.fail_hook = _fail_at(3)
        with pytest.raises(RuntimeFault, match=r"de2.cflow: layer \d+ \(weight block \d+\) expert \d+ \(blocks\.\d+\."
                                               r"moe\.experts\.\d+\.\w+\) at file offset 0x[0-9a-f]+: read failed"):
            _greedy(m)
        m.session.tier.fail_hook = None
        assert _greedy(m) == want  # a new request works and gives the same tokens


def test_read_error_names_the_executed_layer_of_a_shared_block(files):
    """arch5_shared runs each weight block more than once: the error names the layer that chose the expert and
    the block it read."""
    with cflow.load(files["arch5_shared"], threads=1, experts="disk", expert_cache_mb=0.5) as m:
        cfg = m.session.config
        assert cfg.n_blocks < cfg.n_layers

        def fail(key, k):
            raise OSError(5, "Input/output error")

        m.session.tier.fail_hook = fail
        with pytest.raises(ExpertReadError) as e:
            m.logits(IDS)
        got = re.search(r"layer (\d+) \(weight block (\d+), also run as layers? ([\d, ]+)\) expert \d+", str(e.value))
        assert got, str(e.value)
        layer, block = int(got[1]), int(got[2])
        assert cfg.block_of(layer) == block
        assert all(cfg.block_of(int(x)) == block for x in got[3].split(", "))


def test_corrupted_expert_tile_is_caught_before_use(files, tmp_path):
    bad = tmp_path / "bad.cflow"
    shutil.copy(files["de2"], bad)
    with FileReader(bad) as r:
        offsets = [r.entry(t.name).file_offset + 100 for t in r.tensors if t.expert >= 0 and t.layer == 0]
    with open(bad, "r+b") as f:  # every expert of block 0: whatever the router picks is corrupt
        for off in offsets:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
    with cflow.load(bad, experts="disk", expert_cache_mb=0.5) as m:  # structure is fine: loads
        with pytest.raises(ExpertReadError, match=r"layer 1 \(weight block 0\) expert \d+ .*checksum mismatch"):
            m.logits(IDS)


def test_file_truncated_while_loaded(files, tmp_path):
    p = tmp_path / "t.cflow"
    shutil.copy(files["de2"], p)
    with cflow.load(p, experts="disk", expert_cache_mb=0.5) as m:
        with FileReader(p) as r:
            first_expert = min(t.file_offset for t in r.tensors if t.expert >= 0)
        os.truncate(p, first_expert)  # every expert gone; dense weights already in RAM
        with pytest.raises(ExpertReadError, match="short read"):
            m.logits(IDS)


@pytest.mark.parametrize("where", ["open", "first read"])
def test_filesystem_without_o_direct_falls_back(files, monkeypatch, where):
    """Where O_DIRECT is refused (EINVAL at open, or at the first read as some filesystems do) reads go through
    the page cache, with one warning per tier, the same tokens, and the page cache dropped after each read."""
    import fcntl

    with cflow.load(files["de2"], threads=1) as ram:
        want = _greedy(ram)
    real_open, real_preadv, dropped = os.open, os.preadv, []

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a)

    def no_direct_read(fd, bufs, offset, *a):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_preadv(fd, bufs, offset, *a)

    if where == "open":
        monkeypatch.setattr(os, "open", no_direct_open)
    else:
        monkeypatch.setattr(os, "preadv", no_direct_read)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: dropped.append(advice))
    with pytest.warns(UserWarning, match="O_DIRECT refused") as warned:
        m = cflow.load(files["de2"], threads=1, weights="disk", expert_cache_mb=0.5)
    assert len([w for w in warned if "O_DIRECT refused" in str(w.message)]) == 2  # the experts', the streamer's
    with m:
        assert not m.session.tier.direct and not m.session.streamer.direct
        assert _greedy(m) == want
        assert dropped and set(dropped) == {os.POSIX_FADV_DONTNEED}


def test_cli_experts_on_disk(files):
    cmd = [sys.executable, "-c", "import sys; from cflow.cli import cflow_main; sys.exit(cflow_main(sys.argv[1:]))"]
    r = subprocess.run(cmd + ["run", str(files["de0"]), "--prompt", "1 2 3", "-n", "4", "--experts-on-disk",
                              "--expert-cache-mb", "0.5"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "no overlap window" in r.stderr and "hit rate" in r.stderr
    r = subprocess.run(cmd + ["run", str(files["de2"]), "--prompt", "1 2 3", "-n", "4", "--experts-on-disk",
                              "--expert-io", "sync"], capture_output=True, text=True)
    assert r.returncode == 0 and "de=2: reads overlap" in r.stderr, r.stderr
    r = subprocess.run(cmd + ["run", str(files["de2"]), "--prompt", "1", "--expert-cache-mb", "4"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "need --experts-on-disk" in r.stderr


# --- dense weights streamed from disk (--weights-on-disk) ------------------------------------------------------
@pytest.fixture(scope="module")
def dense_files(tmp_path_factory):
    import torch

    from cflow.frontend import from_torch
    from cflow.models import PipelineNativeLM, get_preset

    d = tmp_path_factory.mktemp("stream")
    torch.manual_seed(0)
    cfg = get_preset("arch2_4_combined", "tiny").evolve(n_experts=0, top_k=0, expert_dim=0, expert_delay=0)
    g = from_torch(PipelineNativeLM(cfg).eval())
    out = {}
    for ext in ("vflow", "cflow"):
        out[ext] = d / f"dense.{ext}"
        compile_file(g, out[ext], "q4")
    return out


@pytest.mark.parametrize("ext", ["vflow", "cflow"])
def test_weights_on_disk_equals_ram(dense_files, files, ext):
    for path in (dense_files[ext], files["de2"]):
        with cflow.load(path, threads=2) as ram:
            want_logits, want = ram.logits(IDS).copy(), _greedy(ram)
        for ra, th in ((0, 1), (2, 2), (5, 2)):
            with cflow.load(path, threads=th, weights="disk", read_ahead=ra, expert_cache_mb=0.5) as m:
                assert np.array_equal(m.logits(IDS), want_logits)
                assert _greedy(m) == want
                st = m.session.streamer
                assert st.stats.bytes_read >= st.bytes_per_token * len(IDS)
                assert m.session.tier is None or m.expert_stats.misses > 0  # MoE: experts went to disk too


def test_vflow_streams_in_fewer_requests(files, tmp_path):
    """Stage-major files give one request per stage; layer-major ones as many or more (114m: experts between)."""
    counts = {}
    for ext in ("vflow", "cflow"):
        p = tmp_path / f"m.{ext}"
        compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
        with cflow.load(p, threads=1, weights="disk") as m:
            st = m.session.streamer
            counts[ext] = st.requests_per_token
            if ext == "cflow":
                assert st.requests_per_token >= len(st.stages)
            else:
                assert st.requests_per_token == len(st.stages)
    assert counts["vflow"] <= counts["cflow"]


def test_corrupt_streamed_weight_is_caught(dense_files, tmp_path):
    bad = tmp_path / "bad.vflow"
    shutil.copy(dense_files["vflow"], bad)
    with FileReader(bad) as r:
        off = r.entry("blocks.1.ffn.w_down").file_offset + 10
    with open(bad, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x55]))
    from cflow.runtime.streaming import WeightReadError

    with cflow.load(bad, weights="disk") as m:
        with pytest.raises(WeightReadError, match=r"blocks.1.ffn.w_down.*checksum mismatch"):
            m.logits(IDS)


def test_streamer_injected_read_failure_then_usable(dense_files):
    from cflow.runtime.streaming import WeightReadError

    path = dense_files["vflow"]
    with cflow.load(path, threads=1) as ram:
        want = _greedy(ram)
    with cflow.load(path, threads=1, weights="disk", read_ahead=2) as m:
        m.session.streamer.fail_hook = _fail_at(7)
        with pytest.raises(WeightReadError, match=r"stage \d+ weights \(blocks\.\d.*\) at file offset 0x[0-9a-f]+: "
                                                  r"read failed: Input/output error"):
            _greedy(m)
        m.session.streamer.fail_hook = None
        assert _greedy(m) == want  # the read-ahead was dropped and restarts: a new request gives the same tokens


@pytest.mark.parametrize("mode", ["experts", "weights"])
def test_truncated_while_streaming_is_one_clear_error(dense_files, files, tmp_path, mode):
    """Truncated under a loaded model: every later request fails the same clear way (no crash), and it closes."""
    src = files["de2"] if mode == "experts" else dense_files["cflow"]
    p = tmp_path / f"t{src.suffix}"
    shutil.copy(src, p)
    kw = dict(experts="disk", expert_cache_mb=0.5) if mode == "experts" else dict(weights="disk")
    with cflow.load(p, threads=1, **kw) as m:
        if mode == "experts":
            with FileReader(p) as r:
                cut = min(t.file_offset for t in r.tensors if t.expert >= 0)
        else:
            cut = min(r.file_offset for runs in m.session.streamer.runs.values() for r in runs)
        os.truncate(p, cut)  # everything read per token is gone; what was read at load stays in RAM
        for _ in range(2):
            with pytest.raises(RuntimeFault, match=r"short read, 0 of \d+ bytes \(file truncated\?\); the file was "
                                                   r"truncated since it was loaded"):
                _greedy(m, 2)


@pytest.mark.parametrize("mode", ["experts", "weights"])
def test_file_replaced_while_loaded(dense_files, files, tmp_path, mode):
    """A different file renamed over the path: the open descriptors keep the file that was loaded, so decoding
    goes on bit-identical (nothing is inconsistent). The same file rewritten in place: one clear error."""
    src, other = (files["de2"], dense_files["vflow"]) if mode == "experts" else (dense_files["cflow"], files["de3"])
    kw = dict(experts="disk", expert_cache_mb=0.5) if mode == "experts" else dict(weights="disk")
    with cflow.load(src, threads=1) as ram:
        want = _greedy(ram)
    p = tmp_path / f"m{src.suffix}"
    shutil.copy(src, p)
    with cflow.load(p, threads=1, **kw) as m:
        tmp = tmp_path / "incoming"
        shutil.copy(other, tmp)
        os.replace(tmp, p)  # what `mv new.cflow m.cflow` or an atomic deploy does
        assert _greedy(m) == want
    shutil.copy(src, p)
    with cflow.load(p, threads=1, **kw) as m:
        shutil.copyfile(other, p)  # same inode, other bytes (cp new.cflow m.cflow)
        for _ in range(2):
            with pytest.raises(RuntimeFault, match=r"(checksum mismatch|short read).*; the file was (modified|"
                                                   r"truncated) since it was loaded"):
                _greedy(m, 2)


@pytest.mark.parametrize("io", ["async", "sync"])
def test_reads_issued_at_the_router_awaited_at_the_use(files, io):
    """de = 2: async reads of a layer are submitted right after its router's segment and awaited only after at
    least one more native call (the window); sync ones are submitted at the await."""
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5, expert_io=io) as m:
        s = m.session
        assert max(s.window_stages.values()) > 0
        events = []
        issue, wait, native = s.tier.issue, s.tier.wait, s._run_native
        s.tier.issue = lambda b, e, layer=None: events.append(("issue", layer)) or issue(b, e, layer)
        s.tier.wait = lambda b, e: events.append(("wait", b)) or wait(b, e)
        s._run_native = lambda *a: events.append(("native", None)) or native(*a)
        s.step(5)
        blk = s.config.block_of
        for layer, window in s.window_stages.items():
            i = events.index(("issue", layer))
            j = next(k for k in range(i, len(events)) if events[k] == ("wait", blk(layer)))
            natives = sum(1 for ev in events[i:j] if ev[0] == "native")
            if io == "sync":
                assert natives == 0
            else:
                assert natives >= (1 if window > 0 else 0), (layer, window, events[i:j])


# --- a memory budget for the whole process (max_ram) -----------------------------------------------------------


def test_max_ram_places_the_weights_and_sizes_the_cache(files, monkeypatch):
    """Under max_ram the weights stay mapped when they fit, else the experts go to disk with the rest of the budget
    as their cache (same tokens as in RAM), else one error; the process's own memory set to 0 here, so that the
    budgets are the model's alone."""
    import cflow.runtime.memory_estimate as me

    monkeypatch.setattr(me, "process_rss", lambda: 0)
    monkeypatch.setattr(me, "LOAD_RESERVE", 0)
    monkeypatch.setattr(me, "RUN_RESERVE", 0)
    seen = []
    real = me.choose_tiers
    monkeypatch.setattr(me, "choose_tiers", lambda *a: seen.append(a[2]) or real(*a))
    with cflow.load(files["de2"], threads=1, max_ram_mb=2**20) as m:
        assert m.session.experts == "ram" and m.session.weights == "ram"
        want = _greedy(m, 16)
    need = {(ex, we): n for ex, we, n, _ in seen[-1]}
    window = {(ex, we): w for ex, we, _, w in seen[-1]}
    assert window[("ram", "ram")] == 0 and 0 < window[("disk", "ram")] <= 0.35 * 2**20
    assert need[("disk", "ram")] < need[("ram", "ram")]
    cache = 0.4 * 2**20
    with cflow.load(files["de2"], threads=1, max_ram_mb=(need[("disk", "ram")] + cache) / 2**20) as m:
        s = m.session
        assert s.experts == "disk" and s.weights == "ram"
        assert 0 < len(s.tier.slots) * s.tier.slot_bytes <= cache
        assert _greedy(m, 16) == want
    with pytest.raises(CflowError, match="max_ram .* too small for this model"):
        cflow.load(files["de2"], max_ram_mb=min(need.values()) / 2**20 * 0.99)
    # the dense part fits, but not one window of experts besides: refused at load, before the JIT
    monkeypatch.setattr(NativeStep, "_build", lambda *a: pytest.fail("reached the JIT"))
    with pytest.raises(CflowError, match="max_ram .* too small .* for one window of experts"):
        cflow.load(files["de2"], max_ram_mb=(need[("disk", "disk")] + window[("disk", "disk")] - 4096) / 2**20)
    with pytest.raises(CflowError, match="not both"):
        cflow.load(files["de2"], max_ram_mb=64, expert_cache_mb=1)


def test_max_ram_dense_model(dense_files):
    """A model without experts under max_ram: mapped when it fits, streamed when asked, refused with its numbers
    (it once tried to put its experts on disk and failed at every budget)."""
    path = dense_files["vflow"]
    with cflow.load(path, threads=1, max_ram_mb=2**20) as m:
        assert (m.session.experts, m.session.weights) == ("ram", "ram")
    with cflow.load(path, threads=1, max_ram_mb=2**20, weights="disk") as m:
        assert (m.session.experts, m.session.weights) == ("ram", "disk") and m.session.tier is None
    with pytest.raises(CflowError, match="max_ram 1.0 MiB is too small") as e:
        cflow.load(path, max_ram_mb=1)
    assert "window" not in str(e.value)


def test_cli_max_ram_below_one_window_is_refused_with_the_numbers(files, capsys, monkeypatch):
    from cflow.cli import cflow_main

    monkeypatch.setattr(NativeStep, "_build", lambda *a: pytest.fail("reached the JIT"))
    code = cflow_main(["run", str(files["de2"]), "--prompt", "1 2 3", "-n", "2", "--max-ram", "64M"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    numbers = re.findall(r"([\d,.]+) MiB (for the weights kept in RAM|for one window of experts|reserved for "
                         r"loading|this process already holds)", err)
    assert "max_ram 64.0 MiB is too small" in err and len(numbers) == 4, err
    assert float(numbers[1][0]) > 0 and float(numbers[2][0]) == 256  # the window, the load's reserve


def test_max_ram_option_and_cgroup_limit(tmp_path):
    import argparse

    from cflow.cli import size_mb
    from cflow.util import cgroup_memory

    assert size_mb("8G") == 8192 and size_mb("8GiB") == 8192 and size_mb("512M") == 512 and size_mb("300") == 300
    assert size_mb("1.5g") == 1536 and size_mb("1T") == 2**20
    for bad in ("", "abc", "0", "-1G", "inf", "8Q"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
            size_mb(bad)
    # the process's own v1 group, limited by its parent: the nearest limit up the path
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/a/b\n0::/\n")
    grp = tmp_path / "memory" / "a"
    (grp / "b").mkdir(parents=True)
    (grp / "b" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit of its own
    (grp / "b" / "memory.usage_in_bytes").write_text("100\n")
    (grp / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    (grp / "memory.usage_in_bytes").write_text("4096\n")
    assert cgroup_memory(str(proc), str(tmp_path)) == (8 << 30, 4096)
    (tmp_path / "memory.max").write_text("max\n")  # v2 at the root: no limit there, v1 still read
    assert cgroup_memory(str(proc), str(tmp_path)) == (8 << 30, 4096)
    proc.write_text("0::/c\n")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "memory.max").write_text("1048576\n")
    (tmp_path / "c" / "memory.current").write_text("512\n")
    assert cgroup_memory(str(proc), str(tmp_path)) == (1048576, 512)
    assert cgroup_memory(str(tmp_path / "missing"), str(tmp_path)) == (None, None)


# --- the next layer's reads started on a guess of its route (route_guess.py) -----------------------------------


def test_route_guess_reads_the_router_input_and_changes_no_logit(files):
    """The guess starts reads only: logits bit-identical with it on and off; guessed reads are counted and
    some are then chosen. Its inputs are the right ones: guessing a layer's own route from its own router input
    gives exactly the router's choice."""
    with cflow.load(files["de0"], threads=1, experts="disk", expert_cache_mb=0.5, expert_guess=False) as m:
        want = m.logits(IDS).copy()
        assert m.session.route_guess is None and m.expert_stats.guessed == 0
    with cflow.load(files["de0"], threads=1, experts="disk", expert_cache_mb=0.5) as m:
        s = m.session
        rg = s.route_guess
        assert len(rg.layers) == m.config.n_layers and rg.next  # every layer routes; each guesses the next
        real, mine = s._route, []

        def route(layer):  # at the moment the session reads the route, the scratch holds that router's input
            w, r, k = rg.layers[layer]
            x = s.scratch[rg.at : rg.at + 4 * w.size].view(np.float32)
            mine.append((set(real(layer).tolist()), set(np.argpartition(-(r @ x), k - 1)[:k].tolist())))
            return real(layer)

        s._route = route
        assert np.array_equal(m.logits(IDS), want)
        assert mine and all(a == b for a, b in mine)
        st = m.expert_stats
        assert st.guessed > 0 and 0 < st.guessed_used <= st.guessed
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5) as m:  # windows hide the reads
        s = m.session
        assert s.route_guess.only == {l for l, w in s.window_stages.items() if w == 0} != set(s.window_stages)


def test_prefetch_is_unpinned_and_counted(files):
    """A guessed expert is read into a slot nobody pins (so the cache never runs out of slots for the chosen
    ones), counted as used when chosen later, and never started twice."""
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5, expert_guess=False) as m:
        tier = m.session.tier
        tier.reset()
        n = len(tier.slots)
        assert tier.prefetch(0, [0, 1]) == 2 and tier.prefetch(0, [0, 1]) == 0  # in flight: not again
        assert all(tier.slots[tier.where[(0, e)]].pins == 0 for e in (0, 1))
        assert tier.issue(0, [1]) == 0  # chosen: a hit on the guess
        assert tier.stats.guessed == 2 and tier.stats.guessed_used == 1
        tier.wait(0, [1])
        tier.release(0, [1])
        # a guess fills at most every slot that is free; the chosen ones still find room afterwards
        assert tier.prefetch(1, range(2 * n)) <= n
        tier.reset()
        assert tier.issue(2, range(min(n, 3))) >= 0 and tier.wait(2, range(min(n, 3)))


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_cache_policy_keeps_the_often_chosen(files, policy):
    """LFU (the default) keeps an expert chosen often through a run of experts chosen once; LRU evicts it."""
    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5, expert_guess=False) as m:
        tier = m.session.tier
        tier.reset()
        tier.policy = policy

        def choose(block, e):
            tier.issue(block, [e])
            tier.wait(block, [e])
            tier.release(block, [e])

        for _ in range(3):
            choose(0, 0)
        others = sorted(k for k in tier.names if k != (0, 0))[: len(tier.slots) + 2]
        assert len(others) > len(tier.slots)  # enough to evict
        for b, e in others:
            choose(b, e)
        assert ((0, 0) in tier.where) == (policy == "lfu")
        assert all(s.pins == 0 for s in tier.slots)


def test_a_guess_takes_only_idle_io_threads(files):
    """While the chosen experts' reads keep every I/O thread busy, a guess starts nothing."""
    import threading

    with cflow.load(files["de2"], threads=1, experts="disk", expert_cache_mb=0.5, expert_guess=False) as m:
        tier = m.session.tier
        tier.reset()
        gate = threading.Event()
        tier.fail_hook = lambda key, k: gate.wait(10)  # hold every read on the disk until released
        keys = sorted(tier.names)
        chosen = [e for b, e in keys if b == 0][: tier.io_threads]
        try:
            assert tier.issue(0, chosen) == len(chosen)
            busy = tier.io_threads - len(chosen)
            assert tier.prefetch(1, [e for b, e in keys if b == 1]) == busy  # only the idle ones take a guess
        finally:
            gate.set()
        tier.wait(0, chosen)
        tier.release(0, chosen)
        tier.fail_hook = None
        tier.reset()
        assert tier.in_flight == 0
