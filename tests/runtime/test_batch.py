"""Batched decode: B sequences in one pass over the weights equal B separate runs, slot by slot."""

import numpy as np
import pytest

import cflow
from cflow.compiler import compile_file
from cflow.errors import CflowError
from cflow.frontend.load import load_graph


@pytest.fixture(scope="module", params=["arch2_4_combined", "arch5_shared", "arch4_async_experts"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("batch") / f"{request.param}.vflow"
    compile_file(load_graph(f"preset:{request.param}@tiny"), p, "q4")
    return p


PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [200, 3, 17, 99]]


def _alone(m, prompt, n):
    """The reference: one sequence through the single-sequence API (logits after the prompt and each token)."""
    out = [m.logits(prompt).copy()]
    s = m.session
    for _ in range(n):
        out.append(s.step(int(np.argmax(out[-1]))).copy())
    return out


def test_batch_equals_separate_runs(path):
    with cflow.load(path, threads=2) as one:
        want = [_alone(one, p, 6) for p in PROMPTS]
    with cflow.load(path, threads=2, max_batch=4) as m:
        last = [m.batch_start(p, i) for i, p in enumerate(PROMPTS)]
        for i in range(4):
            assert np.array_equal(last[i], want[i][0])
        toks = [int(np.argmax(x)) for x in last]
        for k in range(6):
            out = m.batch_step(toks, [0, 1, 2, 3])
            for i in range(4):
                assert np.array_equal(out[i], want[i][k + 1]), (k, i)
            toks = [int(np.argmax(x)) for x in out]


def test_continuous_batching_refills_a_slot(path):
    with cflow.load(path, threads=1) as one:
        a, b, c = (_alone(one, p, 4) for p in PROMPTS[:3])
    with cflow.load(path, threads=1, max_batch=2) as m:
        la, lb = m.batch_start(PROMPTS[0], 0), m.batch_start(PROMPTS[1], 1)
        ta, tb = int(np.argmax(la)), int(np.argmax(lb))
        out = m.batch_step([ta, tb], [0, 1])
        assert np.array_equal(out[0], a[1]) and np.array_equal(out[1], b[1])
        lc = m.batch_start(PROMPTS[2], 0)  # slot 0 finished: a new request takes it, slot 1 goes on
        assert np.array_equal(lc, c[0])
        out = m.batch_step([int(np.argmax(lc)), int(np.argmax(out[1]))], [0, 1])
        assert np.array_equal(out[0], c[1]) and np.array_equal(out[1], b[2])
        out = m.batch_step([int(np.argmax(out[1]))], [1])  # a subset of the slots
        assert np.array_equal(out[0], b[3])


def test_generate_batch_equals_generate(path):
    with cflow.load(path, threads=2, max_batch=4) as m:
        want = [m.generate(p, max_new_tokens=10, stop=False) for p in PROMPTS]
        assert m.generate_batch(PROMPTS, max_new_tokens=10, stop=False) == want


def test_bad_batches_are_refused_and_the_model_stays_usable(path):
    with cflow.load(path, threads=1, max_batch=2) as m:
        m.batch_start([1, 2], 0)
        for tokens, slots, msg in (([], [], "at least one slot"), ([1, 2], [0], "one token per slot"),
                                   ([1], [2], "out of range"), ([1, 1], [0, 0], "appears twice"),
                                   ([9999], [0], "out of range")):
            with pytest.raises(CflowError, match=msg):
                m.batch_step(tokens, slots)
        with pytest.raises(CflowError, match="1..2 prompts"):
            m.generate_batch([[1]] * 3)
        assert np.isfinite(m.batch_step([3], [0])).all()
    with pytest.raises(CflowError, match="max_batch"):
        cflow.load(path, max_batch=0)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("slots") / "arch2_4_combined.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
    return p


def test_slot_never_started_or_released_is_refused(moe_path):
    with cflow.load(moe_path, threads=1) as one:
        want = one.logits(PROMPTS[1]).copy()
    with cflow.load(moe_path, threads=1, max_batch=2) as m:
        t = int(np.argmax(m.batch_start(PROMPTS[0], 0)))
        with pytest.raises(CflowError, match="step_batch: slot 1 holds no sequence .*batch_start"):
            m.batch_step([t, t], [0, 1])  # slot 1 was never started
        with pytest.raises(CflowError, match="batch_extend: slot 1 holds no sequence"):
            m.batch_extend([5], 1)
        m.batch_release(0)  # slot 0 finished
        for call in (lambda: m.batch_step([t], [0]), lambda: m.batch_extend([5], 0)):
            with pytest.raises(CflowError, match="slot 0 holds no sequence"):
                call()
        assert np.array_equal(m.batch_start(PROMPTS[1], 0), want)  # reuse through batch_start: a fresh sequence
        assert np.isfinite(m.batch_step([t], [0])).all()


def test_batch_above_max_batch_and_full_context_are_refused(moe_path):
    with cflow.load(moe_path, threads=1, max_batch=2, max_seq=16) as m:
        last = [m.batch_start([1] * 14, 0), m.batch_start([2, 3], 1)]
        toks = [int(np.argmax(x)) for x in last]
        with pytest.raises(CflowError, match="batch of 3 sequences exceeds the compiled maximum max_batch=2"):
            m.batch_step(toks + [4], [0, 1, 2])
        for _ in range(2):  # slot 0 reaches position 16, the end of its context
            toks = [int(np.argmax(r)) for r in m.batch_step(toks, [0, 1])]
        with pytest.raises(CflowError, match="context full in slot 0: position 16 reaches the maximum of 16"):
            m.batch_step(toks, [0, 1])
        with pytest.raises(CflowError, match="prompt of 1 tokens does not fit the context \\(0 left of 16\\)"):
            m.batch_extend([7], 0)
        assert np.isfinite(m.batch_step(toks[1:], [1])).all()  # the other slot goes on
        assert np.isfinite(m.batch_start([5, 6], 0)).all()  # and the full one can take a new prompt
        assert np.isfinite(m.batch_step([1, 2], [0, 1])).all()
