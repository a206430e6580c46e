"""Files the suite builds once per run and shares between its pytest-xdist workers.

A module or session fixture is per worker process; a file several test files read (the ONNX export of the tiny
arch2_4_combined preset: ~5-8 s of CPU each time) is built here once, in $CFLOW_TEST_SHARED (tests/conftest.py
sets it to a per-run temp directory before the workers start, as it does the kernel cache). The first worker to
ask builds it under a file lock; another asking meanwhile waits for it (no CPU), then reads the same file.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

ENV = "CFLOW_TEST_SHARED"


def shared_dir() -> Path:
    d = os.environ.get(ENV)
    if not d:  # outside the suite's conftest (a module run by hand): this process alone
        d = os.environ[ENV] = tempfile.mkdtemp(prefix="cflow-test-shared-")
    return Path(d)


def shared_file(name: str, build: Callable[[Path], object]) -> Path:
    """The shared file `name`, built by `build(path)` on first use in this run (by whichever worker asks first)."""
    d = shared_dir()
    path = d / name
    with open(d / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
        if not path.exists():
            part = d / f"part-{name}"
            build(part)
            os.replace(part, path)
    return path


def arch24_tiny_onnx() -> Path:
    """preset:arch2_4_combined@tiny exported by `cflow export-onnx`, as a user would: the same bytes as
    cflow.frontend.export.export_onnx of the preset (benchmarks/fuzz.py's ONNX base; the export is deterministic,
    tests/frontend/test_onnx_determinism.py)."""

    def build(out: Path) -> None:
        from cflow.cli import cflow_main

        assert cflow_main(["export-onnx", "preset:arch2_4_combined@tiny", "-o", str(out)]) == 0

    return shared_file("arch2_4_combined-tiny.onnx", build)


# The tile of the test models whose subject is not the mat-vec kernels at the default tile (a family's stage code, a
# cache type, the attention core, the delays' schedule, stage sharing, expert reads): 32 rows, two 16-row groups in
# one pass as the default 128x256 tile's eight are, for a fraction of the kernel code to JIT (a tiny model's program
# in 0.5-0.8x the time). The default tile stays in the model tests that do not pass this one: every preset and
# weight type through both bodies (tests/runtime/test_session.py, test_prefill.py, test_gguf_types.py), two families
# on every ISA path (test_activations.py), and the tests of the serving, tuning and disk-tier paths.
SMALL_TILE = (32, 256)
