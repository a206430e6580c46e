"""The prefix cache: keys and values of earlier requests' prompts (and answers) kept in a bounded pool, so that a
request whose prompt starts with the same tokens (a system prompt, a chat's earlier turns, n choices of one
prompt) copies them into its slot instead of reading them again.

    cache = PrefixCache(budget_bytes)
    blocks = cache.lookup(ids)                 # the longest cached prefix of ids, as KV copies (a hit or a miss)
    cache.store(ids, n, read)                  # keep the whole blocks of ids[:n]; read(lo, hi) copies a span out

Blocks: a prefix is kept in blocks of BLOCK tokens (16: a multiple of every KV layout's alignment,
runtime/kv_blocks.py, small enough that a prompt loses at most 15 tokens of its match and that a pool block of a
1-billion-parameter model is a few MB). Block i of a sequence is only valid after blocks 0 .. i-1 of the same
tokens (its keys attended over them), so the blocks form a trie: a node per block, its children keyed by their
token tuples (exact: no hash can collide). A lookup walks the trie from the root and stops at the first block it
does not find; it never takes the prompt's last token, whose logits the request needs (at least one token is read).

Eviction: least recently used, whole blocks, leaves only. A lookup or store touches its path leaf first and root
last, so a parent is always more recent than its children and the least recent node is a leaf: evicting it never
strands a block behind a missing one. The budget counts the KV copies' bytes (the trie's own few hundred bytes
per block are not counted). A store that cannot fit its next block without evicting its own path stops there.

Counters (read by /metrics, serve/metrics.py): lookups that found a prefix (hits) and the tokens they took, lookups
that found none (misses: also prompts too short to have a whole block before their last token), blocks evicted,
bytes and blocks held. The cache is used by the engine thread only; /metrics reads the counters from another
thread (plain ints: a reading may be one update old).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

import numpy as np

BLOCK = 16  # tokens per cached block
MIN_CONTEXTS = 4  # the default budget holds at least this many whole contexts' keys and values
RAM_SHARE = 4  # and at most 1 / RAM_SHARE of the memory available once the model is loaded


def budget_bytes(cache_mb: float | None, context_bytes: int, slots: int, available: int | None) -> int:
    """The pool's budget: `cache_mb` MiB (0: no cache), or by default (None) the keys and values of as many whole
    contexts as there are slots, at least MIN_CONTEXTS (each slot's last conversation and a few shared prompts
    stay: at most as much again as the slots' own KV caches), capped at 1 / RAM_SHARE of `available` (the
    memory the process may still use, after loading) so that the default never pushes the machine into swap.
    An explicit size above `available` is refused: the pool fills up with use, and would fail later."""
    from ..errors import CflowError
    from ..util import format_bytes

    if cache_mb is None:
        want = max(slots, MIN_CONTEXTS) * context_bytes
        return want if available is None else min(want, available // RAM_SHARE)
    if not isinstance(cache_mb, (int, float)) or not math.isfinite(cache_mb) or cache_mb < 0:
        raise CflowError(f"--cache-mb must be a number >= 0 (0 turns the prefix cache off), not {cache_mb!r}")
    want = int(cache_mb * 2**20)
    if available is not None and want > available:
        raise CflowError(f"--cache-mb {cache_mb:g}: more than the {format_bytes(available)} of memory available "
                         "with the model loaded")
    return want


class _Node:
    __slots__ = ("tokens", "parent", "children", "kv")

    def __init__(self, tokens: tuple, parent: _Node | None, kv: np.ndarray | None):
        self.tokens, self.parent, self.kv = tokens, parent, kv
        self.children: dict[tuple, _Node] = {}


class PrefixCache:
    """KV copies of token blocks, a trie under an LRU byte budget (see the module docstring)."""

    def __init__(self, budget_bytes: int, block: int = BLOCK):
        if budget_bytes < 0 or block < 1:
            raise ValueError(f"budget {budget_bytes} and block {block}: must be >= 0 and >= 1")
        self.budget, self.block = int(budget_bytes), int(block)
        self._root = _Node((), None, None)
        self._lru: collections.OrderedDict[_Node, None] = collections.OrderedDict()  # least recent first
        self.bytes = 0
        self.hits = self.hit_tokens = self.misses = self.evictions = 0

    @property
    def blocks(self) -> int:
        return len(self._lru)

    # --- reading ----------------------------------------------------------------------------------
    def _walk(self, ids: Sequence[int], n_blocks: int) -> list[_Node]:
        """The cached nodes of ids' first blocks, at most n_blocks, from the root on."""
        path, node, B = [], self._root, self.block
        for i in range(n_blocks):
            node = node.children.get(tuple(ids[i * B : (i + 1) * B]))
            if node is None:
                break
            path.append(node)
        return path

    def _usable(self, n_tokens: int) -> int:
        """Whole blocks a prompt of n_tokens may take: its last token is always read."""
        return max(0, n_tokens - 1) // self.block

    def cached(self, ids: Sequence[int]) -> int:
        """Tokens of ids a lookup would take now (nothing is touched or counted)."""
        return len(self._walk(ids, self._usable(len(ids)))) * self.block

    def lookup(self, ids: Sequence[int]) -> list[np.ndarray]:
        """The KV copies of the longest cached whole-block prefix of ids (leaving at least its last token),
        in order; [] on a miss. Counted, and the blocks become the most recently used."""
        path = self._walk(ids, self._usable(len(ids)))
        if path:
            self.hits += 1
            self.hit_tokens += len(path) * self.block
            self._touch(path)
        else:
            self.misses += 1
        return [node.kv for node in path]

    def worth_waiting(self, ids: Sequence[int], other: Sequence[int]) -> bool:
        """Would `ids` take more from the cache once the prompt `other` (being read now) is stored? True when
        they share more whole blocks than the cache gives ids already."""
        n = min(len(other), self._usable(len(ids)) * self.block)
        common = 0
        while common < n and ids[common] == other[common]:
            common += 1
        return common // self.block > self.cached(ids) // self.block

    # --- writing ----------------------------------------------------------------------------------
    def store(self, ids: Sequence[int], n: int, read: Callable[[int, int], np.ndarray]) -> int:
        """Keep the whole blocks of ids[:n] (the tokens a slot's KV cache holds at positions 0 .. n-1); blocks
        already kept are only touched, the others copied with read(lo, hi). Returns the tokens now cached."""
        B = self.block
        want = min(n, len(ids)) // B
        path = self._walk(ids, want)
        if path:
            self._touch(path)
        node = path[-1] if path else self._root
        while len(path) < want and self.budget:
            lo = len(path) * B
            kv = read(lo, lo + B)
            if not self._make_room(kv.nbytes, len(path)):
                break
            child = _Node(tuple(ids[lo : lo + B]), node, kv)
            node.children[child.tokens] = child
            self._lru[child] = None
            self.bytes += kv.nbytes
            path.append(child)
            node = child
        if path:
            self._touch(path)
        return len(path) * B

    def _make_room(self, nbytes: int, keep: int) -> bool:
        """Evict least recently used leaves until nbytes more fit; False if only the `keep` nodes of the path
        being stored (the most recent ones) would be left to evict."""
        while self.bytes + nbytes > self.budget:
            if len(self._lru) <= keep:
                return False
            self._evict(next(iter(self._lru)))
        return True

    def _evict(self, node: _Node) -> None:
        assert not node.children, "the least recently used node is a leaf"
        del self._lru[node]
        del node.parent.children[node.tokens]
        self.bytes -= node.kv.nbytes
        self.evictions += 1

    def _touch(self, path: list[_Node]) -> None:
        for node in reversed(path):  # leaf first, root last: a parent stays more recent than its children
            self._lru.move_to_end(node)

    def clear(self) -> None:
        self._root = _Node((), None, None)
        self._lru.clear()
        self.bytes = 0
