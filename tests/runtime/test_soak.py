"""Long runs stay flat, in miniature (benchmarks/soak.py is the long run: docs/reliability.md): load/unload cycles
and many requests leave no file descriptor, thread or worker behind."""

import gc
import os
import threading

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_load_unload_and_requests_leave_nothing_behind(tmp_path):
    path = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch4_async_experts@tiny"), path, "q4")
    with cflow.load(path, threads=2) as m:  # warm-up: caches filled
        m.generate([1, 2], 2)
    gc.collect()
    fds, threads, py = _fds(), _threads(), threading.active_count()
    for _ in range(12):
        with cflow.load(path, threads=2) as m:
            for r in range(5):
                m.generate([1 + r, 2, 3], max_new_tokens=8, temperature=0.5 * (r % 2), seed=r, stop=False)
            s = m.stream([4, 5], max_new_tokens=20)
            next(s)
            s.close()  # a stream abandoned half-way
        m2 = cflow.load(path, threads=1)
        m2.generate([7], 3)
        del m2  # dropped without close(): the finaliser frees it
    gc.collect()
    assert (_fds(), _threads(), threading.active_count()) == (fds, threads, py)
