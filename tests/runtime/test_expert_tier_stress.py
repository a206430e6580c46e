"""Issue 14: the disk tiers under a thread count that changes between native calls (what the default thread count's
_Backoff does under load) must give the RAM logits bit for bit, and never crash.

Each thread keeps its own copy of a layer's route in its scratch: the ROUTE segment writes it, the expert segments
read it. Before the fix the backoff was asked at every native call, so a token whose ROUTE segment ran on one
thread and whose expert segment ran on two had worker 1 read a stale route and the table pointer of an expert
nobody had loaded (NULL): SIGSEGV at de = 0 and 1, wrong logits at de = 2. The children run in subprocesses so a
segfault is a failed test, not a dead test run."""

import os
import subprocess
import sys
import warnings

import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph

CHILD = r"""
import faulthandler, sys
faulthandler.enable()
import numpy as np
import cflow

path, io, cache_mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
IDS = [5, 17, 3, 99, 1, 2, 3, 4]

class Flip:
    # the backoff's answer changes at every question: one thread, then all, then one...
    def __init__(self):
        self.k = 0
        self.solo_calls = 0
    def solo(self):
        self.k += 1
        if self.k % 2:
            self.solo_calls += 1
            return True
        return False
    def after(self, naps):
        pass

with cflow.load(path, threads=2) as ram:
    want_logits = ram.logits(IDS).copy()
    want = ram.generate(IDS, max_new_tokens=8, stop=False)
for trial in range(2):
    with cflow.load(path, experts="disk", expert_cache_mb=cache_mb, expert_io=io) as m:
        s = m.session
        assert s._pool is not None, "needs the worker pool (2 usable cores)"
        s._backoff = flip = Flip()
        assert np.array_equal(m.logits(IDS), want_logits), (trial, "logits")
        assert m.generate(IDS, max_new_tokens=8, stop=False) == want, (trial, "greedy")
        # one answer per token, and every native call of a solo token counted as one
        tokens = flip.k
        assert tokens == 2 * len(IDS) + 7, tokens
        assert s.solo_calls == (tokens + 1) // 2 * len(s.segments), (s.solo_calls, tokens, len(s.segments))
print("ok")
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("stress")
    out = {}
    for de in (0, 1, 2):  # the file of issue 14 (de = 0) and its neighbours
        out[de] = d / f"de{de}.cflow"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_file(load_graph("preset:arch2_4_combined@tiny"), out[de], "q4", delays=(1, de))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the default thread count is 1 on one core")
@pytest.mark.parametrize("de,io,cache_mb", [(0, "async", 0.5), (1, "sync", 0.5), (2, "async", 0.35)])
def test_thread_count_switching_between_calls(files, de, io, cache_mb):
    r = subprocess.run([sys.executable, "-c", CHILD, str(files[de]), io, str(cache_mb)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.returncode, r.stderr[-3000:])
