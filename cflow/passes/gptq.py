"""Error feedback (GPTQ): each block of inputs quantised in turn, its error moved onto the inputs not yet quantised.

    Curvature(H)                        a matrix's input second moment H = mean x x^T over calibration text
                                        (passes/imatrix.py collects it with --imatrix TEXT), damped, factored once
    quantize(w, dtype, curv)            w [out, in] at dtype, block by block with the error fed forward
    output_error(w, t, curv)            tr((w - w') H (w - w')^T): the mean squared output error over the text

Why: the importance matrix is H's diagonal, so an importance-weighted fit rounds each weight as if its input moved
alone. Inputs correlate (a norm's output, a gated activation), and an error on one input can be cancelled by moving
the weights of inputs that move with it. GPTQ (Frantar et al., 2022) quantises the inputs in order and, after each
block S, corrects the inputs T not yet quantised by the least-squares update given S fixed:

    W_T -= (W_S - Q_S) U_SS^-1 U_ST,        H^-1 = U^T U (U upper triangular: Cholesky of the damped inverse)

done per block S of the type's own qk inputs (32, or 256 for the K-quants and IQ4_XS): the block's scales (and
sub-block scales and mins) are fit first, whole, by layout/quantize_blocks.py, its search weighted per input by
diag((U_SS^T U_SS)^-1), the block's curvature once the earlier blocks are fixed; then its codes are chosen input by
input under those scales, each input's error fed to the block's later inputs as well, and the block's errors to
every input after it in one product (GPTQ's lazy batch). Every type cflow quantises to goes through the same loop
(blocks.decompose gives any block's value grid, quantize_blocks.with_codes writes the codes back). Rows are
independent, so an error measured on sampled rows (passes/mix.py) is that of those rows in the whole matrix.

Measured (`python -m benchmarks.quantization --quick`, held-out text; docs/quantization.md): uniform Q4_0 mean KLD
on SmolLM2-135M's stand-in 0.195 importance-weighted -> 0.096 with error feedback, on a float Llama trained here
0.0031 -> 0.0018.
"""

from __future__ import annotations

import numpy as np

from ..layout.blocks import FORMATS, IQ4_VALUES, BlockTensor, decompose
from ..layout.quant import BLOCK_SIZES, DType, QTensor, dequantize
from ..layout.quantize_blocks import iq4_index, quantize_weighted, with_codes

DAMP = 0.01  # of H's mean diagonal, added to it: keeps the inverse defined for inputs the text never moved
# codegen/quantfit.py's gptq_codes, _by_input's loop as one native call (the same bits), set when it is imported (the
# compiler and cflowc's calibration import it); None: the NumPy loop, its oracle (tests/codegen/test_quantfit.py)
NATIVE_CODES = None


class Curvature:
    """One input's second moment H [in, in] (float64, shared by the matrices that read that input), its factor U and,
    per block size, each block's fit weights."""

    def __init__(self, h: np.ndarray):
        self.h = np.asarray(h, np.float64)
        self._u = None
        self._fits: dict[int, list[np.ndarray]] = {}

    @property
    def n(self) -> int:
        return self.h.shape[0]

    def factor(self) -> np.ndarray:
        """U with H^-1 = U^T U, H damped by DAMP of its mean diagonal (10x more, up to 3 times, where rounding
        leaves the damped matrix not positive definite)."""
        if self._u is None:
            d = np.diag(self.h)
            damp = DAMP * (float(d.mean()) if d.mean() > 0 else 1.0)
            for _ in range(4):
                h = self.h + damp * np.eye(self.n)
                try:
                    li = np.linalg.inv(np.linalg.cholesky(h))  # L^-1, with H = L L^T
                    self._u = np.linalg.cholesky(li.T @ li).T  # H^-1 = U^T U
                    break
                except np.linalg.LinAlgError:
                    damp *= 10
            else:
                self._u = np.eye(self.n) / np.sqrt(d.clip(min=1e-30))  # no correlations: the diagonal fit
        return self._u

    def fit_weights(self, qk: int) -> list[np.ndarray]:
        """Per block of qk inputs, the weight of each input in the block's scale search: diag((U_SS^T U_SS)^-1),
        the row norms of U_SS^-1 squared."""
        if qk not in self._fits:
            u = self.factor()
            self._fits[qk] = [(np.linalg.inv(u[s : s + qk, s : s + qk]) ** 2).sum(1).astype(np.float32)
                              for s in range(0, self.n, qk)]
        return self._fits[qk]


def _join(parts: list, rows: int, cols: int):
    """Per-block tensors (each [rows, qk]) -> one tensor of the same type [rows, cols]."""
    first = parts[0]
    if isinstance(first, BlockTensor):
        return BlockTensor(first.dtype, rows, cols, np.ascontiguousarray(np.concatenate([p.raw for p in parts], 1)))
    return QTensor(dtype=first.dtype, rows=rows, cols=cols,
                   scales=np.ascontiguousarray(np.concatenate([p.scales for p in parts], 1)),
                   q=np.ascontiguousarray(np.concatenate([p.q for p in parts], 1)))


