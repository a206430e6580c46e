"""The next layer's experts guessed early, so that their reads start a layer ahead (experts on disk).

When layer l has routed, this thread's scratch still holds the router's input: x = rmsnorm(h) * w_l, with h
the residual stream in the middle of layer l. The next routed layer's router will see rmsnorm(h') * w_next,
where h' adds layer l's experts and the next layer's attention to h. The guess takes h' ~ h:

    x_next ~ (x / w_l) * w_next,    guess = top-k of W_router_next x_next

A guess only starts reads (ExpertTier.prefetch: not pinned, evicted like any cached expert): the real router
still decides what runs, so a wrong guess costs a read and a cache slot, never a wrong token.
"""

from __future__ import annotations

import numpy as np

from ..ir.nodes import Router


def _f32(a: np.ndarray) -> np.ndarray:
    """A stored f32 tensor (typed, or its raw bytes) as a flat f32 copy, off the file's mapping."""
    a = np.ascontiguousarray(a).reshape(-1)
    return (a.view(np.float32) if a.dtype != np.float32 else a).copy()


class RouteGuess:
    """Per routed layer: its router's norm weight and weights, read from the file once (f32)."""

    def __init__(self, run_state, tensor, at: int, only: set[int] | None = None):
        """run_state: the plan the step runs; tensor(name) -> its stored array (the norms and routers are kept
        in f32 by every layout); at: the byte offset of the router's input (xn) in thread 0's scratch; only: the
        layers worth guessing (default all): those whose reads no expert-delay window hides (on the 17.7 GB
        pipeline-native model guesses for windowed layers only added reads: 3.86 against 4.73 tok/s)."""
        g = run_state.graph
        self.at = at
        self.only = only
        self.layers: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # layer -> (norm w, router W, top_k)
        for step in run_state.schedule.steps():
            node = g[step.op]
            if isinstance(node, Router) and step.norm and node.layer not in self.layers:
                w = _f32(tensor(step.norm))[: node.dim]
                r = _f32(tensor(node.weight)).reshape(node.n_experts, -1)[:, : node.dim].copy()
                self.layers[node.layer] = (w, r, node.top_k)
        order = sorted(self.layers)
        self.next = dict(zip(order, order[1:]))  # routed layer -> the next routed layer
        self.inv = {l: np.where(np.abs(w) > 1e-12, 1.0 / np.where(w == 0, 1, w), 0.0).astype(np.float32)
                    for l, (w, _, _) in self.layers.items()}

    def guess(self, layer: int, scratch: np.ndarray) -> tuple[int, np.ndarray] | None:
        """(the next routed layer, the experts its router would choose) from layer `layer`'s router input, read
        in the step's scratch (bytes) just after that layer routed; None after the last routed layer."""
        nxt = self.next.get(layer)
        if nxt is None or (self.only is not None and nxt not in self.only):
            return None
        w, r, k = self.layers[nxt]
        x = scratch[self.at : self.at + 4 * w.size].view(np.float32)
        xin = x * self.inv[layer] * w
        # einsum's own loop, not BLAS: OpenBLAS's threads spin after each call on the cores the decode threads
        # need (a guess per layer made a 48-layer token 1.4x slower with `r @ xin`)
        logits = np.einsum("ij,j->i", r, xin)
        top = np.argpartition(-logits, k - 1)[:k]
        return nxt, top[np.argsort(-logits[top])]  # most likely first: the tier may take only the first few
