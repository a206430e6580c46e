"""The stage barrier's sleep path and the default thread count.

The barrier (codegen/threads.py::barrier) spins BarrierWord.SPIN pause rounds, then sleeps in futex_wait. On a quiet
machine with one thread per core the sleep path is rare, so a test that just decodes never runs it. Here a
child process is pinned to at most 2 CPUs and decodes with 2, 3 and 4 threads and a spin budget of 1 round: a
waiter then sleeps at nearly every barrier (a thread that is not on a CPU cannot arrive within one pause), and
the logits must still be bit-identical to 1 thread. A lost wake-up would hang, so the child runs under a
subprocess timeout: the test fails instead of hanging the suite, and asserts nothing about time. The default
thread count, seeing its waiters sleep, must back off to one thread (runtime.workers.Backoff), still bit-identical.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

from cflow.codegen.abi import BARRIER_WORDS, BarrierWord
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.runtime.session import OversubscribedWarning, Session

CHILD = r"""
import hashlib, json, os, sys
import numpy as np
cpus = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, cpus)  # at most 2 cores, whatever the host has: 3 and 4 threads oversubscribe
import warnings
warnings.simplefilter("ignore")  # the oversubscription warning is tested on its own below
from cflow.codegen.abi import BarrierWord
from cflow.runtime.session import Session

path, spin = sys.argv[1], int(sys.argv[2])
out = {"cpus": len(cpus)}
for threads in (1, 2, 3, 4, None):  # None: the default thread count, which backs off when workers sleep
    s = Session(path, threads=threads)
    s.barrier[BarrierWord.SPIN] = spin
    h = hashlib.sha256()
    logits = s.prefill([1, 2, 3, 4, 5])  # the multi-token body crosses the same barriers
    h.update(logits.tobytes())
    tokens = []
    for _ in range(12):
        t = int(np.argmax(logits))
        tokens.append(t)
        logits = s.step(t)
        h.update(logits.tobytes())
    out[threads or "default"] = {"digest": h.hexdigest(), "tokens": tokens, "naps": s.barrier_naps,
                                 "solo": s.solo_calls, "threads": s.threads}
    s.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module", params=["arch1", "arch2_4_combined"])
def model_file(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("barrier") / f"{request.param}.vflow")
    compile_file(load_graph(f"preset:{request.param}@tiny"), path, "q4")
    return path


def test_sleeping_barrier_is_bit_identical_to_one_thread(model_file):
    r = subprocess.run([sys.executable, "-c", CHILD, model_file, "1"], capture_output=True, text=True,
                       timeout=180, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ref = out["1"]
    assert ref["naps"] == 0  # one thread never waits
    for threads in ("2", "3", "4", "default"):
        assert out[threads]["tokens"] == ref["tokens"], threads
        assert out[threads]["digest"] == ref["digest"], threads  # every logit, bit for bit
    # With more threads than cores and one spin round, waiters must have slept: the path above was exercised.
    assert out["4"]["naps"] > 0
    assert out["3"]["naps"] > 0
    assert out["4"]["solo"] == 0  # an explicit thread count is taken as asked
    if out["cpus"] >= 2:
        # The default (2 threads here) sees its waiters sleep at almost every barrier with a spin budget of one
        # round, so after its first probe window (Backoff.WINDOW calls) it runs on one thread.
        assert out["default"]["threads"] == out["cpus"]
        assert out["default"]["solo"] > 0


def test_barrier_words_are_placed_as_documented():
    line = 16  # i32 words per 64-byte cache line
    assert all(0 <= w < BARRIER_WORDS for w in BarrierWord)
    assert BarrierWord.COUNT // line != BarrierWord.GENERATION // line  # arrivals do not evict the pollers' line
    for w in (BarrierWord.SLEEPERS, BarrierWord.NAPS):  # written/read next to the generation, which is hot anyway
        assert w // line == BarrierWord.GENERATION // line
    assert len(set(BarrierWord)) == len(BarrierWord)


# --- the default thread count: the cores this process may run on -------------------------------------------------
@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("threads") / "arch1.vflow")
    compile_file(load_graph("preset:arch1@tiny"), path, "q4")
    return path