def quantize(w: np.ndarray, dtype: DType, curv: Curvature):
    """w [out, in] float at dtype (a type of layout/quantize_blocks.WEIGHTED_TYPES), its blocks fit in input order with
    each one's error corrected on the inputs after it (module docstring)."""
    w = np.array(w, np.float32)  # a copy: the loop updates it
    rows, cols = w.shape
    if curv.n != cols:
        raise ValueError(f"a curvature of {curv.n} inputs for a matrix of {cols}")
    qk = BLOCK_SIZES[dtype][0]
    u = curv.factor().astype(np.float32)
    parts = []
    for b, fit in enumerate(curv.fit_weights(qk)):
        s = b * qk
        t = quantize_weighted(w[:, s : s + qk], dtype, fit)  # the block's scales
        t, err = _by_input(w, s, t, u)  # its codes, input by input; w's block updated as it goes
        if s + qk < cols:
            w[:, s + qk :] -= err @ u[s : s + qk, s + qk :]
        parts.append(t)
    return _join(parts, rows, cols)


def _grid(t):
    """The values one block [rows, qk] can take at its fitted scales: (S, M or None) per input [rows, qk], the
    lowest and highest stored code, the code book (IQ4) or None, and the bias: value = S * (book[c] or c - bias) + M."""
    if isinstance(t, QTensor):  # Q4_0: d (c - 8), c in 0..15; Q8_0: d c, c in -127..127
        S = np.repeat(t.scales.astype(np.float32), 32, axis=1)
        return (S, None, 0, 15, None, 8) if t.dtype == DType.Q4 else (S, None, -127, 127, None, 0)
    fmt = FORMATS[t.dtype]
    _, S, M = decompose(t)
    S = np.repeat(S, fmt.sub, axis=1)
    M = None if M is None else np.repeat(M, fmt.sub, axis=1)
    book = IQ4_VALUES.astype(np.float32) if fmt.signed else None
    return S, M, 0, (15 if fmt.signed else fmt.umax), book, fmt.bias


def _by_input(w, s: int, t, u: np.ndarray):
    """GPTQ inside one block: its scales kept from t, each input's code the one nearest its (corrected) weight, the
    scaled error U_jj^-1 (w_j - q_j) fed to the block's later inputs. Returns the block at those codes and the scaled
    errors [rows, qk] (for the inputs after the block: err @ U_ST)."""
    S, M, lo, hi, book, bias = _grid(t)
    rows, qk = S.shape
    inv = np.where(S != 0, 1 / np.where(S != 0, S, 1), 0).astype(np.float32)
    blk = w[:, s : s + qk]
    # the native call where its float32 arithmetic is the loop's (a NaN's code is whatever the cast makes of it:
    # left to NumPy)
    if (NATIVE_CODES is not None and w.dtype == S.dtype == u.dtype == np.float32
            and (M is None or M.dtype == np.float32) and not np.isnan(blk).any()):
        codes, err = NATIVE_CODES(blk, S, M, inv, u[s : s + qk, s : s + qk], lo, hi, bias, book is not None)
        return _with(t, codes), err
    codes = np.empty((rows, qk), np.int32)
    err = np.empty((rows, qk), np.float32)
    for k in range(qk):
        j = s + k
        x = w[:, j] if M is None else w[:, j] - M[:, k]
        if book is None:
            c = np.clip(np.rint(x * inv[:, k]) + bias, lo, hi)
            q = S[:, k] * (c - bias)
        else:
            c = iq4_index(x * inv[:, k]).astype(np.int32)
            q = S[:, k] * book[c]
        codes[:, k] = c
        e = (x - q) / u[j, j]
        err[:, k] = e
        if k + 1 < qk:
            w[:, j + 1 : s + qk] -= np.outer(e, u[j, j + 1 : s + qk])
    return _with(t, codes), err


def _with(t, codes: np.ndarray):
    """The block t at `codes` [rows, qk] (its scales kept)."""
    if isinstance(t, QTensor):
        return QTensor(dtype=t.dtype, rows=t.rows, cols=t.cols, scales=t.scales,
                       q=codes.astype(t.q.dtype).reshape(t.q.shape))
    return with_codes(t, codes)


def output_error(w: np.ndarray, t, curv: Curvature) -> float:
    """sum over rows of e H e^T, e = w - dequant(t): the mean squared output error over the calibration inputs (the
    unit of quantize_blocks.weighted_error with H's diagonal)."""
    e = (np.asarray(w, np.float32) - dequantize(t)).astype(np.float64)
    return float(((e @ curv.h) * e).sum())
