"""Copy the keys and values of a slot's positions out of a session's KV cache, and back into any slot: the
primitive under the server's prefix cache (cflow/serve/prefix_cache.py).

    spans = KVSpans(session)
    blk = spans.read(slot, lo, hi)       # a copy of positions [lo, hi) of `slot`: [K|V, layer, kv head, entries]
    spans.write(slot, lo, blk)           # the same positions of any slot
    spans.restore(slot, [b0, b1, ...])   # blocks from position 0 on; the slot then holds a sequence of their
                                         # length (Session.resume): its next token goes after them

Where an entry lives is attention.kv_layout's business: K in blocks of kv_block(max_seq) positions, dimension
after dimension inside a block (with bf16, pairs of dimensions); V position after position (with bf16, pairs of
positions). For positions [lo, hi) whose ends are multiples of `align` (the K block, and 2 for bf16), the
entries of one (layer, K|V, kv head) are one contiguous run of (hi - lo) x head_dim entries that starts where
position lo's dimension 0 sits; so a span is one strided view per K and per V, [layer, kv head, run], and a copy
is one numpy assignment each. The entries are copied as they are stored (f16 / bf16 as their bits): a restored
slot attends over exactly the keys and values the first one computed, and the multi-token kernels compute every
token as a decode step of it alone (kernels.emit_matmat), so what follows is bit for bit what reading the whole
prompt in that slot gives (tests/runtime/test_kv_blocks.py).

A sequence's positions depend only on its own tokens (no state crosses slots), so a prefix's keys and values
serve any later sequence that starts with the same tokens, in any slot of a model loaded from the same file with
the same context and KV type (the spans' geometry; `key` says which).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..codegen.abi import kv_floats_per_layer
from ..codegen.attention import kv_block, kv_layout
from ..errors import RuntimeFault


class KVSpans:
    """Spans of positions of one session's KV cache: read out, written back, restored as a slot's prefix."""

    def __init__(self, session):
        cfg = session.config
        self.s = session
        self.layers, self.heads, self.head_dim = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.max_seq, self.kv_type = session.max_seq, session.kv_dtype
        self.align = math.lcm(kv_block(self.max_seq), 2 if self.kv_type == "bf16" else 1)
        self.per = kv_floats_per_layer(cfg, self.max_seq)  # entries of one layer's K (or V)
        k_at, v_at = kv_layout(self.max_seq, self.heads, self.head_dim, self.kv_type)
        # entries between the runs of two kv heads, in K and in V (V's positions are rounded up to even with bf16)
        self.head_stride = (k_at(0, 1, 0), v_at(0, 1, 0))
        a, hd, last = self.align, self.head_dim, self.heads - 1
        for at, stride in zip((k_at, v_at), self.head_stride):  # the layout the runs assume
            if (at(a, last, 0) != last * stride + a * hd
                    or at(2 * a - 1, last, hd - 1) != last * stride + 2 * a * hd - 1):
                raise RuntimeFault("the KV cache layout has changed: kv_blocks' spans no longer match it")

    @property
    def key(self) -> tuple:
        """What a copied span is only valid for: the layout of the cache it came from (the model's file apart)."""
        return (self.layers, self.heads, self.head_dim, self.max_seq, self.kv_type)

    def nbytes(self, n: int) -> int:
        """Bytes of a copy of n positions."""
        return 2 * self.layers * self.heads * n * self.head_dim * self.s.kv.itemsize

    def _check(self, slot: int, lo: int, hi: int) -> int:
        slot = self.s._check_slot(slot)
        self.s.native.wait()  # a detached step in flight writes the cache: let it finish first
        if not (0 <= lo < hi <= self.max_seq and lo % self.align == 0 and hi % self.align == 0):
            raise RuntimeFault(f"KV span [{lo}, {hi}) must lie in 0..{self.max_seq} with both ends multiples of "
                               f"{self.align}")
        return slot

    def _view(self, slot: int, which: int, lo: int, hi: int) -> np.ndarray:
        """K (which=0) or V (1) of positions [lo, hi) of `slot` as a writable view [layer, kv head, run]."""
        kv = self.s.kv
        it = kv.itemsize
        start = (slot * self.layers * 2 + which) * self.per + lo * self.head_dim
        return np.lib.stride_tricks.as_strided(
            kv[start:], shape=(self.layers, self.heads, (hi - lo) * self.head_dim),
            strides=(2 * self.per * it, self.head_stride[which] * it, it))

    def read(self, slot: int, lo: int, hi: int) -> np.ndarray:
        """A copy of positions [lo, hi) of `slot`: [2 (K, V), layer, kv head, (hi - lo) x head_dim] entries."""
        slot = self._check(slot, lo, hi)
        out = np.empty((2, self.layers, self.heads, (hi - lo) * self.head_dim), self.s.kv.dtype)
        for which in (0, 1):
            out[which] = self._view(slot, which, lo, hi)
        return out

    def write(self, slot: int, lo: int, block: np.ndarray) -> int:
        """Put a copy made by read() at positions [lo, lo + its length) of `slot`; returns that end."""
        n, rest = divmod(block.shape[-1], self.head_dim)
        hi = lo + n
        slot = self._check(slot, lo, hi)
        if rest or block.shape[:3] != (2, self.layers, self.heads) or block.dtype != self.s.kv.dtype:
            raise RuntimeFault(f"KV span of shape {block.shape} ({block.dtype}) does not fit this cache "
                               f"(2, {self.layers}, {self.heads}, n x {self.head_dim}) of {self.s.kv.dtype}")
        for which in (0, 1):
            self._view(slot, which, lo, hi)[...] = block[which]
        return hi

    def restore(self, slot: int, blocks: Sequence[np.ndarray]) -> int:
        """Write consecutive blocks from position 0 into `slot` and start a sequence there that holds them
        (Session.resume: the slot's next token goes to the returned position)."""
        pos = 0
        for b in blocks:
            pos = self.write(slot, pos, b)
        self.s.resume(slot, pos)
        return pos
