"""The Sampler against a straightforward reference (a stable sort of the whole vocabulary): the same kept tokens
with the same probabilities, top-k / top-p edge cases, ties, seeding, and draws that follow the distribution."""

import numpy as np
import pytest

from cflow.errors import CflowError
from cflow.runtime import sampling
from cflow.runtime.sampling import Sampler


def reference(logits, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    """The distribution by definition: rank everything (stable: ties by the lower id), keep the first top_k,
    softmax(z / T) over them, then the shortest prefix reaching top_p, renormalised."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    out = np.zeros(len(z))
    out[order] = p
    return out


def _logits():
    r = np.random.default_rng(7)
    return {
        "peaked": (r.standard_normal(3000) * 2.5 + r.gumbel(size=3000) * 1.5).astype(np.float32),
        "flat": (r.standard_normal(5000) * 0.3).astype(np.float32),  # a random-weight model: wide nucleus
        "ties": r.integers(-4, 5, 700).astype(np.float32),  # many equal logits: rank by id
        "float64": r.standard_normal(500) * 3,
        "masked": np.where(r.random(400) < 0.5, -np.inf, r.standard_normal(400)).astype(np.float32),
    }


LOGITS = _logits()
CONFIGS = [(t, k, p) for t in (0.5, 1.0, 2.0) for k in (0, 2, 40, 500, 3000, 10**6) for p in (1.0, 0.95, 0.5, 0.05)]


@pytest.mark.parametrize("name", sorted(LOGITS))
def test_distribution_equals_the_reference(name):
    x = LOGITS[name]
    for t, k, p in CONFIGS:
        got, want = Sampler(t, k, p).probabilities(x), reference(x, t, k, p)
        assert np.array_equal(got > 0, want > 0), (name, t, k, p)  # exactly the same kept tokens
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300, err_msg=f"{name} T={t} k={k} p={p}")


def test_top_p_edge_cases():
    uniform = np.zeros(128, np.float32)  # 1/128 each: cumulative sums are exact
    assert np.flatnonzero(Sampler(1.0, top_p=0.5).probabilities(uniform)).tolist() == list(range(64))
    assert np.flatnonzero(Sampler(1.0, top_p=0.5 + 1e-9).probabilities(uniform)).tolist() == list(range(65))
    assert np.flatnonzero(Sampler(1.0, top_p=1e-6).probabilities(uniform)).tolist() == [0]
    x = LOGITS["peaked"]
    top = int(np.argmax(x))
    assert np.flatnonzero(Sampler(0.7, top_p=1e-9).probabilities(x)).tolist() == [top]  # tiny: the best token
    assert (Sampler(0.7, top_p=1.0).probabilities(x) > 0).all()  # 1.0: nothing is cut, however unlikely
    # a nucleus of thousands (a flat distribution): the band is bisected, the set is still the reference's
    wide = LOGITS["flat"]
    for p in (0.99, 0.6, 0.01):
        want = reference(wide, 1.0, 0, p) > 0
        assert want.sum() > 2 * sampling.BAND or p == 0.01
        assert np.array_equal(Sampler(1.0, top_p=p).probabilities(wide) > 0, want), p
    # top_p so close to 1 that only rounding decides: still a valid distribution, at least the reference's set
    got = Sampler(1.0, top_p=1 - 1e-16).probabilities(wide)
    assert abs(got.sum() - 1) < 1e-12 and (got > 0).sum() >= (reference(wide, 1.0, 0, 1 - 1e-16) > 0).sum() - 1


def test_top_k_larger_than_the_vocabulary_keeps_everything():
    x = LOGITS["peaked"]
    for k in (len(x), len(x) + 1, 10**9):
        np.testing.assert_allclose(Sampler(0.9, top_k=k).probabilities(x), Sampler(0.9).probabilities(x), rtol=1e-12)
        a, b = Sampler(0.9, top_k=k, seed=4), Sampler(0.9, seed=4)
        assert [a(x) for _ in range(20)] == [b(x) for _ in range(20)]


def test_top_k_when_the_sample_misleads():
    """The top-k threshold comes from every 16th logit; logits that make that sample unrepresentative (a periodic
    pattern, a vocabulary of ties) take the general way and keep the same tokens."""
    r = np.random.default_rng(3)
    high = r.standard_normal(4096).astype(np.float32)
    high[::16] += 20  # the sample sees only these: its threshold leaves too few tokens above it
    low = r.standard_normal(20000).astype(np.float32)
    low[::16] -= 20  # the sample sees only these: its threshold leaves nearly everything above it
    for x, k in [(high, 300), (low, 10), (np.zeros(10000, np.float32), 10)]:
        assert np.array_equal(Sampler(1.0, top_k=k).probabilities(x) > 0, reference(x, 1.0, k) > 0), k
    assert np.flatnonzero(Sampler(1.0, top_k=10).probabilities(np.zeros(10000))).tolist() == list(range(10))


def test_ties_go_to_the_lowest_id():
    x = np.array([1, 3, 3, 2, 3], np.float32)
    assert Sampler(0)(x) == 1 and Sampler(0.5, top_k=1, seed=0)(x) == 1
    assert np.flatnonzero(Sampler(1.0, top_k=2).probabilities(x)).tolist() == [1, 2]
    x = np.array([5, 1, 3, 3, 3, 0], np.float32)
    assert np.flatnonzero(Sampler(1.0, top_k=2).probabilities(x)).tolist() == [0, 2]
    assert np.flatnonzero(Sampler(1.0, top_k=4).probabilities(x)).tolist() == [0, 2, 3, 4]
    ties = LOGITS["ties"]
    for k in range(1, 60):  # every boundary inside a group of equal logits
        assert np.array_equal(Sampler(1.0, top_k=k).probabilities(ties) > 0, reference(ties, 1.0, k) > 0), k


def test_greedy_is_the_argmax_and_draws_nothing():
    x = LOGITS["peaked"]
    s = Sampler(0.0, top_p=0.3, top_k=7, seed=1)
    state = s.rng.bit_generator.state
    assert s(x) == int(np.argmax(x)) and s.rng.bit_generator.state == state
    assert s.probabilities(x)[np.argmax(x)] == 1.0


def test_seeded_and_one_draw_per_token():
    x = LOGITS["peaked"]
    for t, k, p in [(0.8, 0, 1.0), (0.8, 0, 0.9), (1.2, 40, 1.0), (1.0, 40, 0.8)]:
        a, b = Sampler(t, k, p, seed=11), Sampler(t, k, p, seed=11)
        toks = [a(x) for _ in range(50)]
        assert toks == [b(x) for _ in range(50)] and len(set(toks)) > 1
        assert toks != [Sampler(t, k, p, seed=12)(x) for _ in range(50)]
        ref = np.random.default_rng(11)
        ref.random(50)
        assert a.rng.bit_generator.state == ref.bit_generator.state  # exactly one uniform number per token


class _Grid:
    """A stand-in generator whose uniform numbers sweep [0, 1) evenly."""

    def __init__(self, m):
        self.u = iter((np.arange(m) + 0.5) / m)

    def random(self):
        return next(self.u)


@pytest.mark.parametrize("t, k, p", [(0.8, 0, 1.0), (0.8, 0, 0.9), (1.0, 40, 1.0), (1.5, 40, 0.7), (2.0, 0, 0.5)])
@pytest.mark.parametrize("n", [600, 3000])
def test_draws_follow_the_distribution(t, k, p, n):
    """Inverse CDF: an even sweep of the uniform number hits each token in proportion to its probability
    (within one grid step), whatever order the sampler walks the tokens in (3000: block by block)."""
    x = LOGITS["peaked"][:n]
    m = 2000
    s = Sampler(t, k, p)
    s.rng = _Grid(m)
    counts = np.bincount([s(x) for _ in range(m)], minlength=len(x))
    assert np.abs(counts / m - reference(x, t, k, p)).max() <= 1 / m + 1e-12


def test_bad_arguments():
    for kw, needle in [(dict(temperature=-1), "temperature"), (dict(temperature=float("nan")), "temperature"),
                       (dict(temperature=float("inf")), "temperature"), (dict(top_p=0), "top_p"),
                       (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k")]:
        with pytest.raises(CflowError, match=needle):
            Sampler(**kw)
    for bad in (np.zeros(0), np.zeros((2, 3))):
        with pytest.raises(CflowError, match="logits"):
            Sampler(1.0)(bad)
    for kw in (dict(), dict(top_k=2), dict(top_p=0.5)):  # (greedy takes the argmax and does not look)
        for bad in (np.nan, np.inf):
            with pytest.raises(CflowError, match=f"largest logit is {bad}"):
                Sampler(1.0, **kw)(np.array([0.0, bad, 1.0]))
    assert Sampler(0)(np.array([0, 5, 1])) == 1  # integer logits are accepted


@pytest.mark.parametrize("name", sorted(LOGITS))
def test_the_gathered_nucleus_is_the_whole_vocabularys(name):
    """Probing only the candidates above the floor finds the same tokens in the same order as probing the whole
    vocabulary (the path benchmarks/sampling.py compares it with)."""
    from cflow.runtime.sampling import _nucleus

    x = LOGITS[name]
    for t, p in ((0.5, 0.95), (1.0, 0.5), (2.0, 0.05), (1.0, 0.999)):
        e = np.exp(np.subtract(x, x.max(), dtype=np.float64) / t)
        assert _nucleus(x, e, p).tolist() == _nucleus(x, e, p, gather=False).tolist()
