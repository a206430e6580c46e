"""A profiling build's cycle stamps: worker 0's after every stage's barrier (row 0) and each thread's on reaching
every barrier (row 1 + t), which benchmarks/decode.py --profile splits into a stage's work and its wait.

Worker 0 reaches stage i's barrier after it left barrier i-1 and before it leaves barrier i, on its own clock:
prof[0][i] <= prof[1][i] <= prof[0][i + 1]. Every thread's row is filled for every stage, in order, its last
column with its start of the call (a wrong row offset would write another thread's row, or past the array).
Across threads only the order is loose: another thread may leave a barrier, and even reach the next one, before
worker 0 stamps.
"""

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.runtime.session import Session


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("prof") / "arch1.vflow"
    compile_file(load_graph("preset:arch1@tiny"), p, "q4")
    return p


@pytest.mark.parametrize("threads", [1, 2])
def test_arrivals_lie_between_the_barriers(path, threads):
    with Session(str(path), threads=threads, profile=True) as s:
        n = s.compiled.schedule.n_stages
        assert s.prof.shape == (threads + 1, n + 1)
        logits = s.prefill([1, 2, 3])
        for _ in range(3):
            logits = s.step(int(np.argmax(logits)))
            s.prof[1:] = 0
            logits = s.step(int(np.argmax(logits)))
            rel, arr = s.prof[0], s.prof[1:, :n]
            assert (np.diff(rel) > 0).all()
            assert (arr[0] >= rel[:n]).all() and (arr[0] <= rel[1:]).all()
            assert (arr > 0).all() and (np.diff(arr, axis=1) > 0).all()
            start = s.prof[1:, n]  # each thread's start of the call, before its first arrival
            assert (start > 0).all() and (start <= arr[:, 0]).all()


def test_disk_tier_program_has_its_own_stage_count(tmp_path):
    """experts="disk" runs a schedule of its own (more stages than the file's): the stamps must fit it."""
    p = tmp_path / "moe.vflow"
    compile_file(load_graph("preset:arch4_async_experts@tiny"), p, "q4")
    with Session(str(p), threads=2, profile=True, experts="disk") as s:
        n = s.run_state.schedule.n_stages
        assert n != s.compiled.schedule.n_stages  # the case this guards
        assert s.prof.shape == (3, n + 1)
        logits = s.prefill([1, 2, 3])
        s.step(int(np.argmax(logits)))
        # a token is several calls over stage ranges there; only the first stamps the token's start
        assert (s.prof[1:, :n] > 0).all() and (np.diff(s.prof[0]) > 0).all()
