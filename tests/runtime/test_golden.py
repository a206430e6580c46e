"""Files stay loadable: the committed tests/golden/tiny_q4.vflow, written by cflow 0.1.0 (format 1, plan 1),
loads, holds the same numbers, and decodes like the reference interpreter on them.

If this fails after a change, files users already compiled stop loading. Keep them loading, or bump
PLAN_VERSION / VERSION (cflow/runtime/format/spec.py) so that they fail with "compiled by cflow X (format N,
plan P); recompile with cflowc", keep this file as one that must fail that way, and add a new golden file
(tests/golden/make_golden_vflow.py). Never regenerate this one to make the test pass.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import cflow
from cflow.ir import Interpreter
from cflow.runtime.format import FileReader

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
FILE, EXPECTED = GOLDEN / "tiny_q4.vflow", GOLDEN / "tiny_q4.json"


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / FILE.name  # a copy: nothing may touch the committed file
    shutil.copyfile(FILE, path)
    m = cflow.load(path, threads=1, verify=True, kv="f32")  # the committed logits were made with an f32 KV cache
    yield m, json.loads(EXPECTED.read_text())
    m.close()


def test_golden_file_is_the_one_committed():
    with FileReader(FILE) as r:
        h = r.header
        r.verify()
    assert (h["cflow_version"], h["format_version"], h["plan_version"]) == ("0.1.0", 1, 1)
    assert h["config"]["name"] == "golden_tiny" and h["quant"] == "q4" and h["tile"] == [16, 32]


def test_golden_file_loads_and_holds_the_same_numbers(golden):
    m, want = golden
    ref = Interpreter(m.ir, act_quant="q8").run(want["prompt"])[-1]  # the weights as unpacked from the file
    assert np.abs(ref - np.array(want["interpreter_logits"], np.float32)).max() <= 1e-4  # BLAS summation order


def test_golden_file_decodes(golden):
    m, want = golden
    got = m.logits(want["prompt"])
    assert np.abs(got - np.array(want["interpreter_logits"], np.float32)).max() <= 2e-2  # int8 activations
    assert len(m.generate(want["prompt"], max_new_tokens=4, stop=False)) == 4
