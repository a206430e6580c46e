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


def pytest_configure(config):
    # Compiled kernels go to a per-run cache, never the user's ~/.cache/cflow.
    import os
    import tempfile

    os.environ.setdefault("CFLOW_CACHE_DIR", tempfile.mkdtemp(prefix="cflow-test-cache-"))
