"""Speculative decoding is exact: greedy output identical to plain decode on every preset and family (drafts
that stand and drafts that fall, in every position of a pass), sampled tokens distributed as plain sampling."""

import numpy as np
import pytest

import cflow
from cflow.compiler import compile_file
from cflow.frontend import from_torch
from cflow.frontend.load import load_graph
from cflow.runtime import generation
from cflow.runtime import speculate as sp
from cflow.runtime.sampling import Sampler
from tests.frontend._models import hf_model

PRESETS = ["arch1", "arch2_4_combined", "arch3", "arch4_async_experts", "arch5_shared"]
FAMILIES = ["llama", "gemma3", "qwen2_moe", "mixtral"]


class Oracle:
    """Drafts the known greedy continuation with every `wrong`-th drafted token replaced: both verdicts, at
    every position of a pass, whatever the weights (random weights make prompt lookup rarely right)."""

    deterministic = True

    def __init__(self, continuation: list[int], wrong: int, vocab: int):
        self.cont, self.wrong, self.vocab = continuation, wrong, vocab
        self.n = self.made = 0

    def start(self, ids):
        self.base, self.n = len(ids), 0

    def accept(self, ids, index=True):
        self.n += len(ids)

    def propose(self, k):
        out = []
        for t in self.cont[self.n : self.n + k]:
            self.made += 1
            out.append((t + 1) % self.vocab if self.made % self.wrong == 0 else t)
        return out, None

    def finish(self, learn=True):
        pass


class Cheap(sp.Costs):
    """Costs under which drafting always pays: every pass drafts (the decision is the controller's test)."""

    def pass_steps(self, k):
        return 0.1

    def gain(self, k, tokens):
        return 10.0 * tokens


def _always_drafting():
    costs = Cheap()
    costs.step, costs.plain_rate = 1.0, 1e-9  # plain decode measured hopelessly slow: drafting always wins
    return costs


def _spec_greedy(m, ids, n, drafter):
    s = m.session
    with m._generation():
        logits = m._feed(s, ids, reuse=False)
        spec = sp.Speculation(_always_drafting())
        return list(generation.speculative(s, logits, Sampler(), drafter, spec, list(ids), n, lambda: None,
                                           lambda rows: None)), spec


def _check_exact(path, vocab):
    ids = [int(i) for i in np.random.default_rng(1).integers(3, vocab, 20)]
    with cflow.load(path, threads=2, prefill_block=16) as m:
        want = m.generate(ids, 40, stop=False)
        for wrong in (2, 3, 5):
            got, spec = _spec_greedy(m, ids, 40, Oracle(want, wrong, vocab))
            assert got == want, wrong
            assert 0 < spec.accepted < spec.proposed
        # prompt lookup through the public surface, a repetitive prompt so that drafts are made
        rep = (ids[:7] * 4)[:26]
        assert m.generate(rep, 30, stop=False, speculate="ngram") == m.generate(rep, 30, stop=False)
        assert m.speculation is None or m.speculation.passes >= 0


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_identical_on_every_preset(tmp_path, name):
    p = tmp_path / "m.vflow"
    compile_file(load_graph(f"preset:{name}@tiny"), p, "q4")
    _check_exact(p, 256)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identical_on_every_family(tmp_path, family):
    net = hf_model(family)
    p = tmp_path / "m.vflow"
    c = compile_file(from_torch(net), p, "q4")
    _check_exact(p, c.graph.config.vocab_size)


