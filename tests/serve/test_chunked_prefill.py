"""Chunked prefill on the real model: a prompt fed in prefill-block pieces (batch_start, then batch_extend) is bit
for bit one batch_start, and the engine reads a long prompt piece by piece between the decode steps of a running
stream, whose tokens stay m.generate's."""

import asyncio
import threading

import numpy as np
import pytest

import cflow
from cflow.errors import CflowError
from cflow.serve.backends import load_backend
from cflow.serve.engine import Engine
from cflow.serve.job import Job, Piece, SamplingParams
from cflow.serve.metrics import ServeMetrics

LONG = [(7 * i) % 250 + 1 for i in range(90)]


def test_batch_extend_equals_one_batch_start(tiny_path):
    with cflow.load(tiny_path, threads=1, max_batch=2, prefill_block=8) as m:
        block = m.prefill_block
        assert block == 8
        whole = m.batch_start(LONG, 0)
        piece = m.batch_start(LONG[:block], 1)
        for i in range(block, len(LONG), block):
            piece = m.batch_extend(LONG[i : i + block], 1)
        assert np.array_equal(whole, piece)
        for _ in range(3):  # the KV caches are the same too: the next tokens see the same past
            rows = m.batch_step([5, 5], [0, 1])
            assert np.array_equal(rows[0], rows[1])
        # continuing a slot past its context is refused with both numbers; the slot stays usable
        with pytest.raises(CflowError, match="does not fit the context"):
            m.batch_extend([1] * 40, 1)
        with pytest.raises(CflowError, match="empty prompt"):
            m.batch_extend([], 1)
        with pytest.raises(CflowError, match="slot 2 out of range"):
            m.batch_extend([1], 2)
        assert np.array_equal(m.batch_start(LONG, 1), whole)


class Recorder:
    """Passes a backend through and logs its prefill pieces and decode steps. hold_after: from that many decode
    steps on, a step waits for `go` to be set (so that a request submitted from the loop after a stream's first
    tokens finds it still decoding, however the threads are scheduled)."""

    def __init__(self, inner, hold_after: int | None = None):
        self.inner, self.slots, self.log = inner, inner.slots, []
        self.hold_after, self.go = hold_after, threading.Event()

    @property
    def model(self):
        return self.inner.model

    def start(self, slot, job):
        self.log.append(("start", slot, len(job.prompt_ids)))
        return self.inner.start(slot, job)

    def prefill(self, slot):
        left = self.inner.prefill(slot)
        self.log.append(("prefill", slot, left))
        return left

    def advance(self, slots):
        steps = sum(e[0] == "advance" for e in self.log)
        if self.hold_after is not None and steps >= self.hold_after:
            assert self.go.wait(60), "the held step was never let go"
        self.log.append(("advance", tuple(slots)))
        return self.inner.advance(slots)

    def stop(self, slot):
        self.inner.stop(slot)

    def close(self):
        self.inner.close()


def test_long_prompt_interleaves_with_a_running_stream(tiny_path, ref_tiny):
    be = Recorder(load_backend(tiny_path, threads=1, slots=2, prefill_block=8), hold_after=10)
    metrics = ServeMetrics()

    async def main():
        eng = Engine(be, max_queue=4, metrics=metrics)
        a = Job([1, 2, 3], SamplingParams(max_tokens=100, temperature=1.0, seed=5))
        b = Job(LONG, SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=6))
        eng.submit(a)
        texts = {a: [], b: []}
        async for ev in a.events():
            if isinstance(ev, Piece):
                texts[a].append(ev.text)
                if len(texts[a]) == 3:
                    eng.submit(b)  # a long prompt arrives while a is decoding (held at its 10th step till now)
                    be.go.set()
        async for ev in b.events():
            if isinstance(ev, Piece):
                texts[b].append(ev.text)
        await asyncio.to_thread(eng.close)
        return "".join(texts[a]), "".join(texts[b])

    ta, tb = asyncio.run(main())
    assert ta == "".join(f" {t}" for t in ref_tiny.generate([1, 2, 3], 100, temperature=1.0, seed=5))
    assert tb == "".join(f" {t}" for t in ref_tiny.generate(LONG, 30, temperature=0.9, top_p=0.9, seed=6))
    log = be.log
    slot_b = next(e[1] for e in log if e[0] == "start" and e[2] == len(LONG))
    slot_a = 1 - slot_b
    pieces = [i for i, e in enumerate(log) if e[:2] == ("prefill", slot_b)]
    assert [log[i][2] for i in pieces] == list(range(82, -1, -8)) + [0]  # 11 pieces of 8, then the last 2
    for i, j in zip(pieces, pieces[1:]):  # the running stream gets a token between every two pieces
        assert any(e[0] == "advance" and slot_a in e[1] for e in log[i + 1 : j]), log[i : j + 1]
    assert not any(e[0] == "advance" and slot_b in e[1] for e in log[: pieces[-1]])
    assert metrics.registry.get_sample_value("cflow_prompt_tokens_total") == 3 + len(LONG)


class _Req:
    """What a backend reads of a job."""

    def __init__(self, ids, params):
        self.prompt_ids, self.params = ids, params


def _decode_alone(be, slot, ids, params, n):
    left = be.start(slot, _Req(ids, params))
    while left:
        left = be.prefill(slot)
    out = [be.advance([slot])[0] for _ in range(n)]
    be.stop(slot)
    return out


def test_one_sequence_in_slot_0_runs_the_decode_step(tiny_path, ref_tiny):
    """BatchedSlots with one sequence decoding in slot 0 runs the single-sequence decode step (Session.step), in any
    other slot a one-slot batch_step (the multi-token program); both give m.generate's tokens. (Not detached:
    the steps run one after the other, as with the default threads; tests/serve/test_overlap.py has the rest.)"""
    be = load_backend(tiny_path, threads=1, slots=2, prefill_block=8, overlap=False)
    calls = {"step": 0, "batch_step": 0}
    m = be.model
    step, batch_step = m.session.step, m.batch_step

    def counting(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call

    m.session.step, m.batch_step = counting("step", step), counting("batch_step", batch_step)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=8)
        want = ref_tiny.generate(LONG[:20], 30, temperature=0.9, top_p=0.95, seed=8)
        assert _decode_alone(be, 0, LONG[:20], params, 30) == want
        assert calls == {"step": 29, "batch_step": 0}  # the first token is the prompt's
        assert _decode_alone(be, 1, LONG[:20], params, 30) == want
        assert calls == {"step": 29, "batch_step": 29}
        # two slots decoding: one batch_step for both
        for s in (0, 1):
            left = be.start(s, _Req([3, 4, 5], SamplingParams(max_tokens=10, temperature=0)))
            while left:
                left = be.prefill(s)
        be.advance([0, 1])
        be.advance([0, 1])
        assert calls == {"step": 29, "batch_step": 30}
    finally:
        be.close()
