"""Next-token choice from logits: greedy, temperature, top-k, top-p (nucleus), seeded."""

from __future__ import annotations

import numpy as np

from ..errors import CflowError


class Sampler:
    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if temperature < 0:
            raise CflowError(f"temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise CflowError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise CflowError(f"top_k must be >= 0, got {top_k}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float64)
        if self.temperature == 0.0:
            return int(np.argmax(logits))  # ties: the lowest id, like torch.argmax
        z = logits / self.temperature
        order = np.argsort(-z, kind="stable")
        if self.top_k:
            order = order[: self.top_k]
        p = np.exp(z[order] - z[order[0]])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        return int(order[self.rng.choice(len(order), p=p)])