def test_ngram_drafter_proposes_what_followed_the_longest_suffix():
    d = sp.NgramDrafter()
    d.start([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert d.propose(3)[0] == [4, 9, 2]  # "2 3" last followed by 5, "1 2 3" by 4: the longer match wins
    d2 = sp.NgramDrafter(max_n=2)
    d2.start([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3])
    assert d2.propose(3)[0] == [5, 7, 1]
    d.start([1, 2, 3, 4, 9, 8, 1, 2, 3])
    assert d.propose(2)[0] == [4, 9]
    d.accept([4])
    assert d.propose(2)[0] == [9, 8]
    d.start([5, 6, 7])
    assert d.propose(4)[0] == []


def test_ngram_table_is_shared_and_bounded():
    table = sp.NgramTable(entries=8)
    a = sp.NgramDrafter(table)
    a.start([10, 11, 12, 13, 14, 15])
    a.finish()
    b = sp.NgramDrafter(table)
    b.start([99, 10, 11, 12])  # no earlier occurrence in b's own text: the table's continuation
    assert b.propose(2)[0] == [13, 14]
    table.learn(list(range(100, 120)))
    assert len(table) == 8
    assert table.get((10, 11, 12)) == ()


def _controller(plain_rate=1.0):
    """A Speculation on a fake clock (now[0]) whose plain decode makes plain_rate tokens per time unit."""
    now = [0.0]
    costs = sp.Costs(k_max=8)
    costs.plain_rate = plain_rate
    spec = sp.Speculation(costs, clock=lambda: now[0])
    return spec, costs, now


def _pass(spec, now, k, stood, seconds):
    spec.checked(k, stood, seconds)
    spec.emitted(stood + 1)
    now[0] += seconds


def test_controller_drafts_what_pays_and_pauses_when_nothing_does():
    spec, costs, now = _controller()
    assert spec.length() == 0  # the first plain step is timed
    spec.stepped(1.0)
    now[0] += 1.0
    for k in range(1, 9):  # a pass costs one step and a little more per drafted token
        costs.check[k] = 1.0 + 0.05 * k
    for _ in range(20):  # every draft stands: long drafts pay most
        k = spec.length()
        assert k > 0
        _pass(spec, now, k, k, 1.0 + 0.05 * k)
    assert spec.length() == 8 and spec.rate > 0.9
    for _ in range(40):  # every draft falls: one token per pass of more than a step
        k = spec.length()
        if k == 0 and spec.pause:
            break
        if k == 0:  # a plain step due to be timed
            spec.stepped(1.0)
            now[0] += 1.0
            continue
        _pass(spec, now, k, 0, 1.0 + 0.05 * k)
    assert spec.pause > 0 and spec.pauses == 1
    while spec.pause:
        assert spec.length() == 0
    k = spec.length()
    assert 0 < k <= 2  # after the pause, one short pass probes the acceptance
    for _ in range(40):  # still nothing stands: a second pause, twice as long
        if k:
            _pass(spec, now, k, 0, 1.0 + 0.05 * k)
        k = spec.length()
        if k == 0 and spec.pause:
            break
    assert spec.pauses == 2 and spec.pause >= 2 * sp.PAUSE_STEPS - 1
    fresh = sp.Speculation(costs)
    assert fresh.pause > 0 and fresh.probe  # the model's losses carry over: a new stream starts paused


def test_controller_believes_the_clock_over_its_cost_model():
    """The cost model says drafting pays (passes timed cheap), the stream's tokens per second say it does not
    (the time goes elsewhere: a tiny model's per-call work): after one window, a pause."""
    spec, costs, now = _controller(plain_rate=1.0)
    costs.stepped(1.0)
    for k in range(1, 9):
        costs.check[k] = 0.5
    paused = False
    for _ in range(30):
        k = spec.length()
        if k == 0:
            paused = spec.pause > 0
            break
        _pass(spec, now, k, k // 2, 0.5)
        now[0] += 10.0  # where the stream's time really went
    assert paused and spec.pauses == 1


def test_costs_and_best_length():
    slow = sp.Costs()
    slow.step = 1.0
    slow.check[1] = 3.0  # checking costs three steps (a tiny model's per-call work)
    s2 = sp.Speculation(slow)
    s2.stood_w, s2.fell_w, s2._best = 9.0, 1.0, None  # nine drafts in ten stand: only long drafts pay
    assert s2.best()[0] == 8 and s2.best()[1] > 1.0
    s2.stood_w, s2.fell_w, s2._best = 1.0, 1.0, None  # one in two: nothing pays
    assert s2.best()[1] < 1.0


def _chi2_ok(counts, p, trials):
    keep = p * trials >= 5
    exp = p[keep] * trials
    stat = float((((counts[keep] - exp) ** 2) / exp).sum())
    dof = int(keep.sum()) - 1
    return stat < dof + 6 * np.sqrt(2 * dof)  # far beyond the 99.9th percentile of chi2(dof)


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_tokens_are_distributed_as_plain_sampling(with_q):
    """The rejection rule over many draws: the first emitted token ~ p0, and the second, when the first draft
    stood, ~ p1 (deterministic drafts, and drafts drawn from a model's q)."""
    rng = np.random.default_rng(0)
    V = 12
    rows = rng.normal(0, 1.5, (3, V)).astype(np.float32)
    smp = Sampler(temperature=0.8, top_k=9, seed=7)
    p0, p1 = smp.probabilities(rows[0]), smp.probabilities(rows[1])
    q_src = Sampler(temperature=1.0, seed=8)
    qs = [q_src.probabilities(rng.normal(0, 1.0, V)) for _ in range(2)]
    trials = 30000
    first, second = np.zeros(V), np.zeros(V)
    d1 = int(np.argmax(p0))
    for _ in range(trials):
        drafts = ([int(q_src.rng.choice(V, p=qs[0])), int(q_src.rng.choice(V, p=qs[1]))] if with_q else [d1, 4])
        stood, nxt = sp.verify(rows, drafts, qs if with_q else None, smp, sp.Uniforms(smp), 0)
        tok0 = drafts[0] if stood >= 1 else nxt
        first[tok0] += 1
        if stood >= 1 and drafts[0] == d1:
            second[drafts[1] if stood >= 2 else nxt] += 1
    assert _chi2_ok(first, p0, trials)
    assert _chi2_ok(second, p1, int(second.sum()))


def test_sampled_prompt_lookup_is_plain_sampling_token_for_token(tmp_path):
    """Each generated position draws with its own uniform: with deterministic drafts the output is plain
    sampling's for the same seed, whatever was drafted, stood or fell (and whatever the shared table holds)."""
    p = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
    with cflow.load(p, threads=1, prefill_block=16) as m:
        from cflow.runtime.speculate import Drafting

        m._drafting = Drafting()
        m._drafting.costs["ngram"] = _always_drafting()  # a tiny model, where drafting does not pay: make it draft
        ids = [5, 6, 7, 8] * 6
        passes = 0
        for seed in range(4):
            opts = dict(temperature=0.9, top_k=5, seed=seed, stop=False)
            want = m.generate(ids, 24, **opts)
            assert m.generate(ids, 24, speculate="ngram", **opts) == want
            passes += m.speculation.passes
            assert m.generate(ids, 24, speculate="ngram", **opts) == want  # the table now knows this text
            passes += m.speculation.passes
        assert passes > 0


def test_bad_requests(tmp_path):
    p = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch1@tiny"), p, "q4")
    with cflow.load(p, threads=1) as m:
        with pytest.raises(cflow.CflowError, match="speculate must be"):
            m.generate([1, 2], 4, speculate="medusa")
        with pytest.raises(cflow.CflowError, match="needs a draft model"):
            m.generate([1, 2], 4, speculate="draft")
    with cflow.load(p, threads=1, prefill_block=1) as m:
        with pytest.raises(cflow.CflowError, match="multi-token body"):
            m.generate([1, 2], 4, speculate="ngram")


def test_draft_model_greedy_identical(tmp_path):
    """A draft model of the same vocabulary: itself (every draft stands) and another preset (most fall)."""
    paths = {}
    for name in ("arch2_4_combined", "arch3"):
        paths[name] = tmp_path / f"{name}.vflow"
        compile_file(load_graph(f"preset:{name}@tiny"), paths[name], "q4")
    ids = [int(i) for i in np.random.default_rng(2).integers(3, 256, 18)]
    for draft in ("arch2_4_combined", "arch3"):
        with cflow.load(paths["arch2_4_combined"], threads=1, prefill_block=16, draft=paths[draft]) as m:
            want = m.generate(ids, 30, stop=False)
            got = m.generate(ids, 30, stop=False, speculate="draft")
            assert got == want
            spec = m.speculation
            assert spec.passes > 0
            if draft == "arch2_4_combined":
                assert spec.accepted == spec.proposed


def test_cflow_run_speculate(tmp_path, capsys):
    """`cflow run --speculate ngram` prints the same tokens as without, then the acceptance; bad combinations
    are one clear error each."""
    from cflow.cli import cflow_main

    p = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
    prompt = " ".join(["5 6 7 8 9"] * 5)
    outs = []
    for extra in ([], ["--speculate", "ngram"], ["--speculate", "draft", "--draft", str(p)]):
        assert cflow_main(["run", str(p), "-p", prompt, "-n", "24", "--threads", "1", "--no-stop", *extra]) == 0
        cap = capsys.readouterr()
        outs.append(cap.out)
        if extra:
            assert f"speculation ({extra[1]}):" in cap.err and "drafted tokens accepted" in cap.err
    assert outs[0] == outs[1] == outs[2]
    for argv, needle in ((["--draft", str(p)], "give both"), (["--speculate", "draft"], "needs a draft model"),
                         (["--speculate", "ngram", "--weights-on-disk"], "weights in RAM")):
        assert cflow_main(["run", str(p), "-p", "1 2", *argv]) != 0
        assert needle in capsys.readouterr().err


def test_gain_counts_the_work_around_each_token():
    """A tiny model: a step of 65 us in 77 us per token of plain decode; a pass checking 8 drafts takes 560 us.
    Nine tokens per pass are 1.045x by steps alone, 1.037x with the 12 us of work around each token; a gain
    that thin is within what the model leaves out (the calls between passes), so it is not drafted (PAY)."""
    c = sp.Costs()
    c.step, c.check[8] = 65e-6, 560e-6
    by_steps = c.gain(8, 9.0)
    c.plain_rate = 1 / 77e-6
    assert 1.0 < c.gain(8, 9.0) < by_steps < sp.PAY


def test_sharing_cores_holds_threads_only_for_two_models():
    class Native:
        hold_threads = False

    class S:
        def __init__(self):
            self.native = Native()

    a, b = S(), S()
    with generation.sharing_cores(a, None):
        assert not a.native.hold_threads  # a model alone keeps its load back-off
    with generation.sharing_cores(a, b):
        assert a.native.hold_threads and b.native.hold_threads
    assert not a.native.hold_threads and not b.native.hold_threads


def test_set_draft_closes_only_the_draft_load_opened(tmp_path):
    p = tmp_path / "m.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4")
    m = cflow.load(p, threads=1, draft=p)
    opened = m.draft
    other = cflow.load(p, threads=1)
    m.set_draft(other)
    assert opened._closed and m.draft is other
    m.close()
    assert not other._closed  # the caller's draft stays the caller's
    other.close()
