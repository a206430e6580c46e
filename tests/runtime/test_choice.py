"""The Chooser: without rules exactly the Sampler; each rule against a direct NumPy computation of its definition;
logprobs the model's own log-softmax (m.logits) at every generated position; the constraint hook; seeds; and
CompiledModel.generate(sampler=...)."""

import numpy as np
import pytest

import cflow
from cflow.errors import CflowError
from cflow.runtime.choice import Chooser
from cflow.runtime.sampling import Sampler
from tests.runtime.test_sampling import reference

R = np.random.default_rng(11)
ROWS = [(R.standard_normal(700) * 2.5).astype(np.float32) for _ in range(30)]


def softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph

    path = tmp_path_factory.mktemp("choice") / "tiny.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4")
    with cflow.load(str(path), threads=1) as m:
        yield m


@pytest.mark.parametrize("opts", [dict(), dict(temperature=0.8), dict(temperature=1.3, top_k=40),
                                  dict(temperature=0.7, top_p=0.9), dict(temperature=1.0, top_k=5, top_p=0.5)])
def test_without_rules_it_is_the_sampler(opts):
    a, b = Chooser(**opts, seed=5), Sampler(**opts, seed=5)
    assert a.plain and a.greedy == b.greedy
    assert [a(x) for x in ROWS] == [b(x) for x in ROWS]
    assert [a.draw(x, 0.37) for x in ROWS] == [b.draw(x, 0.37) for x in ROWS]
    np.testing.assert_array_equal(a.probabilities(ROWS[0]), b.probabilities(ROWS[0]))
    assert a.take(a(ROWS[0])) is None  # no logprobs asked: nothing recorded


def test_seeds_reproduce_and_differ():
    runs = [[Chooser(1.0, seed=s, presence_penalty=0.5)(x) for x in ROWS] for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def _drive(ch, tokens, vocab=700):
    """Make `ch` choose `tokens` (rows peaked on each: no rule here moves a logit by 1000)."""
    for t in tokens:
        x = np.zeros(vocab, np.float32)
        x[t] = 1000.0
        assert ch(x) == t


def test_logit_bias_is_added():
    x = ROWS[1]
    bias = {3: 2.5, 10: -100, 699: 7.0}
    ch = Chooser(0.9, logit_bias=bias)
    want = x.astype(np.float64)
    for i, b in bias.items():
        want[i] += b
    np.testing.assert_allclose(ch.probabilities(x), reference(want, 0.9), rtol=1e-6, atol=1e-12)
    assert Chooser(0.0, logit_bias={42: 100})(x) == 42  # greedy: +100 wins


def test_repetition_penalty_over_the_window():
    prompt = [1, 2, 3, 2, 50]
    for window in (64, 3, -1):
        ch = Chooser(1.0, seed=0, repetition_penalty=1.7, repetition_window=window, prompt_ids=prompt)
        _drive(ch, [7, 8])
        seq = prompt + [7, 8]
        seen = set(seq if window == -1 else seq[-window:])
        x = ROWS[2].copy()
        x[list(seen)] = [(-1) ** i * 1.5 for i in range(len(seen))]  # both signs among the penalised
        want = x.astype(np.float64)
        for i in seen:
            want[i] = want[i] / 1.7 if want[i] > 0 else want[i] * 1.7
        np.testing.assert_allclose(ch.probabilities(x), reference(want, 1.0), rtol=1e-6, atol=1e-12)
    off = Chooser(1.0, repetition_penalty=1.7, repetition_window=0, prompt_ids=prompt)
    np.testing.assert_allclose(off.probabilities(ROWS[2]), reference(ROWS[2], 1.0), rtol=1e-6, atol=1e-12)


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    ch = Chooser(1.0, seed=0, frequency_penalty=0.6, presence_penalty=1.1, prompt_ids=[5, 5, 5])
    gen = [9, 9, 9, 4, 600]
    _drive(ch, gen)
    x = ROWS[3]
    want = x.astype(np.float64)
    for t in set(gen):
        c = gen.count(t)
        want[t] -= c * 0.6 + (c > 0) * 1.1  # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
    np.testing.assert_allclose(ch.probabilities(x), reference(want, 1.0), rtol=1e-6, atol=1e-12)
    greedy = Chooser(0.0, presence_penalty=2.0)  # a strong presence penalty: no token twice here
    row = np.zeros(10, np.float32)
    row[3], row[4] = 1.0, 0.5
    assert [greedy(row) for _ in range(4)] == [3, 4, 0, 1]  # then the unused zeros, lowest id first


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 0.9), (1.0, 20, 1.0)])
def test_min_p_drops_the_improbable(t, k, p):
    x = ROWS[4]
    for min_p in (0.01, 0.2, 0.9):
        q = softmax(x.astype(np.float64) / t)  # the definition: probability below min_p x the best's is dropped
        kept = np.where(q >= min_p * q.max(), x.astype(np.float64), -np.inf)
        got = Chooser(t, k, p, min_p=min_p).probabilities(x)
        want = reference(kept, t, k, p)
        assert np.array_equal(got > 0, want > 0), (min_p, t, k, p)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_rules_never_touch_the_callers_row():
    x = ROWS[5].copy()
    before = x.copy()
    ch = Chooser(0.8, seed=1, min_p=0.1, logit_bias={1: 3.0}, presence_penalty=1.0, repetition_penalty=1.3,
                 prompt_ids=[1, 2], logprobs=3, constraint=Allow([1, 2, 3, 4]))
    for _ in range(3):
        ch(x)
        ch.probabilities(x)
    np.testing.assert_array_equal(x, before)


