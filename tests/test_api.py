"""cflow.compile / cflow.load / CompiledModel and `cflow run`, end to end on tiny presets."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import cflow
from cflow.errors import CflowError
from cflow.ir import Interpreter
from cflow.models import from_preset


@pytest.fixture(scope="module")
def model():
    m = cflow.compile("preset:arch2_4_combined@tiny", quant="f32", threads=2)
    yield m
    m.close()


def test_generate_ids_matches_torch_greedy(model):
    ref = from_preset("arch2_4_combined", "tiny").generate([1, 2, 3], 12)[3:]
    got = model.generate([1, 2, 3], max_new_tokens=12, temperature=0)
    assert got == ref


def test_logits_match_interpreter_on_stored_weights(model):
    ids = [4, 8, 15, 16, 23, 42]
    ref = Interpreter(model.ir, kv=model.kv).prefill(ids)[-1]  # .ir reads the weights back from the file
    assert np.abs(model.logits(ids) - ref).max() <= 1e-4


def test_stream_and_sampling_are_seeded(model):
    a = list(model.stream([7, 7], max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3))
    b = model.generate([7, 7], max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert a == b and len(a) == 10


def test_compile_from_module_and_save_load(tmp_path):
    net = from_preset("arch3", "tiny", seed=5)
    m = cflow.compile(net, quant="q8", threads=1)
    m.save(tmp_path / "m.vflow")
    m2 = cflow.load(tmp_path / "m.vflow", threads=2, verify=True)
    assert m.generate([1, 2], 8) == m2.generate([1, 2], 8)
    assert m2.analysis().sequential_bytes > 0 and m2.schedule.n_stages > 1
    with torch.no_grad():
        assert int(net(torch.tensor([1, 2]))[-1].argmax()) == m.generate([1, 2], 1)[0]


def test_explicit_delays_warn_and_apply():
    with pytest.warns(UserWarning, match="changes the model's function"):
        m = cflow.compile("preset:arch1@tiny", delays=(1, 2), quant="f32", threads=1)
    assert m.session.header["delays"] == [1, 2]
    assert m.session.header["trained_delays"] == [0, 0]


def test_prompt_without_tokenizer(model):
    assert model.generate("1 2 3", max_new_tokens=4) == model.generate([1, 2, 3], max_new_tokens=4)
    with pytest.raises(CflowError, match="space-separated token ids"):
        model.generate("Once upon a time", max_new_tokens=2)


def test_cli_run_prints_ids_and_speed(tmp_path):
    out = tmp_path / "m.vflow"
    r = subprocess.run([sys.executable, "-m", "cflow.cli", "preset:arch1@tiny", "-o", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())",
                        "run", str(out), "--prompt", "1 2 3", "-n", "5", "--threads", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:3] == ["1", "2", "3"] and len(r.stdout.split()) == 8
    assert "tok/s" in r.stderr


def test_cli_run_rejects_corrupt_file(tmp_path):
    bad = tmp_path / "bad.vflow"
    bad.write_bytes(b"not a model at all" * 100)
    r = subprocess.run([sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())",
                        "run", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
