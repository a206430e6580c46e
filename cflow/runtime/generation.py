"""The token loop of one generation on slot 0 of a session: plain decode (one step per token) or speculative
(runtime/speculate.py), behind one generator. The caller (CompiledModel's stream) turns ids into text and
decides where to stop; this module decides how each next token is computed.

Two hooks keep the loop safe without knowing who owns the session: `guard()` runs before every native call
(the model may have been closed in between: refuse rather than run on freed buffers) and `check(logits)` on
every logits row before a token is drawn from it (NaN / Inf from a crafted file).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .sampling import Sampler
from .speculate import Speculation, Speculator, sharing_cores  # noqa: F401 -- sharing_cores: callers' name


def plain(s, logits: np.ndarray, sampler: Sampler, max_new: int, guard: Callable[[], None],
          check: Callable[[np.ndarray], None]) -> Iterator[int]:
    """Up to `max_new` tokens, one decode step each; the last token is drawn, never fed."""
    for i in range(max_new):
        check(logits)
        tok = sampler(logits)
        yield tok
        if i + 1 == max_new:
            return
        guard()
        logits = s.step(tok)


def speculative(s, logits: np.ndarray, sampler: Sampler, drafter, spec: Speculation, ids: list[int],
                max_new: int, guard: Callable[[], None], check: Callable[[np.ndarray], None]) -> Iterator[int]:
    """Up to `max_new` tokens, several per pass when drafts stand (the same tokens as `plain` for greedy decoding
    and deterministic drafts). Whenever the consumer stops, s.pos counts exactly the tokens whose keys and
    values the cache holds: a prefix of ids and the emitted tokens."""
    sp = Speculator(s, sampler, drafter, spec, ids, guard=guard, check=check)
    try:
        if max_new <= 0:
            return
        tok = sp.draw(logits)
        yield tok
        while sp.emitted < max_new:
            if spec.pause:  # drafting does not pay here: plain decode's loop until the pause ends
                for t in sp.coast(tok, min(spec.pause, max_new - sp.emitted)):
                    yield t
                    tok = t
                continue
            new = sp.advance(tok, max_new - sp.emitted)
            yield from new
            tok = new[-1]
    finally:
        sp.finish()
