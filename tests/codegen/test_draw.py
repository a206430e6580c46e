"""codegen/draw.py, the native draw of the Sampler's plain temperature: its weights against NumPy's within
2 (|y| + 2) ulp, its tokens against sampling._pick over the NumPy weights (the Sampler's old path) for every kind
of row, and its refusals."""

import numpy as np
import pytest

from cflow.codegen import draw as D
from cflow.errors import CflowError
from cflow.runtime import sampling
from cflow.runtime.sampling import Sampler, _pick


def numpy_weights(x, t):
    return np.exp(np.subtract(x, x.max(), dtype=np.float64) / t)


def test_block_matches_the_sampler():
    assert D.BLOCK == sampling.BLOCK  # the same block sums, so the same crossings


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 255, 256, 257, 1023, 1024, 1025, 2048, 2051, 32000])
@pytest.mark.parametrize("t", [0.05, 0.8, 1.0, 3.0])
def test_tokens_are_numpys_and_weights_within_y_ulp(n, t):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 4).astype(np.float32)
    if n > 3:
        x[rng.integers(0, n, 3)] = -np.inf  # masked logits weigh 0
    d = D.Draw()
    ref = numpy_weights(x, t)
    us = np.concatenate([rng.random(300), [0.0, 0.5]])
    got = [d(x, t, float(u)) for u in us]
    assert got == [_pick(ref, float(u)) for u in us]
    y = np.nan_to_num(np.subtract(x, x.max(), dtype=np.float64) / t, neginf=0)  # 1 / t rounds y by |y| ulp
    assert np.all(np.abs(d.w - ref) <= 2 * (2 - y) * np.spacing(np.maximum(ref, 1e-300)))
    # at u -> 1 the sums' rounding decides (the total is summed by lanes, NumPy's in order): a token with weight
    assert ref[d(x, t, 1 - 2**-53)] > 0


def test_far_below_the_best_weighs_nothing():
    """Weights under exp(-708) of the best (and -inf logits) are 0; u at the end gives the last with weight."""
    x = np.full(40, -1e4, np.float32)
    x[[3, 17]] = [5.0, 4.0]
    d = D.Draw()
    assert {d(x, 1.0, u) for u in (0.0, 0.3, 0.99, 1 - 2**-53)} <= {3, 17}
    assert np.count_nonzero(d.w) == 2
    assert d(x, 1.0, 1 - 2**-53) == 17 or numpy_weights(x, 1.0)[17] / numpy_weights(x, 1.0).sum() < 2**-52


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_and_inf_are_refused(bad):
    x = np.zeros(100, np.float32)
    x[57] = bad
    assert D.Draw()(x, 0.8, 0.5) == -1
    with pytest.raises(CflowError, match="largest logit"):
        Sampler(0.8, seed=0)(x)


def test_a_row_of_minus_inf_is_refused():
    x = np.full(10, -np.inf, np.float32)
    assert D.Draw()(x, 0.8, 0.5) == -2
    with pytest.raises(CflowError, match="largest logit is -inf"):
        Sampler(0.8, seed=0)(x)


def test_the_sampler_draws_natively_where_it_can_and_keeps_its_stream():
    """Plain temperature over a float32 row goes native, with one uniform a token as before; a float64 row, top-k
    and top-p take the NumPy path; both give the same tokens from the same seeds."""
    rng = np.random.default_rng(3)
    rows = [(rng.standard_normal(3000) * 2).astype(np.float32) for _ in range(50)]
    a, b = Sampler(0.9, seed=7), Sampler(0.9, seed=7)
    got = [a(r) for r in rows]
    assert a._native is not None
    assert got == [b(r.astype(np.float64)) for r in rows] and b._native is None
    assert a.rng.random() == b.rng.random()


def test_the_buffer_a_model_reuses_is_read_afresh():
    """A model hands over the same logits array every step with new values: the draw reads them each time."""
    x = np.zeros(64, np.float32)
    d = D.Draw()
    for k in (5, 40, 63):
        x[:] = -50
        x[k] = 10
        assert d(x, 1.0, 0.5) == k