def test_default_threads_follow_the_affinity_mask(tiny_file, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # e.g. taskset -c 0-2 on a bigger host
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default never warns
        s = Session(tiny_file)
        s2 = Session(tiny_file, threads=3)  # exactly the usable cores: no warning either
    try:
        assert s.threads == 3 and s2.threads == 3
    finally:
        s.close()
        s2.close()


def test_more_threads_than_usable_cores_warns(tiny_file, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.warns(OversubscribedWarning, match=r"threads=2 but this process may run on 1 core \(") as rec:
        s = Session(tiny_file, threads=2)
    try:
        assert len(rec) == 1  # once per load, not per worker
        assert s.threads == 2  # still honoured: it works, only slower
        logits = s.prefill([1, 2, 3])
        assert logits.shape[-1] > 0
    finally:
        s.close()


def test_backoff_policy_with_a_fake_clock():
    from cflow.runtime.workers import Backoff

    now = [0.0]
    b = Backoff(clock=lambda: now[0])
    naps = 0

    def probe(per_call: int) -> int:
        """Multi-threaded calls until the policy decides (backs off, or a quiet window passes); returns them."""
        nonlocal naps
        for k in range(1, b.WINDOW + 1):
            assert not b.solo()
            naps += per_call
            b.after(naps)
            if b.until:
                return k
        return b.WINDOW

    assert probe(0) == b.WINDOW  # quiet: never backs off
    assert not b.solo() and b.solo_calls == 0
    assert probe(1) == b.NAPS  # one sleep per call: a descheduled worker, decided when NAPS sleeps are seen
    assert b.solo() and b.solo()  # single-threaded for FIRST seconds
    now[0] += b.FIRST + 1e-9
    assert probe(b.NAPS) == 1  # heavily loaded: the first probe call decides; the backoff is twice as long
    now[0] += 2 * b.FIRST - 1e-3
    assert b.solo()
    now[0] += 2e-3
    for _ in range(10):  # the backoff doubles up to MOST while the load lasts
        probe(3)
        now[0] += b.MOST + 1e-9
    assert b.backoff == b.MOST
    assert probe(0) == b.WINDOW  # a quiet window resets it
    assert b.backoff == b.FIRST and not b.solo()
    assert b.solo_calls == 3


def test_backoff_judges_by_the_models_own_quiet_rate():
    """A big model naps at uneven stages on a quiet host (35 sleeps per call): after its first window that is
    the floor, and only well above it (a descheduled worker: 120) backs off."""
    from cflow.runtime.workers import Backoff

    now = [0.0]
    b = Backoff(clock=lambda: now[0])
    naps = 35
    b.after(naps)  # the first call trips the default limit at once, and sets the floor
    assert b.until and b.floor == 35
    now[0] += b.FIRST + 1e-9
    for _ in range(3 * b.WINDOW):  # quiet: 35 per call stays multi-threaded
        assert not b.solo()
        naps += 35
        b.after(naps)
    calls = 0
    while not b.until and calls < b.WINDOW:  # a busy other core: 120 per call
        assert not b.solo()
        naps += 120
        b.after(naps)
        calls += 1
    assert b.until and calls == 5 and b.floor == 35  # (2 x 35 + 1) x WINDOW = 568 sleeps: 5 calls of 120


def test_backoff_skips_the_probe_while_other_tasks_hold_the_cores():
    from cflow.runtime.workers import Backoff

    now, busy = [0.0], [True]
    b = Backoff(clock=lambda: now[0], busy=lambda: busy[0])
    for k in range(1, b.NAPS + 1):  # a loaded window: one nap per call
        assert not b.solo()
        b.after(k)
    assert b.until and b.solo()
    first = b.backoff
    now[0] += b.FIRST + 1e-9  # the backoff ends while the other task still runs: no probe, a longer backoff
    assert b.solo() and b.skipped == 1 and b.backoff == min(2 * first, b.MOST)
    now[0] += 10 * b.MOST  # long after: the load has gone, the next call probes (multi-threaded)
    busy[0] = False
    assert not b.solo() and b.skipped == 1


def test_cores_taken_reads_the_run_queue(monkeypatch):
    import builtins
    import io

    from cflow.runtime import workers

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for line, want in (("0.1 0.2 0.3 1/80 999", False), ("1.0 0.9 0.5 2/80 999", True)):
        monkeypatch.setattr(builtins, "open", lambda *a, text=line, **k: io.StringIO(text))
        assert workers.cores_taken(2) is want  # 1: only this thread runs; 2: one other task wants a core
    monkeypatch.setattr(builtins, "open", lambda *a, **k: io.StringIO("garbage"))
    assert workers.cores_taken(2) is False  # unreadable: the probe decides


def test_detached_backoff_policy_with_a_fake_clock():
    """A detached step's calls in turn under load: windows of launches whose time to their wait's end is well
    above the quietest window's mean back off for FIRST seconds, doubling up to MOST while it lasts; a window
    within the bound resets it; a call given up is not judged."""
    from cflow.runtime.workers import DetachedBackoff

    now = [0.0]
    b = DetachedBackoff(clock=lambda: now[0])

    def window(each: float, judge: bool = True) -> int:
        """Launches until the policy backs off, or a whole window; returns them."""
        for k in range(1, b.WINDOW + 1):
            assert not b.active()
            b.launched()
            now[0] += each
            b.waited(judge)
            if b.until:
                return k
        return b.WINDOW

    window(100e-6)  # quiet: sets the floor
    assert b.floor == pytest.approx(100e-6) and not b.solo()
    window(4 * 100e-6)  # slower, within FACTOR x floor: not load
    assert not b.active() and b.floor == pytest.approx(100e-6)
    window(100e-6, judge=False)  # given up: says nothing
    assert b.calls == 0
    # a descheduled worker: decided once the window's sum passes the bound (5 x 32 x 100 us = 16 ms: the 18th
    # launch of 900 us), then in turn for FIRST seconds, counted
    assert window(9 * 100e-6) == 18
    assert b.active() and b.solo() and b.solo_calls == 1
    now[0] += b.FIRST + 1e-9
    assert not b.active()
    for _ in range(10):  # doubles up to MOST while the load lasts
        window(9 * 100e-6)
        now[0] += b.MOST + 1e-9
    assert b.backoff == b.MOST
    window(100e-6)  # a quiet window resets it
    assert b.backoff == b.FIRST and not b.active()
    # started under load: one launch that ran undisturbed gives the step's time, and the first window decides
    b = DetachedBackoff(clock=lambda: now[0])
    b.launched()
    now[0] += 100e-6
    b.waited()
    assert window(9 * 100e-6) == 18 and b.active()
