import os
import warnings

import numpy as np
import pytest


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _no_delay_warnings_leak():
    # Delay rewrites warn by design; tests that care assert it with pytest.warns.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"cflow\.passes")
        yield


_MADE: list[str] = []  # temporary directories this process made for the run


def pytest_configure(config):
    # Compiled kernels go to a per-run cache, never the user's ~/.cache/cflow. Set before pytest-xdist starts its
    # workers, so they inherit it: a kernel one worker compiled is a cache hit for the other.
    # The process that makes them (the controller, or a run without xdist) removes them at the end: a run's caches
    # hold ~0.5 GB of objects and programs.
    import tempfile

    for var, prefix in (("CFLOW_CACHE_DIR", "cflow-test-cache-"),
                        # files built once per run and read by every worker (tests/_shared.py), likewise
                        ("CFLOW_TEST_SHARED", "cflow-test-shared-")):
        if var not in os.environ:
            os.environ[var] = tempfile.mkdtemp(prefix=prefix)
            _MADE.append(os.environ[var])
    # No per-host kernel search in the suite (seconds per kernel shape, and the choice would depend on the
    # load): tests/codegen/test_tune.py turns it on where it tests it.
    os.environ.setdefault("CFLOW_TUNE", "off")
    # One xdist worker per core: the libraries' own thread pools (torch's OpenMP, OpenBLAS under NumPy) at one
    # thread, or the two workers' pools oversubscribe the cores and spin while they wait (~10% more CPU on the
    # torch and ONNX tests). The workers inherit it; cflow's own threads (threads=...) are not these.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")


def pytest_unconfigure(config):
    import shutil

    for path in _MADE:
        shutil.rmtree(path, ignore_errors=True)


# --- pytest-xdist (pyproject.toml: -n auto --dist loadfile --no-loadscope-reorder) -----------------------------------
# One worker per usable core, whole files per worker (module fixtures compile once), the longest files first.

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """-n auto: the cores this process may run on, as the runtime's default thread count counts them (xdist would
    count physical cores when psutil is installed: 1 on a 2-vCPU machine). PYTEST_XDIST_AUTO_NUM_WORKERS wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0))


# Files sharing a session fixture too costly to build on every worker run on one worker, as one unit:
# tests/frontend/conftest.py's onnx_files (eight ONNX exports, ~25 s). pytest_collection_modifyitems checks the list.
SHARED = {"tests/frontend/test_cli.py": "onnx_files", "tests/frontend/test_onnx.py": "onnx_files"}
# Units holding a few long tests, started first so that no worker is left finishing one of them alone at the end;
# the rest follow by number of tests, largest first (xdist's own order).
LONG_FIRST = ("tests/runtime/test_families.py", "tests/runtime/test_fuzz_harness.py", "onnx_files",
              "tests/codegen/test_matmat.py", "tests/serve/test_ray_serve.py", "tests/runtime/test_prefill.py",
              "tests/runtime/test_expert_tier.py", "tests/runtime/test_session.py",
              "tests/passes/test_delays_families.py", "tests/frontend/test_onnx_refusals.py", "tests/test_cli_edges.py",
              "tests/serve/test_server.py")


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the SHARED files as one unit (xdist_group marks cannot do it: xdist 3.8 renames the
    node ids for them the way pytest < 9 stored them, and pytest 9 ignores it)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Units(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return _Units(config, log)


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # the order below is for the xdist scheduler (in-process runs keep theirs)
        return
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if "onnx_files" in item.fixturenames and path not in SHARED:
            raise pytest.UsageError(f"{path} uses onnx_files: add it to SHARED in tests/conftest.py")
    size: dict[str, int] = {}
    for item in items:
        size[_unit(item.nodeid)] = size.get(_unit(item.nodeid), 0) + 1
    rank = {u: (LONG_FIRST.index(u) if u in LONG_FIRST else len(LONG_FIRST), -n) for u, n in size.items()}
    items.sort(key=lambda item: rank[_unit(item.nodeid)])  # stable: a file keeps its own order
