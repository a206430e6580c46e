"""Teacher-forced scoring with llama-perplexity's protocol, and its base-logits file for KL divergence.

Protocol (llama.cpp tools/perplexity, perplexity()): the whole text is tokenised once as a prompt is (BOS in front
where the model adds it); it is cut into n_chunk = len(tokens) // n_ctx chunks of n_ctx tokens (the rest is
dropped); each chunk is run from an empty cache with its first token replaced by BOS when the model adds BOS; the
logits at positions first = n_ctx // 2 .. n_ctx - 2 score the next token (n_ctx - 1 - first tokens a chunk).
Perplexity is exp(mean negative log-likelihood); its error ppl * sqrt(var(nll) / (count - 1)), as llama.cpp prints
it ("Final estimate: PPL = X +/- Y").

The base-logits file (llama-perplexity --kl-divergence-base FILE, written by a run without --kl-divergence and
read by one with it): b"_logits_", int32 n_ctx, int32 n_vocab, int32 n_chunk, int32 tokens[n_chunk * n_ctx], then
for every chunk n_ctx - 1 - first rows of nv = 2 * ceil(n_vocab / 2) + 4 uint16: float32 scale, float32
min_log_prob, then each token's log-probability quantised as round((logit - min_logit) / scale) over a 16 nat range
below the largest logit (0 below it). KL divergence is summed over the tokens whose base log-probability exceeds
-16, as llama.cpp does, and reported with its statistics (mean ± error, percentiles, Δp, same top token).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator

import attrs
import numpy as np

from ..errors import CflowError
from ..ir.interp import log_softmax as log_softmax  # `X as X`: re-exported (benchmarks/conformance.py)

MAGIC = b"_logits_"
LOG_RANGE = 16.0  # nats below the largest logit that the base file keeps (and KLD sums over)


def first_scored(n_ctx: int) -> int:
    return n_ctx // 2


def n_scored(n_ctx: int) -> int:
    """Tokens one chunk scores."""
    return n_ctx - 1 - first_scored(n_ctx)


def chunk_inputs(tokens, n_ctx: int, n_chunks: int = -1, bos: int | None = None) -> Iterator[tuple[int, list[int]]]:
    """(start, the chunk's input ids) per chunk: tokens[start : start + n_ctx], its first id replaced by `bos`."""
    tokens = list(tokens)
    total = len(tokens) // n_ctx
    n = total if n_chunks is None or n_chunks < 0 else min(n_chunks, total)
    for i in range(n):
        ids = tokens[i * n_ctx : (i + 1) * n_ctx]
        if bos is not None:
            ids[0] = int(bos)
        yield i * n_ctx, ids


def check_text_length(n_tokens: int, n_ctx: int) -> None:
    """llama-perplexity refuses a text shorter than two contexts; so does this."""
    if n_tokens < 2 * n_ctx:
        raise CflowError(f"the text tokenises to {n_tokens} tokens: perplexity with a context of {n_ctx} needs at "
                         f"least {2 * n_ctx} (give a longer text or a smaller -c)")


@attrs.define
class Perplexity:
    """Running sums of the negative log-likelihood (llama.cpp's nll, nll2, count)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0

    def add(self, chunk_logits: np.ndarray, chunk_tokens) -> None:
        """One chunk: its logits [n_ctx, vocab] and its n_ctx original token ids (targets are the originals)."""
        n_ctx = len(chunk_tokens)
        f = first_scored(n_ctx)
        lp = log_softmax(chunk_logits[f : n_ctx - 1])
        tgt = np.asarray(chunk_tokens[f + 1 : n_ctx], np.int64)
        v = -lp[np.arange(len(tgt)), tgt]
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += len(tgt)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """llama.cpp's +/-: ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return self.ppl * math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0


# --- the base-logits file -------------------------------------------------------------------------
def row_words(n_vocab: int) -> int:
    """uint16 words per scored position in the file (nv)."""
    return 2 * ((n_vocab + 1) // 2) + 4


def quantise_log_probs(logits: np.ndarray) -> np.ndarray:
    """Rows of the base file for logits [n, vocab]: uint16 [n, row_words] (llama.cpp's log_softmax writer)."""
    x = np.asarray(logits, np.float32)
    n, vocab = x.shape
    mx = x.max(axis=1)
    mn = np.maximum(x.min(axis=1), mx - np.float32(LOG_RANGE))
    lse = np.log(np.exp((x - mx[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    out = np.zeros((n, row_words(vocab)), np.uint16)
    head = np.stack([scale, (mn - mx - lse).astype(np.float32)], axis=1)
    out[:, :4] = head.view(np.uint16)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(scale > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
        q = np.rint(inv[:, None] * (x - mn[:, None])).astype(np.float32)
    q = np.where(x > mn[:, None], np.clip(q, 0, 65535), 0)
    out[:, 4 : 4 + vocab] = q.astype(np.uint16)
    return out


def base_log_probs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """float32 log-probabilities [n, vocab] the base file's rows hold."""
    head = np.ascontiguousarray(rows[:, :4]).view(np.float32)
    scale, low = head[:, 0:1], head[:, 1:2]
    return (scale * rows[:, 4 : 4 + n_vocab].astype(np.float32) + low).astype(np.float32)


class LogitsWriter:
    """Writes a base-logits file as chunks are scored (the header first: tokens of every chunk to be run)."""

    def __init__(self, path, n_ctx: int, n_vocab: int, n_chunk: int, tokens):
        tokens = np.asarray(tokens, np.int32)[: n_chunk * n_ctx]
        if tokens.size != n_chunk * n_ctx:
            raise CflowError(f"base logits: {tokens.size} tokens for {n_chunk} chunks of {n_ctx}")
        self.path, self.n_vocab = path, n_vocab
        try:
            self.f = open(path, "wb")  # noqa: SIM115 -- closed by close()
        except OSError as e:
            raise CflowError(f"--kl-divergence-base {path}: cannot write ({e.strerror})") from None
        self.f.write(MAGIC + struct.pack("<iii", n_ctx, n_vocab, n_chunk))
        self.f.write(tokens.astype("<i4").tobytes())

    def add(self, chunk_logits: np.ndarray) -> None:
        n_ctx = chunk_logits.shape[0]
        f = first_scored(n_ctx)
        self.f.write(quantise_log_probs(chunk_logits[f : n_ctx - 1]).astype("<u2").tobytes())

    def close(self) -> None:
        self.f.close()


@attrs.frozen
class BaseLogits:
    """A base-logits file, checked against its own sizes before anything is read (a file is untrusted input)."""

    path: str
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # int32 [n_chunk * n_ctx]
    data: np.ndarray  # uint16 [n_chunk, n_scored, row_words] (memory-mapped)

    @classmethod
    def open(cls, path) -> BaseLogits:
        import os

        name = os.fspath(path)
        try:
            size = os.path.getsize(name)
            with open(name, "rb") as f:
                head = f.read(20)
        except OSError as e:
            raise CflowError(f"--kl-divergence-base {name}: cannot read ({e.strerror})") from None
        if len(head) < 20 or head[:8] != MAGIC:
            raise CflowError(f"--kl-divergence-base {name}: not a base-logits file (no '_logits_' magic at offset 0)")
        n_ctx, n_vocab, n_chunk = struct.unpack("<iii", head[8:20])
        for what, v, at in (("n_ctx", n_ctx, 8), ("n_vocab", n_vocab, 12), ("n_chunk", n_chunk, 16)):
            if v <= 0 or v > (1 << 24):
                raise CflowError(f"--kl-divergence-base {name}: {what}={v} at offset {at} is out of range")
        if n_ctx < 4:
            raise CflowError(f"--kl-divergence-base {name}: n_ctx={n_ctx} at offset 8 is too small to score")
        nv = row_words(n_vocab)
        want = 20 + 4 * n_chunk * n_ctx + 2 * n_chunk * n_scored(n_ctx) * nv
        if size != want:
            raise CflowError(f"--kl-divergence-base {name}: {size} bytes, but n_ctx={n_ctx}, n_vocab={n_vocab}, "
                             f"n_chunk={n_chunk} need {want}")
        tokens = np.fromfile(name, dtype="<i4", count=n_chunk * n_ctx, offset=20)
        bad = np.flatnonzero((tokens < 0) | (tokens >= n_vocab))
        if bad.size:
            raise CflowError(f"--kl-divergence-base {name}: token {int(tokens[bad[0]])} at offset "
                             f"{20 + 4 * int(bad[0])} is not in 0..{n_vocab - 1}")
        data = np.memmap(name, dtype="<u2", mode="r", offset=20 + 4 * n_chunk * n_ctx,
                         shape=(n_chunk, n_scored(n_ctx), nv))
        return cls(name, n_ctx, n_vocab, n_chunk, tokens, data)


@attrs.define
class KLDivergence:
    """llama.cpp's kl_divergence_result: running sums against a base, and every position's KLD and Δp."""

    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    klds: list = attrs.Factory(list)
    p_diffs: list = attrs.Factory(list)

    def add(self, chunk_logits: np.ndarray, chunk_tokens, base_rows: np.ndarray) -> None:
        n_ctx = len(chunk_tokens)
        f = first_scored(n_ctx)
        x = np.asarray(chunk_logits[f : n_ctx - 1], np.float32)
        vocab = x.shape[1]
        lp = log_softmax(x)
        tgt = np.asarray(chunk_tokens[f + 1 : n_ctx], np.int64)
        rows = np.arange(len(tgt))
        nll = -lp[rows, tgt]
        base = base_log_probs(base_rows, vocab).astype(np.float64)
        nll_base = -base[rows, tgt]
        keep = base > -LOG_RANGE
        kld = np.where(keep, np.exp(base) * (base - lp), 0.0).sum(axis=1)
        p_diff = np.exp(-nll) - np.exp(-nll_base)
        self.sum_nll += float(nll.sum())
        self.sum_nll2 += float((nll * nll).sum())
        self.sum_nll_base += float(nll_base.sum())
        self.sum_nll_base2 += float((nll_base * nll_base).sum())
        self.sum_nll_nll_base += float((nll * nll_base).sum())
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float((kld * kld).sum())
        self.sum_p_diff += float(p_diff.sum())
        self.sum_p_diff2 += float((p_diff**2).sum())
        self.sum_p_diff4 += float((p_diff**4).sum())
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        self.n_same_top += int((x.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += len(tgt)
        self.klds += kld.tolist()
        self.p_diffs += p_diff.tolist()

    # statistics, as llama.cpp prints them
    @staticmethod
    def _mean_err(s: float, s2: float, n: int) -> tuple[float, float]:
        if n < 1:
            return 0.0, 0.0
        f = s / n
        df = s2 / n - f * f
        return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)

    def ppl(self) -> tuple[float, float]:
        m, e = self._mean_err(self.sum_nll, self.sum_nll2, self.count)
        return math.exp(m), math.exp(m) * e

    def ppl_base(self) -> tuple[float, float]:
        m, e = self._mean_err(self.sum_nll_base, self.sum_nll_base2, self.count)
        return math.exp(m), math.exp(m) * e

    def kld(self) -> tuple[float, float]:
        return self._mean_err(self.sum_kld, self.sum_kld2, self.count)

    def same_top(self) -> tuple[float, float]:
        p = self.n_same_top / self.count
        return p, math.sqrt(p * (1 - p) / (self.count - 1)) if self.count > 1 else 0.0

    def rms_p_diff(self) -> tuple[float, float]:
        m, e = self._mean_err(self.sum_p_diff2, self.sum_p_diff4, self.count)
        r = math.sqrt(m)
        return r, (0.5 / r * e if r > 0 else 0.0)

    def log_ratio(self) -> tuple[float, float]:
        a, ea = self._mean_err(self.sum_nll, self.sum_nll2, self.count)
        b, eb = self._mean_err(self.sum_nll_base, self.sum_nll_base2, self.count)
        cov = 0.0
        if self.count >= 10:
            cov = (self.sum_nll_nll_base / self.count - (self.sum_nll / self.count) * (self.sum_nll_base / self.count))
            cov /= self.count - 1
        return a - b, math.sqrt(max(0.0, ea * ea + eb * eb - 2 * cov))

    def report(self) -> str:
        """The statistics block llama-perplexity prints at the end of a --kl-divergence run."""
        def pct(values, q):
            v = np.sort(np.asarray(values))
            p = q * (len(v) - 1)
            i = int(p)
            p -= i
            return (1 - p) * v[i] + p * v[min(i + 1, len(v) - 1)]

        (pq, eq), (pb, eb), (lr, elr) = self.ppl(), self.ppl_base(), self.log_ratio()
        k, ek = self.kld()
        top, etop = self.same_top()
        rms, erms = self.rms_p_diff()
        dp, edp = self._mean_err(self.sum_p_diff, self.sum_p_diff2, self.count)
        out = ["====== Perplexity statistics ======",
               f"Mean PPL(Q)                   : {pq:10.6f} ± {eq:10.6f}",
               f"Mean PPL(base)                : {pb:10.6f} ± {eb:10.6f}",
               f"Mean ln(PPL(Q)/PPL(base))     : {lr:10.6f} ± {elr:10.6f}",
               f"Mean PPL(Q)/PPL(base)         : {math.exp(lr):10.6f} ± {math.exp(lr) * elr:10.6f}", "",
               "====== KL divergence statistics ======",
               f"Mean    KLD: {k:10.6f} ± {ek:10.6f}",
               f"Maximum KLD: {max(self.klds):10.6f}"]
        for q in (0.999, 0.99, 0.95, 0.90):
            out.append(f"{100 * q:4.1f}%   KLD: {pct(self.klds, q):10.6f}")
        out.append(f"Median  KLD: {float(np.median(self.klds)):10.6f}")
        for q in (0.10, 0.05, 0.01, 0.001):
            out.append(f"{100 * q:4.1f}%   KLD: {pct(self.klds, q):10.6f}")
        out += [f"Minimum KLD: {min(self.klds):10.6f}", "", "====== Token probability statistics ======",
                f"Mean    Δp: {100 * dp:6.3f} ± {100 * edp:5.3f} %",
                f"Maximum Δp: {100 * max(self.p_diffs):6.3f}%"]
        for q in (0.999, 0.99, 0.95, 0.90, 0.75):
            out.append(f"{100 * q:4.1f}%   Δp: {100 * pct(self.p_diffs, q):6.3f}%")
        out.append(f"Median  Δp: {100 * float(np.median(self.p_diffs)):6.3f}%")
        for q in (0.25, 0.10, 0.05, 0.01, 0.001):
            out.append(f"{100 * q:4.1f}%   Δp: {100 * pct(self.p_diffs, q):6.3f}%")
        out += [f"Minimum Δp: {100 * min(self.p_diffs):6.3f}%",
                f"RMS Δp    : {100 * rms:6.3f} ± {100 * erms:5.3f} %",
                f"Same top p: {100 * top:6.3f} ± {100 * etop:5.3f} %"]
        return "\n".join(out)

    def summary(self) -> dict:
        """The figures a benchmark records (JSON-ready)."""
        (pq, eq), (pb, eb) = self.ppl(), self.ppl_base()
        k, ek = self.kld()
        top, etop = self.same_top()
        return {"ppl": pq, "ppl_err": eq, "ppl_base": pb, "ppl_base_err": eb, "kld_mean": k, "kld_err": ek,
                "kld_p99": float(np.percentile(self.klds, 99)), "kld_max": float(max(self.klds)),
                "same_top": top, "same_top_err": etop, "rms_p_diff": self.rms_p_diff()[0], "count": self.count}
