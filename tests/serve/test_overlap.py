"""The server's overlap of its host work with the model's step (a detached session: Session.step_launch /
step_wait; BatchedSlots launching slot 0's next step before the token is handed out, on the Chooser's guess under
a grammar): the same logits and the same tokens as running each step in turn, whatever the request asks for and
whatever joins, stops or refuses in between."""

import asyncio

import numpy as np
import pytest

import cflow
from cflow.errors import RuntimeFault
from cflow.runtime import choice
from cflow.serve.backends import BatchedSlots, load_backend
from cflow.serve.job import Job, SamplingParams

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.mark.parametrize("threads", [1, 2])
def test_launched_steps_give_the_steps_bits(tiny_path, threads):
    """step_launch + step_wait is step(): the same logits, bit for bit, over a prompt and 40 greedy tokens (every
    thread of the step a worker: one, or two with their barriers); the session refuses launching without
    detached=True and waits for a step in flight before anything else."""
    rows = {}
    for detached in (False, True):
        with cflow.load(tiny_path, threads=threads, detached=detached, max_seq=64) as m:
            s = m.session
            out, tok = [s.prefill([1, 2, 3, 4, 5])], 7
            for _ in range(40):
                if detached:
                    s.step_launch(tok)
                    row = s.step_wait().copy()
                else:
                    row = s.step(tok).copy()
                out.append(row)
                tok = int(np.argmax(row))
            if detached:
                # a step dropped (stopped at a stage boundary with one thread): the position goes back and the
                # next step there gives the logits as if the dropped one had never run
                s.step_launch(3)
                s.step_drop()
                assert s.pos == 45 and not s.native.inflight
                s.step_launch(tok)
                out.append(s.step_wait().copy())
                # a step in flight: the next call waits for it (and its position counts)
                s.step_launch(tok)
                assert s.pos == 47 and s.native.inflight
                again = s.prefill([3])
                assert not s.native.inflight and s.pos == 48 and np.isfinite(again).all()
                s.step_launch(tok)  # closing with a step in flight waits for it
            else:
                with pytest.raises(RuntimeFault, match="detached=True"):
                    s.step_launch(tok)
                out.append(s.step(tok).copy())
            rows[detached] = np.stack(out)
    assert np.array_equal(rows[False], rows[True])


def test_a_guess_is_weighed_against_its_refusals(text_path):
    """Where first draws have been refused and a refusal costs many times what a guess saves, the Chooser does
    not guess a draw (a forced token it always gives; a kind of token never refused yet it guesses); with no
    cost it guesses every draw-first token."""
    pytest.importorskip("llguidance")
    from cflow.runtime import grammar

    with cflow.load(text_path, threads=1) as m:
        rows = _random_rows(60, m.session.config.vocab_size, seed=3)
        counts = {}
        for odds in (0.0, 1e9):
            c = choice.Chooser(0.8, seed=2, constraint=grammar.json_object(m.tokenizer), eos_id=min(m.eos_ids))
            n = 0
            for row in rows:
                refused_before = c._refused[c._after] > 0
                g = c.guess(row, odds=odds)
                forced = c._forced() is not None
                n += g is not None and not forced and (odds == 0.0 or refused_before)
                if c(row) in m.eos_ids:
                    break
            counts[odds] = n
            assert max(c._refused) > 0  # random rows: the grammar refuses many first draws
        assert counts[0.0] > 0 and counts[1e9] == 0


def _random_rows(n, vocab, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, vocab)) * 3).astype(np.float32)