class Allow:
    """A fake constraint: only `ids` may follow, and it is complete after `k` tokens."""

    def __init__(self, ids, k=10**9, n=None):
        self.ids, self.k, self.n, self.got = list(ids), k, n, []

    def allowed(self):
        m = np.zeros(self.n or max(self.ids) + 1, bool)
        m[self.ids] = True
        return m

    def accept(self, token):
        assert token in self.ids
        self.got.append(token)

    @property
    def finished(self):
        return len(self.got) >= self.k


def test_constraint_masks_accepts_and_ends():
    c = Allow([2, 5, 650], k=6, n=651)
    ch = Chooser(1.5, seed=2, constraint=c, eos_id=0)
    out = [ch(x) for x in ROWS[:8]]
    assert all(t in (2, 5, 650) for t in out[:6]) and out[6:] == [0, 0] and c.got == out[:6]
    p = Chooser(1.0, constraint=Allow([2, 5])).probabilities(ROWS[0])  # a short mask: the ids past it are out
    assert set(np.flatnonzero(p)) == {2, 5}
    np.testing.assert_allclose(p[[2, 5]], softmax(ROWS[0][[2, 5]]), rtol=1e-6)
    with pytest.raises(CflowError, match="no end-of-text"):
        Chooser(1.0, constraint=Allow([1], k=0))(ROWS[0])
    assert Chooser(1.0, constraint=Allow([1], k=0), eos_id=9)(ROWS[0]) == 9


class Tries(Allow):
    """Allow with try_accept (the Chooser draws first and masks only what the constraint refuses) and forced()."""

    def __init__(self, ids, force=None, **kw):
        super().__init__(ids, **kw)
        self.force, self.masks = force, 0

    def allowed(self):
        self.masks += 1
        return super().allowed()

    def try_accept(self, token):
        if token not in self.ids:
            return False
        self.got.append(token)
        return True

    def forced(self):
        return self.force


