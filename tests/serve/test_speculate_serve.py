"""Speculative decoding in the server's backends: a sequence decoding alone drafts (prompt lookup or a draft
model), with others it steps in the batch; its tokens are m.generate's either way, greedy and sampled."""

import numpy as np
import pytest

from cflow.errors import CflowError
from cflow.serve.backends import BatchedSlots, load_backend
from cflow.serve.job import SamplingParams

REP = [9, 8, 7, 6, 5, 4] * 5  # a repetitive prompt: prompt lookup has drafts to offer


class _Req:
    def __init__(self, ids, params):
        self.prompt_ids, self.params = ids, params


def _start(be, slot, ids, params):
    left = be.start(slot, _Req(ids, params))
    while left:
        left = be.prefill(slot)


def _tokens(out):
    assert not any(isinstance(t, BaseException) for t in out), out
    return out


@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_alone_then_batched_gives_generate_tokens(tiny_path, ref_tiny, kind, temperature):
    extra = {"draft": tiny_path} if kind == "draft" else {}
    be = load_backend(tiny_path, threads=1, slots=2, prefill_block=8, speculate=kind, **extra)
    assert isinstance(be, BatchedSlots)
    try:
        pa = SamplingParams(max_tokens=40, temperature=temperature, top_k=8, seed=3)
        pb = SamplingParams(max_tokens=10, temperature=0.0)
        _start(be, 0, REP, pa)
        got = _tokens([be.advance([0])[0] for _ in range(15)])  # alone: drafting passes
        spec = be._spec[0].spec
        assert spec.passes > 0 or temperature  # greedy repeats itself here; sampled text may offer no drafts
        _start(be, 1, REP[:9], pb)  # another sequence joins: slot 0 steps in the batch
        both = [_tokens(be.advance([0, 1])) for _ in range(10)]
        got += [a for a, _ in both]
        got += _tokens([be.advance([0])[0] for _ in range(15)])  # alone again
        be.stop(0)
        be.stop(1)
    finally:
        be.close()
    assert len(got) == 40
    if kind == "draft" and temperature:  # the rejection rule: distributed as sampling, not the same draws
        ctx = list(REP)
        for t in got:
            assert t in np.argsort(-ref_tiny.logits(ctx), kind="stable")[:8]
            ctx.append(t)
    else:
        opts = dict(temperature=temperature, top_k=8, seed=3) if temperature else {}
        assert got == ref_tiny.generate(REP, 40, stop=False, **opts)
    assert [b for _, b in both] == ref_tiny.generate(REP[:9], 10, stop=False)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_request_with_rules_decodes_without_drafting(tiny_path, ref_tiny, slots):
    """logprobs, penalties or a bias: no Speculator for that request (its tokens are the library's Chooser's)."""
    from cflow.runtime.choice import Chooser

    be = load_backend(tiny_path, threads=1, slots=slots, prefill_block=8, speculate="ngram")
    try:
        p = SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=0.5, logprobs=1)
        _start(be, 0, REP, p)
        got = _tokens([be.advance([0])[0] for _ in range(20)])
        assert not getattr(be, "_spec", {})  # BatchedSlots made no Speculator
        be.stop(0)
    finally:
        be.close()
    assert got == ref_tiny.generate(REP, 20, stop=False, sampler=Chooser(presence_penalty=0.5, prompt_ids=REP))


def test_refused_where_it_cannot_work(tiny_path):
    with pytest.raises(CflowError, match="weights in RAM"):
        load_backend(tiny_path, threads=1, slots=1, speculate="ngram", experts="disk")
    with pytest.raises(CflowError, match="needs a draft model"):
        load_backend(tiny_path, threads=1, slots=2, speculate="draft")