@pytest.mark.parametrize("shape", ["json_object", "person", "gbnf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_guessing_changes_no_token(text_path, shape, temperature):
    """A Chooser asked to guess() before each call (and to prepare() after it, as the server does) draws the
    same tokens as one that is only called, over rows that the grammar refuses often."""
    pytest.importorskip("llguidance")
    from cflow.runtime import grammar

    with cflow.load(text_path, threads=1) as m:
        tok = m.tokenizer
        make = {"json_object": lambda: grammar.json_object(tok),
                "person": lambda: grammar.json_schema(tok, PERSON),
                "gbnf": lambda: grammar.grammar(tok, 'root ::= [A-Z] [a-z ,]{3,40} "." ')}[shape]
        vocab = m.session.config.vocab_size
        rows = _random_rows(120, vocab, seed=len(shape))
        seqs, guesses = [], 0
        for guessing in (False, True):
            c = choice.Chooser(temperature, seed=11, constraint=make(), eos_id=min(m.eos_ids))
            out = []
            for row in rows:
                if guessing:
                    g = c.guess(row)
                    guesses += g is not None
                t = c(row)
                out.append(t)
                if t in m.eos_ids:
                    break
                if guessing:
                    c.prepare()
            seqs.append(out)
        assert seqs[0] == seqs[1]
        assert guesses > 0


_LOOP = asyncio.new_event_loop()  # the jobs' (their events are not read here)


def _job(tok, ids, shape=None, eos=None, **kw):
    from cflow.runtime import grammar

    c = None
    if shape == "json_object":
        c = grammar.json_object(tok)
    elif shape == "person":
        c = grammar.json_schema(tok, PERSON)
    return Job(ids, SamplingParams(**kw), tokenizer=tok, constraint=c, eos_id=eos, loop=_LOOP)


def _run(be, jobs, join_at=None, stop_at=None):
    """Decode `jobs[0]` in slot 0 to its end; jobs[1] (if any) joins slot 1 after `join_at` tokens and runs with
    it; slot 0 stops after `stop_at` tokens. The tokens of each slot."""
    out = {0: [], 1: []}
    be.start(0, jobs[0])
    while be.prefill(0):
        pass
    left = {0: jobs[0].params.max_tokens}
    active = [0]
    while active:
        if join_at is not None and len(out[0]) == join_at and 1 not in left:
            be.start(1, jobs[1])
            while be.prefill(1):
                pass
            left[1] = jobs[1].params.max_tokens
            active.append(1)
        toks = be.advance(active)
        for s, t in zip(list(active), toks):
            assert not isinstance(t, BaseException), t
            if t is not None:
                out[s].append(t)
                left[s] -= 1
            if t is None or left[s] == 0 or (s == 0 and stop_at is not None and len(out[0]) == stop_at):
                be.stop(s)
                active.remove(s)
    return out


def test_a_detached_step_backing_off_runs_in_turn(tiny_path, text_path):
    """Under load (runtime/workers.py DetachedBackoff says so) a detached session's calls run in turn on the
    caller's thread, with the same bits as launched steps, and the server launches nothing ahead meanwhile."""
    rows = {}
    for backing in (False, True):
        with cflow.load(tiny_path, threads=1, detached=True, max_seq=64) as m:
            s = m.session
            if backing:
                s.native.detached_backoff.until = float("inf")
            assert s.in_turn() == backing
            out, tok = [s.prefill([1, 2, 3, 4, 5]).copy()], 7
            for _ in range(20):
                row = s.step(tok).copy() if backing else (s.step_launch(tok), s.step_wait())[1].copy()
                out.append(row)
                tok = int(np.argmax(row))
            assert s.solo_calls == (21 if backing else 0)
            rows[backing] = np.stack(out)
    assert np.array_equal(rows[False], rows[True])
    m = cflow.load(text_path, threads=1, detached=True)
    be = BatchedSlots(m)
    try:
        m.session.native.detached_backoff.until = float("inf")
        tok = m.tokenizer
        job = _job(tok, tok.encode("Once upon a time"), max_tokens=12, temperature=0.8, seed=5, eos=min(m.eos_ids))
        assert _run(be, [job])
        assert be.ahead_steps == 0
    finally:
        be.close()


def test_metrics_report_the_overlap_and_the_backoff(text_path):
    """/metrics' cflow_steps_ahead_total, cflow_steps_ahead_dropped_total, cflow_backoffs_total and
    cflow_calls_in_turn_total are the backend's and its session's counters: steps launched ahead while quiet, none
    and calls in turn once the step has backed off."""
    from cflow.serve.metrics import ServeMetrics

    m = cflow.load(text_path, threads=1, detached=True)
    be = BatchedSlots(m)
    metrics = ServeMetrics()
    metrics.watch_backend(be)

    def sample(name):
        lines = metrics.render().decode().splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))

    tok = m.tokenizer
    kw = dict(max_tokens=12, temperature=0.8, seed=5, eos=min(m.eos_ids))
    try:
        backoff = m.session.native.detached_backoff
        backoff.FACTOR = float("inf")  # quiet, whatever the load
        assert _run(be, [_job(tok, tok.encode("Once upon a time"), "json_object", **kw)])
        ahead = sample("cflow_steps_ahead_total")
        assert ahead == be.ahead_steps >= 5 and sample("cflow_steps_ahead_dropped_total") == be.ahead_dropped
        assert sample("cflow_backoffs_total") == 0 and sample("cflow_calls_in_turn_total") == 0
        backoff.trip()
        backoff.until = float("inf")
        assert _run(be, [_job(tok, tok.encode("The dog"), **kw)])
        assert sample("cflow_backoffs_total") == 1 and sample("cflow_calls_in_turn_total") >= 5
        assert sample("cflow_steps_ahead_total") == ahead
    finally:
        be.close()


