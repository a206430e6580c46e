"""Prompts through the multi-token body: the same logits, KV cache and continuation as token by token."""

import numpy as np
import pytest

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.runtime.session import Session

PRESETS = ["arch1", "arch2_4_combined", "arch3", "arch4_async_experts", "arch5_shared"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill")
    out = {}
    for name in PRESETS:
        for quant in ("q4", "f16") if name in ("arch2_4_combined", "arch5_shared") else ("q4",):
            out[name, quant] = d / f"{name}_{quant}.vflow"
            compile_file(load_graph(f"preset:{name}@tiny"), out[name, quant], quant)
    return out


def _greedy(s, logits, steps):
    """`steps` greedy decode steps after `logits`: each step's logits (copies)."""
    rest = [s.step(int(np.argmax(logits))).copy()]
    for _ in range(steps - 1):
        rest.append(s.step(int(np.argmax(rest[-1]))).copy())
    return rest


def _prompt(s, ids, steps=4, by_token=False):
    """The prompt from position 0 in session s, its last logits and `steps` greedy steps after it: in prompt blocks,
    or by_token one decode step a token (the reference a block must equal; the session's own decode steps, so it
    needs no program of its own)."""
    s.reset()
    if by_token:
        for t in ids:
            logits = s.step(int(t))
        logits = logits.copy()
    else:
        logits = s.prefill(ids)
    return logits, _greedy(s, logits, steps)


@pytest.mark.parametrize("name,quant", [(p, "q4") for p in PRESETS] + [("arch2_4_combined", "f16"),
                                                                          ("arch5_shared", "f16")])
def test_prefill_bit_identical_to_token_by_token(files, name, quant):
    ids = list(np.random.default_rng(5).integers(0, 256, 45))
    for threads in (1, 2):  # 45 tokens in blocks of 16: two full calls and a partial one; 1 and 2 threads
        with Session(str(files[name, quant]), threads=threads, prefill_block=16) as s:
            if threads == 1:
                want, want_rest = _prompt(s, ids, by_token=True)
            got, rest = _prompt(s, ids)
        assert np.array_equal(got, want), threads
        for a, b in zip(rest, want_rest):  # the KV cache the block wrote is the one decode continues from
            assert np.array_equal(a, b)


def test_prefill_matches_the_interpreter(files):
    path = files["arch2_4_combined", "q4"]
    ids = list(np.random.default_rng(6).integers(0, 256, 30))
    with cflow.load(path, threads=2) as m:
        got = m.logits(ids)
        ref = Interpreter(m.ir, act_quant="q8", kv=m.kv).prefill(ids)[-1]
    assert np.abs(got - ref).max() < 1e-2
    assert int(np.argmax(got)) == int(np.argmax(ref))


def test_prefill_errors_leave_the_model_usable(files):
    with Session(str(files["arch1", "q4"]), threads=1) as s:
        with pytest.raises(cflow.CflowError, match="out of range"):
            s.prefill([1, 2, 9999])
        with pytest.raises(cflow.CflowError, match="empty prompt"):
            s.prefill([])
        with pytest.raises(cflow.CflowError, match="does not fit the context"):
            s.prefill([1] * (s.max_seq + 1))
        s.reset()
        assert np.isfinite(s.prefill([1, 2, 3])).all()


def test_two_plane_activations_in_blocks(files):
    """activations='q8x2' on an MoE with a shared expert (a prompt block groups the experts' tokens and gathers their
    two-plane inputs): the block equals token by token bit for bit, and both the interpreter's twin."""
    path, ids = files["arch5_shared", "q4"], list(np.random.default_rng(7).integers(0, 256, 21))
    with cflow.load(path, threads=2, prefill_block=16, activations="q8x2") as m:
        want, _ = _prompt(m.session, ids, steps=1, by_token=True)
        got, _ = _prompt(m.session, ids, steps=1)
        ref = Interpreter(m.ir, act_quant="q8x2", kv=m.kv).prefill(ids)[-1]
    assert np.array_equal(got, want)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max() and int(np.argmax(got)) == int(np.argmax(ref))
