"""Closing a session never frees what a still-running worker thread may touch.

Workers.close sets STOP, wakes the workers and joins each for a while. A worker that has not ended by then (a
thread descheduled for long) would otherwise run on in native code while the session's control block, argument
buffers and JIT-compiled code are freed. Here the wake-up is withheld, so the worker stays asleep in futex_wait
past the join timeout: it must be parked with everything it needs, survive the session being dropped and
collected, and end (and be reaped) once it is woken and sees STOP.
"""

import gc
import weakref

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.runtime import workers as W
from cflow.runtime.session import Session


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("workers") / "arch1.vflow")
    compile_file(load_graph("preset:arch1@tiny"), path, "q4")
    return path


def test_a_worker_outliving_close_is_parked_not_freed(tiny_file):
    s = Session(tiny_file, threads=2)
    before = s.step(1).copy()
    pool = s._pool
    real_kick = pool.kick
    pool.kick = lambda ctl: None  # the worker never hears STOP: its join must time out
    pool.close(timeout=0.05)
    assert W.parked_workers() == 1
    (threads, keep), = [e for e in W._PARKED if e[0][0] in pool.threads]
    s._pool = None  # as Session.close leaves it
    lib = weakref.ref(pool.library)
    s.close()
    del s, pool
    gc.collect()
    assert lib() is not None  # the code the worker sleeps in is still mapped
    assert threads[0].is_alive()
    real_kick(keep[3])  # wake it: it sees STOP and returns
    threads[0].join(timeout=10)
    assert not threads[0].is_alive()
    assert W.parked_workers() == 0  # reaped
    del keep, threads
    gc.collect()
    # a new session in the same process decodes as before
    with Session(tiny_file, threads=2) as s2:
        np.testing.assert_array_equal(s2.step(1), before)


def test_a_normal_close_parks_nothing(tiny_file):
    with Session(tiny_file, threads=2) as s:
        s.step(1)
    assert W.parked_workers() == 0