@pytest.mark.parametrize("case", ["plain", "greedy", "logprobs", "json_object", "person", "join", "stop",
                                  "person@2", "cached"])
def test_overlapped_slots_give_the_same_tokens(text_path, case):
    """BatchedSlots over a detached model (slot 0's next step launched before its token is handed out, on the
    Chooser's guess under a grammar) against the same backend run step by step: the same tokens for plain,
    greedy, logprobs and constrained requests, with a second request joining mid-way (the step launched ahead is
    dropped and its token fed again with the batch), a request stopped mid-way, two threads (a dropped step runs
    to its end) and the prefix cache (what a stopped slot keeps, taken by the next request)."""
    pytest.importorskip("llguidance")
    from cflow.serve.prefix_cache import PrefixCache

    threads = 2 if case.endswith("@2") else 1
    case = case.split("@")[0]
    outs, counts = [], []
    for detached in (False, True):
        m = cflow.load(text_path, threads=threads, max_batch=2, detached=detached)
        if detached:  # steps launched ahead whatever the load (the back-off's policy is tested on its own)
            m.session.native.detached_backoff.FACTOR = float("inf")
        be = BatchedSlots(m, prefix_cache=PrefixCache(8 << 20) if case == "cached" else None)
        tok = m.tokenizer
        ids = tok.encode("Once upon a time")
        long_ids = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play in the park "
                              "with her friends. One day, she saw a big red ball under a tree. Lily")
        kw = dict(max_tokens=40, temperature=0.8, seed=5, eos=min(m.eos_ids))
        jobs = {"plain": [_job(tok, ids, **kw)],
                "greedy": [_job(tok, ids, max_tokens=40, temperature=0.0, eos=min(m.eos_ids))],
                "logprobs": [_job(tok, ids, logprobs=3, **kw)],
                "json_object": [_job(tok, ids, "json_object", **kw)],
                "person": [_job(tok, ids, "person", **kw)],
                "join": [_job(tok, ids, **kw), _job(tok, tok.encode("The dog"), "json_object", **kw)],
                "stop": [_job(tok, ids, "person", **kw)],
                "cached": [_job(tok, long_ids, **kw), _job(tok, long_ids, **kw)]}[case]
        try:
            out = _run(be, jobs[:1] if case == "cached" else jobs, join_at=10 if case == "join" else None,
                       stop_at=12 if case in ("stop", "cached") else None)
            if case == "cached":  # the second request starts from what the stopped one kept
                out["again"] = _run(be, jobs[1:])[0]
                out["reused"] = be.prefix_cache.hit_tokens
            counts.append((be.ahead_steps, be.ahead_dropped))
        finally:
            be.close()
        outs.append(out)
    assert outs[0] == outs[1]
    assert counts[0] == (0, 0) and counts[1][0] >= 10
    if case in ("person", "join", "stop", "cached"):  # a guess refused, a join or a stop: a step ahead dropped
        assert counts[1][1] > 0, counts
    if case == "cached":
        assert outs[1]["reused"] > 0


def test_load_backend_detaches_only_with_a_core_to_spare(text_path):
    import os

    be = load_backend(text_path, threads=1)
    try:
        assert be.detached == (len(os.sched_getaffinity(0)) > 1)
    finally:
        be.close()
    be = load_backend(text_path, threads=1, overlap=False)
    try:
        assert not be.detached and not be.model.session.detached
    finally:
        be.close()