class Packed(Tries):
    """Tries whose mask also comes packed (allowed_bits, llguidance's layout): the Chooser's native draws."""

    def allowed_bits(self):
        self.masks += 1
        bits = np.zeros(-(-self.n // 32) * 32, bool)
        bits[self.ids] = True
        return np.packbits(bits, bitorder="little").view(np.int32)


@pytest.mark.parametrize("kind", [Tries, Packed])
@pytest.mark.parametrize("temperature,ids", [(0.8, [i for i in range(1, 200) if i % 40]), (1.0, list(range(150, 200))),
                                             (1.0, [3, 5, 8, 9, 12, 15, 20, 22, 27]), (0.7, [2, 6]), (1.4, [4])])
def test_drawing_first_is_the_masked_distribution(temperature, ids, kind):
    """Draws from the unmasked row, redrawn while refused, then the masked row, or the masked row at once: the
    masked softmax, whether the allowed tokens are many and hold most of the mass (the mask is then seldom
    computed) or few and hold little of it (most tokens go to the mask, and it comes first)."""
    x = (np.random.default_rng(5).standard_normal(200) * 2).astype(np.float32)
    x[ids[0]] -= 3  # an allowed token the model seldom draws
    c = kind(ids, n=200)
    ch, n = Chooser(temperature, seed=9, constraint=c, eos_id=0), 20000
    got = np.bincount([ch(x) for _ in range(n)], minlength=200) / n
    p = np.zeros(200)
    p[ids] = softmax(x[ids] / temperature)
    np.testing.assert_allclose(got, p, atol=4 * np.sqrt(p * (1 - p) / n).max() + 1e-9)
    if softmax(x / temperature)[ids].sum() > 0.9:  # the draws are seldom refused: seldom a mask
        assert c.masks < n / 100
    assert Chooser(0.0, constraint=kind(ids, n=200), eos_id=0)(x) == ids[int(np.argmax(x[ids]))]


class Counted(Packed):
    """Packed that counts the engine's checks of drawn tokens (and can hide its packed mask)."""

    checks = 0

    def try_accept(self, token):
        self.checks += 1
        return super().try_accept(token)


@pytest.mark.parametrize("n_allowed", [4, 120])
@pytest.mark.parametrize("packed", [False, True])
def test_a_model_the_grammar_keeps_refusing_gets_the_mask_first(n_allowed, packed):
    """Where the model's draws keep being refused (a story model asked for an e-mail address), the Chooser masks
    first after the first refusals instead of paying TRIES draws and checks on every token; the draws stay the
    masked distribution's (test_drawing_first_is_the_masked_distribution)."""
    from cflow.runtime.choice import TRIES

    x = (np.random.default_rng(2).standard_normal(200) * 2).astype(np.float32)
    ids = list(range(200 - n_allowed, 200))
    x[ids] -= 8  # the allowed tokens hold a sliver of the mass: draws from the whole row are refused
    c = Counted(ids, n=200)
    if not packed:
        c.allowed_bits = None  # the NumPy path
    ch = Chooser(0.8, seed=4, constraint=c, eos_id=0)
    out = [ch(x) for _ in range(60)]
    assert all(t in ids for t in out)
    assert c.checks <= 2 * TRIES and c.masks >= 58


def test_forced_tokens_are_taken_without_a_mask_or_a_draw():
    c = Tries([4, 7], force=7, n=30)
    ch = Chooser(1.0, seed=3, constraint=c, eos_id=0)
    state = ch.rng.bit_generator.state
    assert [ch(ROWS[0][:30]) for _ in range(3)] == [7, 7, 7] and c.masks == 0 and c.got == [7, 7, 7]
    ref = np.random.default_rng(3)
    ref.bit_generator.state = state
    ref.random(3)
    assert ch.rng.random() == ref.random()  # one uniform a token all the same: seeds keep their streams


def test_logprobs_records_and_take():
    x = ROWS[6]
    ch = Chooser(0.9, seed=4, logprobs=5, logit_bias={0: 50.0})  # the bias does not change the recorded values
    toks = [ch(x), ch(x), ch(x)]
    z = x.astype(np.float64)
    lsm = z - z.max() - np.log(np.exp(z - z.max()).sum())
    order = np.argsort(-x, kind="stable")[:5]
    assert ch.take(999) is None  # a token never chosen: the queue is passed over, emptied
    ch2 = Chooser(0.9, seed=4, logprobs=5, logit_bias={0: 50.0})
    toks2 = [ch2(x) for _ in range(3)]
    assert toks == toks2
    for t in toks2:
        r = ch2.take(t)
        assert r.token == t and abs(r.logprob - lsm[t]) < 1e-6  # (a float32 row: exp in float32)
        assert [i for i, _ in r.top] == order.tolist()
        np.testing.assert_allclose([lp for _, lp in r.top], lsm[order], atol=1e-6)
    assert ch2.take(toks2[0]) is None
    assert abs(Chooser(logprobs=2).logprob(z, 3).logprob - lsm[3]) < 1e-12  # a float64 row: float64 throughout
    ties = np.zeros(50, np.float32)  # ties rank by the lower id
    assert [i for i, _ in Chooser(logprobs=4).logprob(ties, 7).top] == [0, 1, 2, 3]


def test_bad_values_are_refused():
    for kw, match in [(dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
                      (dict(frequency_penalty=float("nan")), "frequency_penalty"),
                      (dict(repetition_penalty=0), "repetition_penalty"), (dict(logprobs=21), "logprobs"),
                      (dict(logit_bias={1: 200}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
                      (dict(repetition_window=-2), "repetition_window")]:
        with pytest.raises(CflowError, match=match):
            Chooser(**kw)
    with pytest.raises(CflowError, match="vocabulary"):
        Chooser(1.0, logit_bias={5000: 1.0})(ROWS[0])


# --- with a model ---------------------------------------------------------------------------------------------
PROMPT = [5, 9, 14, 3, 7]


def test_logprobs_are_the_models_log_softmax(tiny):
    ch = Chooser(0.9, seed=3, logprobs=4, presence_penalty=1.0)
    out = tiny.generate(PROMPT, 12, stop=False, sampler=ch)
    assert len(out) == 12
    for i, t in enumerate(out):
        z = tiny.logits(PROMPT + out[:i]).astype(np.float64)
        lsm = z - z.max() - np.log(np.exp(z - z.max()).sum())
        r = ch.take(t)
        assert r.token == t and abs(r.logprob - lsm[t]) < 1e-5
        order = np.argsort(-z, kind="stable")[:4]
        assert [j for j, _ in r.top] == order.tolist()
        np.testing.assert_allclose([lp for _, lp in r.top], lsm[order], atol=1e-5)


def test_generate_with_a_sampler(tiny):
    for opts in (dict(), dict(temperature=0.8, top_k=20, seed=9)):
        plain = tiny.generate(PROMPT, 10, stop=False, **opts)
        seed = opts.pop("seed", None)
        assert tiny.generate(PROMPT, 10, stop=False, sampler=Chooser(**opts, seed=seed)) == plain
        assert tiny.generate(PROMPT, 10, stop=False, sampler=Sampler(**opts, seed=seed)) == plain
    assert tiny.generate(PROMPT, 6, stop=False, sampler=Chooser(0.0, logit_bias={17: 100})) == [17] * 6
    with pytest.raises(CflowError, match="speculate"):
        tiny.generate(PROMPT, 4, speculate="ngram", sampler=Chooser(0.0, logprobs=0))
    assert tiny.generate(PROMPT, 8, stop=False, speculate="ngram", sampler=Chooser()) == tiny.generate(PROMPT, 8,
                                                                                                       stop=False)


def test_list_logits_and_a_row_longer_than_the_mask():
    """Logits as a list take the NumPy path; an allowed NaN in a row longer than the grammar's vocabulary is the
    clear error, not an IndexError."""
    x = (np.random.default_rng(1).standard_normal(200) * 2).astype(np.float32)
    assert Chooser(1.0, seed=1, constraint=Tries([3, 5, 8, 150], n=200), eos_id=0)(x.tolist()) in (3, 5, 8, 150)
    x[5] = np.nan
    with pytest.raises(CflowError, match="largest allowed logit"):
        Chooser(1.0, seed=1, constraint=Packed([3, 5, 8, 150], n=160), eos_id=0)(x)
