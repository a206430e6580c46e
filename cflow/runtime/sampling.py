"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), seeded.

The distribution is the textbook one, defined by ranking the whole vocabulary: tokens ordered by logit, highest
first, ties by the lower id; top_k keeps the first k of that order; the probabilities are softmax(logits /
temperature) over the kept tokens; top_p then keeps the shortest prefix of the order whose probability reaches
top_p, renormalised. Temperature 0 (or top_k = 1) is the argmax, ties to the lowest id (as torch.argmax).

Ranking a 32k vocabulary with a full sort (or even an argpartition) costs more than a small model's decode step,
so nothing here sorts more than it must. Every set that is kept is a prefix of the ranking, {logit >= t} for
some threshold t, found with a few vectorised comparisons: top-k takes a threshold from a strided sample of the
logits and ranks only the tokens above it; top-p narrows the weight band where the cumulative mass crosses top_p
and ranks only that band; the draw itself is an inverse CDF, which needs no order at all (the same distribution
whatever order the kept tokens are walked in). Each non-greedy call draws exactly one uniform number from the
sampler's generator, so a seed fixes the tokens.
"""

from __future__ import annotations

import numpy as np

from ..errors import CflowError

BAND = 512  # top-p: tokens near the crossing ranked by a sort; wider bands are narrowed by bisection first
SAMPLE_STRIDE = 16  # top-k: every 16th logit estimates the threshold above which the k best lie
BLOCK = 256  # inverse CDF over many weights: cumulative sums of blocks first, then within one block


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if not 0 <= temperature < float("inf"):  # (also refuses NaN)
            raise CflowError(f"temperature must be a finite number >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise CflowError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise CflowError(f"top_k must be >= 0, got {top_k}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.default_rng(seed)
        self._native = None  # codegen.draw.Draw: plain temperature over a float32 row, made on first use

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def __call__(self, logits: np.ndarray) -> int:
        """The next token: the argmax if greedy, else one draw (a single uniform number) from the distribution."""
        return self.draw(logits, None if self.greedy else self.rng.random())

    def draw(self, logits: np.ndarray, u: float | None) -> int:
        """The token uniform `u` in [0, 1) selects (the argmax if greedy): __call__ with its uniform given, so
        that a caller can tie each generated position to its own draw (speculative decoding)."""
        x = _vector(logits)
        if self.greedy:
            return int(np.argmax(x))  # ties: the lowest id
        if (self.top_k == 0 and self.top_p == 1.0 and x.dtype == np.float32 and x.flags.c_contiguous
                and self.temperature >= 1e-300):  # (1 / T must be finite)
            return self._plain(x, u)
        ids, w = self._support(x)
        i = _pick(w, u)
        return i if ids is None else int(ids[i])

    def __getstate__(self):  # copies and pickles leave the native draw (ctypes state) to be made again
        return {**self.__dict__, "_native": None}

    def native(self):
        """This sampler's native draw (codegen/draw.py's Draw: its scratch kept), made on first use."""
        if self._native is None:
            from ..codegen.draw import Draw

            self._native = Draw()
        return self._native

    def _plain(self, x: np.ndarray, u: float) -> int:
        """softmax(x / T)'s draw at u in one native call (codegen/draw.py): the weights and sums `_support` and
        `_pick` make, in ~4 us where their NumPy calls take 16 for 2,048 logits."""
        i = self.native()(x, self.temperature, u)
        if i < 0:
            raise CflowError(f"cannot sample: the largest logit is {x.max()}")
        return i

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a call draws from, as probabilities over the vocabulary (float64; draws nothing)."""
        x = _vector(logits)
        out = np.zeros(x.size)
        if self.greedy:
            out[np.argmax(x)] = 1.0
            return out
        ids, w = self._support(x)
        out[slice(None) if ids is None else ids] = w / w.sum()
        return out

    def _support(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, weights): the kept tokens and their unnormalised probabilities; ids None = every id in order."""
        top = x.max()
        if not np.isfinite(top):  # NaN or +Inf (the model checks first; a caller with its own logits may not)
            raise CflowError(f"cannot sample: the largest logit is {top}")
        if self.top_k and self.top_k < x.size:  # a few candidates: rank exactly those
            ids = _top(x, self.top_k)
            z = x[ids].astype(np.float64) / self.temperature
            p = np.exp(z - z[0])
            if self.top_p < 1.0:
                p /= p.sum()
                keep = int(np.searchsorted(np.cumsum(p), self.top_p)) + 1
                ids, p = ids[:keep], p[:keep]
            return ids, p
        # the whole vocabulary: its softmax weights (the normaliser needs them all), in float64, the best one 1.0;
        # for top-p over a float32 row the native draw's (codegen/draw.py: its scratch, read before its next call)
        if self.top_p < 1.0 and x.dtype == np.float32 and x.flags.c_contiguous and self.temperature >= 1e-300:
            d = self.native()
            d(x, self.temperature, 0.0)
            ids = _nucleus(x, d.w, self.top_p)
            return ids, d.w[ids]
        e = np.subtract(x, top, dtype=np.float64)
        e /= self.temperature
        np.exp(e, out=e)
        if self.top_p == 1.0:
            return None, e
        ids = _nucleus(x, e, self.top_p)
        return ids, e[ids]


def _vector(logits) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise CflowError(f"logits must be a non-empty vector, got shape {x.shape}")
    return x if x.dtype.kind == "f" else x.astype(np.float64)


def _rank(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids (ascending) in rank order: value descending, ties by the lower id (a stable sort)."""
    return ids[np.argsort(-x[ids], kind="stable")]


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k best of x in rank order (the first k of a stable descending sort of everything)."""
    n = x.size
    if k >= n:
        return np.argsort(-x, kind="stable")
    # {x >= t} is a prefix of the ranking; with t the (k/16 + 16)-th best of every 16th logit it holds about
    # k + 256 tokens. When it holds at least k, every token tied with the k-th is in it too, so ranking it alone
    # gives the exact first k.
    sub = x[::SAMPLE_STRIDE]
    q = k // SAMPLE_STRIDE + 16
    if q < sub.size:
        t = np.partition(sub, sub.size - 1 - q)[sub.size - 1 - q]
        ids = np.flatnonzero(x >= t)
        if k <= ids.size <= 4 * k + 4096:  # else (unlucky sample, huge ties) the general way below
            return _rank(x, ids)[:k]
    part = np.argpartition(x, n - k)[n - k :]
    v = x[part].min()
    # argpartition picks arbitrary ones among the values equal to the k-th; the ranking takes the lowest ids
    ids = np.concatenate([part[x[part] > v], np.flatnonzero(x == v)[: k - int((x[part] > v).sum())]])
    ids.sort()
    return _rank(x, ids)


def _nucleus(x: np.ndarray, e: np.ndarray, top_p: float, gather: bool = True) -> np.ndarray:
    """Ids of the shortest prefix of the ranking by x whose weights e (monotone in x) hold top_p of e's total.

    Invariant: the tokens with e >= hi hold less than `need` (all kept), those with e >= lo at least `need` (the
    prefix ends among them), so only the band lo <= e < hi needs ranking. Weight thresholds 16x apart find a
    band; one wider than BAND tokens is bisected first. The tokens under `floor` cannot hold what the prefix
    lacks, so every probe runs over the candidates above it, gathered once (a real model's logits leave a few
    hundred of 151,936: the probes then cost next to nothing; a flat row keeps most). gather=False probes the whole
    vocabulary each time, as this did before (benchmarks/sampling.py times both)."""
    total = e.sum()
    need = top_p * total
    floor = (total - need) / e.size  # the tokens under this weight cannot hold what the prefix lacks
    cand = np.flatnonzero(e >= floor) if gather else None
    ec = e[cand] if gather else e
    if gather and ec.sum() < need:  # rounding kept even `floor` short: every token is a candidate
        cand, ec = None, e

    def above(t):  # (mass, count) of the candidates with e >= t
        m = ec >= t
        return (ec * m).sum(), np.count_nonzero(m)  # (a product: 5x faster than a masked sum or a gather)

    hi, lo = np.nextafter(1.0, 2.0), max(1.0 / 16, floor)  # e's best is 1.0
    (sure_mass, n_hi), (mass, n_lo) = (0.0, 0), above(lo)
    while mass < need:
        hi, sure_mass, n_hi = lo, mass, n_lo
        lo = max(lo / 16, floor)
        if lo >= hi:  # rounding kept even `floor` short: rank every candidate under hi
            lo, n_lo = 0.0, ec.size
            break
        mass, n_lo = above(lo)
    while n_lo - n_hi > BAND and lo > 0:
        mid = 0.5 * (lo + hi) if hi < 16 * lo else np.sqrt(lo * hi)
        if not lo < mid < hi:  # no weight left between them: a band of equal weights
            break
        mass, n = above(mid)
        if mass < need:  # everything from mid up is kept
            hi, sure_mass, n_hi = mid, mass, n
        else:
            lo, n_lo = mid, n
    def ids(m):  # the vocabulary ids of a mask over the candidates
        return np.flatnonzero(m) if cand is None else cand[m]

    band = _rank(x, ids((ec >= lo) & (ec < hi)))
    c = sure_mass + np.cumsum(e[band])
    keep = int(np.searchsorted(c, need)) + 1  # the first band token whose running mass reaches top_p
    return np.concatenate([ids(ec >= hi), band[:keep]])


def _pick(w: np.ndarray, u: float) -> int:
    """The index that uniform u in [0, 1) selects from weights w >= 0 (not all 0), by inverse CDF in w's order.
    Long vectors go by blocks: a cumulative sum over a whole 32k vocabulary costs more than everything else."""
    if w.size <= 4 * BLOCK:
        c = np.cumsum(w)
        return _crossing(c, u * c[-1])
    nb = w.size // BLOCK
    sums = w[: nb * BLOCK].reshape(nb, BLOCK).sum(axis=1)
    if w.size > nb * BLOCK:
        sums = np.append(sums, w[nb * BLOCK :].sum())
    c = np.cumsum(sums)
    t = u * c[-1]
    j = _crossing(c, t)
    lo = j * BLOCK
    return lo + _crossing(np.cumsum(w[lo : lo + BLOCK]), t - (c[j - 1] if j else 0.0))


def _crossing(c: np.ndarray, t: float) -> int:
    """The first i with c[i] > t (c a cumulative sum); the last i that adds weight if rounding put t at the end."""
    i = int(np.searchsorted(c, t, side="right"))
    if i >= c.size:
        i = int(np.searchsorted(c, c[-1], side="left"))
    return i
