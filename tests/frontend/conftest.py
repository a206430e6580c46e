"""Shared fixtures. ONNX export costs ~3 s of CPU per layer, so every file the tests need is exported once per
session: on the xdist worker that runs the files using them (tests/conftest.py: SHARED), or, in a run without
workers, split between this process and one spawned worker (the machine has 2 cores; under xdist the other core
has the other worker, and a spawned process would only add its imports). The arch2_4_combined preset's export is
shared with tests/frontend/test_onnx_determinism.py and the fuzz harness's test (tests/_shared.py)."""

import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest

from tests._shared import arch24_tiny_onnx

from ._models import custom_pipeline_native, export_task, exported_hf_model

WORKER_JOBS = ("qwen2_moe", "qwen2", "llama3")
LOCAL_JOBS = ("knobs", "llama", "mistral", "mixtral")


@pytest.fixture(scope="session")
def onnx_files(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("onnx")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        for key in WORKER_JOBS + LOCAL_JOBS:
            export_task(key, str(out))
    else:
        with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(export_task, key, str(out)) for key in WORKER_JOBS]
            for key in LOCAL_JOBS:
                export_task(key, str(out))
            for f in futures:
                f.result()
    shutil.copyfile(arch24_tiny_onnx(), out / "arch2_4_combined.onnx")  # `cflow export-onnx`, once per run
    return out


@pytest.fixture(scope="session")
def hf_onnx(onnx_files):
    """family -> (the HF model, its exported .onnx)."""
    return lambda family: (exported_hf_model(family), onnx_files / f"{family}.onnx")


@pytest.fixture(scope="session")
def knobs_onnx(onnx_files):
    return custom_pipeline_native(), onnx_files / "knobs.onnx"


@pytest.fixture(scope="session")
def arch24_onnx(onnx_files):
    """preset:arch2_4_combined@tiny exported by `cflow export-onnx`."""
    return onnx_files / "arch2_4_combined.onnx"