def pack(allowed: np.ndarray, words: int) -> np.ndarray:
    """llguidance's layout: bit i % 32 of int32 word i // 32."""
    bits = np.zeros(words * 32, bool)
    bits[: allowed.size] = allowed[: words * 32]
    return np.packbits(bits, bitorder="little").view(np.int32).copy()


@pytest.mark.parametrize("n,share", [(9, 0.5), (257, 0.01), (2048, 0.9), (2048, 0.002), (32000, 0.3)])
def test_masked_draws_are_the_masked_rows(n, share):
    """Among the tokens a packed mask allows: the tokens of _pick over the allowed tokens' weights (the masked
    row's), the allowed count and whether the row's best is allowed; a mask shorter than the row allows none past
    its words."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    allowed = rng.random(n) < share
    allowed[rng.integers(0, n)] = True
    words = pack(allowed, (n + 31) // 32)
    d = D.Draw()
    ref = np.where(allowed, np.exp(np.subtract(x, x[allowed].max(), dtype=np.float64) / 0.7), 0.0)
    us = rng.random(200)
    assert [d.masked(x, 0.7, float(u), words) for u in us] == [_pick(ref, float(u)) for u in us]
    assert d.stats.tolist() == [int(allowed.sum()), int(allowed[np.argmax(x)])]
    short = pack(allowed, max(1, n // 64))  # covers the first n // 64 * 32 tokens at most
    kept = allowed.copy()
    kept[short.size * 32:] = False
    if kept.any():
        assert kept[d.masked(x, 0.7, 0.5, short)]
        assert d.stats[0] == kept.sum()


def test_masked_refusals():
    x = np.zeros(100, np.float32)
    x[7] = np.nan
    d = D.Draw()
    none = np.zeros(4, np.int32)
    assert d.masked(x, 1.0, 0.5, none) == -2  # nothing allowed
    allow = lambda *ids: pack(np.isin(np.arange(100), ids), 4)  # noqa: E731
    assert d.masked(x, 1.0, 0.5, allow(3, 9)) in (3, 9)  # a NaN the mask leaves out does not matter
    assert d.masked(x, 1.0, 0.5, allow(7, 9)) == -1
    x[:] = -np.inf
    x[50] = 1
    assert d.masked(x, 1.0, 0.5, allow(3, 9)) == -2  # allowed, but all -inf


def test_a_sampler_still_copies_and_pickles():
    import copy
    import pickle

    s = Sampler(0.8, seed=1)
    x = np.arange(40, dtype=np.float32)
    s(x)
    copies = [copy.deepcopy(s), pickle.loads(pickle.dumps(s))]
    want = [s(x) for _ in range(5)]
    assert all([c(x) for _ in range(5)] == want for c in copies)


def test_a_subnormal_temperature_takes_the_numpy_path():
    x = np.array([0, 1, 0.5, 1, -3], np.float32)
    assert Sampler(1e-310, seed=0)(x) in (1, 3) and Sampler(1e-310, seed=0)._native is None


def test_the_same_weights_on_every_isa_path():
    """No FMA and no libm: the kernel built for each ISA path this host can force gives the same weights bit for
    bit, so a seed gives the same tokens on every host."""
    import hashlib

    from tests._isa import outputs_on_each_path

    script = ("import hashlib, numpy as np; from cflow.codegen.draw import Draw; "
              "x = (np.random.default_rng(5).standard_normal(3001) * 6).astype(np.float32); d = Draw(); "
              "print(d(x, 0.7, 0.42), hashlib.sha256(d.w.tobytes()).hexdigest())")
    got = {isa: out.split() for isa, out in outputs_on_each_path(script).items()}
    assert len(got) >= 2 and len({tuple(v) for v in got.values()}) == 1, got
    d = D.Draw()
    x = (np.random.default_rng(5).standard_normal(3001) * 6).astype(np.float32)
    assert [str(d(x, 0.7, 0.42)), hashlib.sha256(d.w.tobytes()).hexdigest()] == next(iter(got.values()))
