"""The next token of one sequence: a `Sampler` (temperature, top-k, top-p, seed) behind optional rules, and the
model's log-probabilities of what it chose.

A `Chooser` is called like a Sampler (`__call__(logits)`, `draw(logits, u)`, `probabilities`, `greedy`, `rng`),
so the token loops take either. Before the Sampler's distribution, the rules change a copy of the logits row
(never the caller's array), in this order (vLLM's):

    1. logit_bias            {id: b}: b added to the token's logit
    2. repetition_penalty r  each distinct token among the last `repetition_window` tokens of prompt (`prompt_ids`)
                             + generated text (llama.cpp's penalty_last_n; default 64, -1 = all, 0 = none): a positive
                             logit divided by r, a negative one multiplied by r (llama.cpp's and transformers' rule)
    3. frequency_penalty f,  OpenAI's definition, over the generated tokens only: a token generated c times so far
       presence_penalty p    loses c * f + (c > 0) * p
    4. constraint            tokens its mask disallows are out (probability 0; structured output)
    5. temperature T, then min_p: tokens whose probability is below min_p x the best token's are dropped (the
       logit below best + T * ln(min_p)); then top_k, top_p and the draw, as the Sampler defines them

With no rule and no logprobs a Chooser is its Sampler: the same draws from the same generator, the same tokens
for the same seed.

logprobs (top_n >= 0): every chosen token is recorded with the model's own log-softmax of the raw logits row
(before any rule or temperature) at that token, and the top_n best tokens of that row with theirs (ranked by
logit, ties by the lower id). A caller takes the record of each token it emits with `take(token)`.

A constraint is any object with `allowed()` -> a bool array [n] of the tokens allowed next (ids >= n are not) or
None (no restriction now), `accept(token)`, and a `finished` property (only end-of-text may follow: the Chooser
then returns `eos_id` without drawing); optionally `try_accept(token)` -> bool (advance if allowed: the Chooser
then draws first and masks only refused draws, see `_draw_then_check`) and `forced()` -> the one token allowed
next when the grammar forces it, else None (taken without a mask or a draw). One Chooser serves one generation:
it keeps that sequence's history.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np

from ..errors import CflowError
from .sampling import BLOCK, Sampler, _crossing, _pick, _top

MAX_TOP_LOGPROBS = 20  # alternatives a record may list (OpenAI's limit for chat)
REPETITION_WINDOW = 64  # llama.cpp's default penalty_last_n
# Under a grammar a token is drawn from the unmasked row first (the mask computed only if the grammar refuses it),
# or from the masked row at once, whichever is likely cheaper. A draw the grammar takes costs one engine call; a
# refused one costs a whole row's softmax, up to TRIES engine calls, and the mask after all, several times what
# masking first costs (the model insists on text the grammar keeps out: spaces in an e-mail address, prose where
# a JSON value's end is due). Whether the model's choice fits the grammar runs in streaks (inside a JSON string
# it does; after the string's end it does not), so the Chooser keeps, for each kind of token before (`_after`:
# none, forced, one the model's draw gave, one the mask was needed for), the running share of tokens that needed
# the mask (weight NEED_RATE per token), and draws from the masked row first while that share is above
# MASK_FIRST. A token masked first counts as needing it where the mask leaves few tokens (FEW or less: a draw
# among them costs next to nothing) or does not allow the row's best token (the model's draw would likely have
# been refused). Either way the token is the masked distribution's: the choice changes the cost, never the draw.
MASK_FIRST, NEED_RATE = 0.5, 0.25
_START, _FORCED, _TAKEN, _MASKED = range(4)
FEW = 32  # a mask leaving this many tokens or fewer is narrow; a draw among them is done without numpy
TRIES = 3  # draws from the unmasked row before the grammar's mask is computed (see Chooser._draw_then_check)


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token, its log-probability, and the best tokens of the same row: ((id, logprob), ...)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class _Guess:
    """What guess() drew for the next call: its uniform, the token, and for a masked draw the draw's stats."""

    u: float | None
    token: int
    stats: tuple[int, int] | None = None


class Chooser:
    """Sampler(temperature, top_k, top_p, seed) behind the rules of the module docstring; logprobs=N records each
    chosen token's logprob and its row's N best (None: no records)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 min_p: float = 0.0, logit_bias: dict | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 repetition_window: int = REPETITION_WINDOW, prompt_ids=(), logprobs: int | None = None,
                 constraint=None, eos_id: int | None = None):
        self.sampler = Sampler(temperature, top_k, top_p, seed)
        self.seed = seed
        _check(0 <= min_p <= 1, "min_p must be in [0, 1]", min_p)
        for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            _check(-2 <= v <= 2, f"{name} must be in [-2, 2]", v)
        _check(0 < repetition_penalty < math.inf, "repetition_penalty must be a finite number > 0", repetition_penalty)
        _check(isinstance(repetition_window, int) and repetition_window >= -1,
               "repetition_window must be -1 (all), 0 (none) or a number of tokens", repetition_window)
        _check(logprobs is None or 0 <= logprobs <= MAX_TOP_LOGPROBS,
               f"logprobs must be None or 0..{MAX_TOP_LOGPROBS}", logprobs)
        bias = {int(k): float(v) for k, v in (logit_bias or {}).items()}
        _check(all(i >= 0 for i in bias), "logit_bias ids must be >= 0", logit_bias)
        _check(all(-100 <= v <= 100 for v in bias.values()), "logit_bias values must be in [-100, 100]", logit_bias)
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)
        self._bias = np.array([bias[i] for i in sorted(bias)], dtype=np.float64)
        self.min_p, self.presence, self.frequency = float(min_p), float(presence_penalty), float(frequency_penalty)
        self.repetition, self.window = float(repetition_penalty), repetition_window
        self.top_n = logprobs
        self.constraint, self.eos_id = constraint, eos_id
        self.history = [int(i) for i in prompt_ids]  # prompt + accepted tokens: what the repetition penalty sees
        self._seen = set(self.history) if repetition_window == -1 else None
        self._counts: dict[int, int] = {}  # generated token -> times (frequency and presence penalties)
        self._records: collections.deque[TokenLogprob] = collections.deque()
        self._edits = bool(bias) or self.presence != 0 or self.frequency != 0 or (
            self.repetition != 1 and self.window != 0)  # rules that change logits (on a copy)
        self._rules = self._edits or self.min_p > 0
        self._need = [1.0, 0.5, 0.0, 0.5]  # share of tokens that needed the mask, by the kind of token before
        self._after = _START
        self._greedy = self.sampler.greedy
        plain = self._greedy or (self.top_k == 0 and self.top_p == 1.0 and self.min_p == 0)
        self._try_first = plain and hasattr(constraint, "try_accept")  # draw first, mask if refused: exact here
        self._forced = getattr(constraint, "forced", None)  # the token the grammar forces next, or None
        self._guess: _Guess | None = None  # what guess() drew for the next call
        # share of draw-first tokens whose first draw the grammar refused, by the kind of token before (as _need):
        # the odds that a guess (the first draw) is refused
        self._refused = [0.5, 0.5, 0.0, 0.5]
        self._first_refused = False

    # --- a Sampler's interface -----------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.sampler.greedy

    @property
    def rng(self) -> np.random.Generator:
        return self.sampler.rng

    @property
    def temperature(self) -> float:
        return self.sampler.temperature

    @property
    def top_k(self) -> int:
        return self.sampler.top_k

    @property
    def top_p(self) -> float:
        return self.sampler.top_p

    @property
    def plain(self) -> bool:
        """No rule, no constraint, no logprobs: the Sampler's tokens (speculative decoding may draft for it)."""
        return not self._rules and self.constraint is None and self.top_n is None

    def __call__(self, logits: np.ndarray) -> int:
        """The next token (one uniform from the generator unless greedy, as Sampler.__call__; the one guess()
        drew, if it was called on this row)."""
        if self._guess is not None:
            return self.draw(logits, self._guess.u)
        return self.draw(logits, None if self.greedy else self.rng.random())

    def guess(self, logits: np.ndarray, odds: float = 0.0) -> int | None:
        """The token the next call on this row will return unless the grammar refuses it, before any of the
        grammar's work: the token it forces, or (drawing first) the draw from the unmasked row; None where the
        call masks first or the guess would cost the call's work (rules, top-k / top-p / min_p). The call then
        takes the same uniform and draw, so guessing changes no token; the server starts the model's step for the
        guess while the grammar checks it (serve/backends.py). `odds`: what a refused guess costs against what an
        accepted one saves (the server's: the rest of a step against the grammar's check); a draw is not guessed
        where the share of refused first draws p here (the kind of token before) says p x odds > 1 - p."""
        c = self.constraint
        self._guess = None
        if c is None or c.finished:
            return None
        tok = self._forced() if self._forced is not None else None
        if tok is not None:
            return tok
        if not self._draws_first(self._after):
            return self._guess_masked(logits)
        p = self._refused[self._after]
        if p * odds > 1 - p:
            return None
        x = logits
        if self._greedy:
            if type(x) is not np.ndarray or x.dtype.kind != "f" or self._edits:
                return None
            self._guess = _Guess(None, int(np.argmax(x)))
        elif self._native_row(x):
            u = self.rng.random()
            self._guess = _Guess(u, self.sampler.draw(x, u))
        else:
            return None
        return self._guess.token

    def _guess_masked(self, x: np.ndarray) -> int | None:
        """Masking first with the mask known already (prepare() made it while the step ran): the masked draw the
        call will make (`_native_masked`), which the grammar cannot refuse; the call takes it and only accepts
        it. None where the draw would not be native or the mask is not known."""
        c = self.constraint
        if not self._native_row(x) or not getattr(c, "mask_known", False):
            return None
        d, u = self.sampler.native(), self.rng.random()
        tok = d.masked(x, self.temperature, u, c.allowed_bits())
        self._guess = _Guess(u, tok, tuple(d.stats.tolist()))
        return tok if tok >= 0 else None

    def draw(self, logits: np.ndarray, u: float | None) -> int:
        """The token uniform `u` selects from the distribution the rules leave; recorded and accepted."""
        c = self.constraint
        if c is not None:
            tok = self._draw_constrained(c, logits, u)
        else:
            x, ids = self._adjusted(logits)
            i = self.sampler.draw(x, u)
            tok = i if ids is None else int(ids[i])
        self._guess = None
        if self.top_n is not None:
            self._records.append(self.logprob(logits, tok))
        self.history.append(tok)
        if self._seen is not None:
            self._seen.add(tok)
        self._counts[tok] = self._counts.get(tok, 0) + 1
        return tok

    def prepare(self) -> None:
        """Do now the grammar's work that the next call starts with and that needs no logits: the mask, where the
        next token is to be drawn from the masked row (masking first) and no forced token is known. The server
        calls this while the model's step runs, so that the mask is ready when its logits are; the next call's
        token is the same either way (the mask is the state's)."""
        c = self.constraint
        if c is None or c.finished or (self._forced is not None and self._forced() is not None):
            return
        if self._draws_first(self._after):
            return
        try:
            c.allowed_bits() if hasattr(c, "allowed_bits") else c.allowed()
        except CflowError:
            pass  # the engine's limit: the next call meets it again and says so

    def _draws_first(self, after: int) -> bool:
        """Is the next token (after a token of kind `after`) drawn first and checked (else masked first)?"""
        return self._try_first and (self._greedy or self._need[after] < MASK_FIRST)

    def _draw_constrained(self, c, logits: np.ndarray, u: float | None) -> int:
        """The next token under constraint `c`: a token the grammar forces is taken as it is (the only one its mask
        would allow: nothing to draw); otherwise drawn first (`_draw_then_check`) or from the masked row, by which
        is likely cheaper here (`_need`). Either way the token is the masked distribution's."""
        if c.finished:  # only end of text may follow: end the sequence
            return self._end("the constraint is complete")
        tok = self._forced() if self._forced is not None else None
        if tok is not None:
            c.accept(tok)
            self._after = _FORCED
            return tok
        after = self._after
        if self._draws_first(after):
            tok, needed = self._draw_then_check(logits, u)
            self._refused[after] += NEED_RATE * (self._first_refused - self._refused[after])
        else:
            tok, needed = self._mask_first(logits, u)
        self._need[after] += NEED_RATE * (needed - self._need[after])
        self._after = _MASKED if needed else _TAKEN
        return tok

    def _draw_then_check(self, logits: np.ndarray, u: float | None) -> tuple[int, bool]:
        """(token, whether the mask was needed): a draw from the unmasked row, the mask computed only when the
        grammar refuses it. The same distribution as masking first when nothing truncates by rank or by the best
        token. Greedy: the argmax if the grammar takes it, else the masked argmax. Plain temperature: up to TRIES
        draws (the first with `u`, the others with fresh uniforms) from the unmasked row less the tokens refused
        so far, until the grammar takes one; the grammar allows none of the tokens left out, so each draw it
        takes is distributed as the masked draw (rejection sampling), whichever try gives it. Leaving them out
        spares the tries a token the model insists on (a line break inside a JSON string). If none is taken,
        the mask, and a draw among the tokens it allows (native over a float32 row: `_native_masked`)."""
        c = self.constraint
        x = logits
        if type(x) is not np.ndarray or x.dtype.kind != "f" or self._edits:
            x, _ = self._adjusted(logits, mask=False)
        g = self._guess  # guess() drew the first draw from this row already
        guessed = g.token if g is not None and g.stats is None else None
        self._first_refused = False
        if self._greedy:
            tok = int(np.argmax(x)) if guessed is None else guessed
            if c.try_accept(tok):
                return tok, False
            self._first_refused = True
            return self._draw_masked(logits, None)[0], True
        if self._native_row(x):
            tok = self.sampler.draw(x, u) if guessed is None else guessed
            if c.try_accept(tok):
                return tok, False
            self._first_refused = True
            out = np.full(-(-x.size // 32), -1, np.int32).view(np.uint32)  # every token, less the refused
            for _ in range(1, TRIES):
                out[tok >> 5] &= np.uint32(~(1 << (tok & 31)) & 0xFFFFFFFF)
                tok = self.sampler.native().masked(x, self.temperature, self.rng.random(), out.view(np.int32))
                if tok < 0:
                    break
                if c.try_accept(tok):
                    return tok, False
            return self._native_masked(x, self.rng.random())[0], True
        draws = _Draws(x, self.sampler)
        for k in range(TRIES):
            tok = draws.pick(u if k == 0 else self.rng.random())
            if c.try_accept(tok):
                return tok, False
            self._first_refused = True
            if not draws.drop(tok):
                break
        allowed = c.allowed()
        if allowed is not None:  # the row's weights kept to the allowed tokens: the masked row's, scaled
            tok = draws.pick_in(allowed, self.rng.random())
            if tok is not None:
                c.accept(tok)
                return tok, True
        return self._draw_masked(logits, self.rng.random())[0], True

    def _native_row(self, x: np.ndarray) -> bool:
        """Can the constrained draws of this row go native: plain temperature (no rule, no top-k / top-p / min_p,
        not greedy), a float32 row as the model gives it, a constraint that packs its mask."""
        return (type(x) is np.ndarray and not self._rules and self._try_first and not self._greedy
                and x.dtype == np.float32 and x.flags.c_contiguous and x.ndim == 1
                and getattr(self.constraint, "allowed_bits", None) is not None)

    def _native_masked(self, x: np.ndarray, u: float) -> tuple[int, bool]:
        """(token, whether masking first paid: the mask left FEW tokens or fewer, or not the row's best): the
        constraint's packed mask and one native draw among the tokens it allows (codegen/draw.py: the masked
        row's softmax weights, as `_draw_masked` takes them)."""
        c, d = self.constraint, self.sampler.native()
        if self._guess is not None and self._guess.stats is not None:  # guess() made this very draw
            tok, stats = self._guess.token, self._guess.stats
        else:
            tok = d.masked(x, self.temperature, u, c.allowed_bits())
            stats = tuple(d.stats.tolist())
        if tok == -2:
            return self._end("the constraint allows no token"), True
        if tok < 0:
            ok = c.allowed()
            k = min(ok.size, x.size)
            raise CflowError(f"cannot sample: the largest allowed logit is {x[:k][ok[:k]].max()}")
        c.accept(tok)
        count, best = stats
        return tok, count <= FEW or not best

    def _mask_first(self, logits: np.ndarray, u: float | None) -> tuple[int, bool]:
        """(token, whether masking first paid: the mask left few tokens or refused the row's best): the mask, then
        a draw among the tokens it allows: native where it can be (`_native_masked`), else from the masked row
        (`_draw_masked`)."""
        if self._native_row(logits) and u is not None:
            return self._native_masked(logits, u)
        return self._draw_masked(logits, u)

    def _draw_masked(self, logits: np.ndarray, u: float | None) -> tuple[int, bool]:
        """(token, whether masking first paid: the mask left few tokens or refused the row's best): a draw from
        the masked row."""
        x, ids = self._adjusted(logits)
        if x is None:
            return self._end("the constraint allows no token"), True
        if ids is None:  # the constraint restricts nothing here
            tok = self.sampler.draw(x, u)
        elif ids.size == 1:  # one token allowed: nothing to draw
            tok = int(ids[0])
        else:
            tok = self._pick(x, ids, u)
        self.constraint.accept(tok)
        if ids is None:
            return tok, False
        return tok, ids.size <= FEW or not _holds(ids, int(np.argmax(logits)))

    def _pick(self, x: np.ndarray, ids: np.ndarray | None, u: float) -> int:
        """The Sampler's draw; for the few tokens a mask leaves under plain temperature its arithmetic without its
        general machinery (the same weights, exp((x - max) / T) in float64, and the same inverse CDF), in plain
        Python for a handful of tokens."""
        if ids is not None and not self.greedy and self.top_k == 0 and self.top_p == 1.0:
            if ids.size <= FEW:  # in plain Python: a handful of numpy calls cost more than the arithmetic
                xs = x.tolist()
                top, t = max(xs), self.temperature
                c = list(itertools.accumulate(math.exp((v - top) / t) for v in xs))
                i = bisect.bisect_right(c, u * c[-1])
                return int(ids[i if i < len(c) else bisect.bisect_left(c, c[-1])])
            w = np.exp(np.subtract(x, x.max(), dtype=np.float64) / self.temperature)
            return int(ids[_pick(w, u)])
        i = self.sampler.draw(x, None if self.greedy else u)
        return i if ids is None else int(ids[i])

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the next draw is from, over the vocabulary (float64; changes nothing)."""
        x, ids = (None, None) if self.constraint is not None and self.constraint.finished else self._adjusted(logits)
        if x is None:
            out = np.zeros(np.asarray(logits).size)
            out[self._end("the constraint allows no token")] = 1.0
            return out
        if ids is None:
            return self.sampler.probabilities(x)
        out = np.zeros(np.asarray(logits).size)
        out[ids] = self.sampler.probabilities(x)
        return out

    # --- logprobs ----------------------------------------------------------------------------------------
    def take(self, token: int) -> TokenLogprob | None:
        """The record of `token`, the oldest not taken (records of tokens the caller never emitted, such as an
        end-of-text, are passed over); None without logprobs."""
        while self._records:
            r = self._records.popleft()
            if r.token == token:
                return r
        return None

    def logprob(self, logits: np.ndarray, token: int) -> TokenLogprob:
        """`token`'s log-softmax in the raw row `logits`, with the row's top_n best tokens (no full sort)."""
        x = np.asarray(logits)
        if x.dtype.kind != "f":
            x = x.astype(np.float64)
        top = float(x.max())
        lse = top + math.log(np.exp(x - x.dtype.type(top)).sum(dtype=np.float64))  # exp in the row's precision
        best = _top(x, self.top_n) if self.top_n else ()
        return TokenLogprob(int(token), float(x[token]) - lse, tuple((int(i), float(x[i]) - lse) for i in best))

    # --- the rules ---------------------------------------------------------------------------------------
    def _adjusted(self, logits: np.ndarray, mask: bool = True) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(row, ids): the row the Sampler draws from and, when a mask or min_p keeps only some tokens, their ids
        (ascending: the row is theirs, so ranks and ties are the vocabulary's); ids None: the row is the whole
        vocabulary, `logits` itself without rules, else a changed copy. (None, None): the constraint allows no
        token. Keeping the few tokens left, rather than writing -inf over the rest, spares a pass that costs
        more than the draw."""
        x = np.asarray(logits)
        if x.dtype.kind != "f":
            x = x.astype(np.float64)
        if not self._rules and (not mask or self.constraint is None):
            return x, None
        if self._edits:
            x = x.copy()  # the caller's row stays as it is
        if self._bias_ids.size:
            if self._bias_ids[-1] >= x.size:
                raise CflowError(f"logit_bias names token {int(self._bias_ids[-1])}; the vocabulary has {x.size}")
            x[self._bias_ids] += self._bias
        if self.repetition != 1 and self.window != 0:
            ids = self._window_ids()
            v = x[ids]
            x[ids] = np.where(v > 0, v / self.repetition, v * self.repetition)
        if self._counts and (self.frequency or self.presence):
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            c = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            x[ids] -= c * self.frequency + self.presence
        keep = None
        if mask and self.constraint is not None and not self.constraint.finished:
            allowed = self.constraint.allowed()
            if allowed is not None:
                allowed = np.asarray(allowed, dtype=bool)
                if allowed.size > x.size:
                    raise CflowError(f"the constraint's mask has {allowed.size} entries; the vocabulary {x.size}")
                if self.min_p == 0 or self.greedy:  # the allowed ids are the answer (ids >= the mask's size: out)
                    ids = np.flatnonzero(allowed)
                    return (x[ids], ids) if ids.size else (None, None)
                keep = np.zeros(x.size, bool)
                keep[: allowed.size] = allowed
                if not keep.any():
                    return None, None
        if self.min_p > 0 and not self.greedy:
            top = x.max() if keep is None else x[keep].max()
            if np.isfinite(top):
                above = x >= top + self.temperature * math.log(self.min_p)
                keep = above if keep is None else keep & above
        if keep is None:
            return x, None
        ids = np.flatnonzero(keep)
        return x[ids], ids

    def _window_ids(self) -> np.ndarray:
        if self._seen is not None:
            return np.fromiter(self._seen, np.int64, len(self._seen))
        return np.unique(np.asarray(self.history[-self.window :], dtype=np.int64))

    def _end(self, why: str) -> int:
        if self.eos_id is None:
            raise CflowError(f"{why} and there is no end-of-text token to end the sequence with")
        return int(self.eos_id)


class _Draws:
    """Draws from softmax(x / temperature) by inverse CDF, as Sampler.draw makes them over a whole row (the same
    float64 weights and the same cumulative sums, block by block for a long row: sampling._pick), the sums kept
    for further draws, from which tokens can be left out. The first draw, before any is left out, is the
    Sampler's own (one native call for a float32 row); the weights and sums are made in NumPy when a draw is
    refused."""

    def __init__(self, x: np.ndarray, sampler: Sampler):
        self.x, self.temperature, self.sampler = x, sampler.temperature, sampler
        self._w: np.ndarray | None = None
        self._c: np.ndarray | None = None  # cumulative sums (of blocks, for a long row), made on the first pick
        self.blocked = x.size > 4 * BLOCK

    @property
    def w(self) -> np.ndarray:
        if self._w is None:
            x = self.x
            top = x.max()
            if not np.isfinite(top):
                raise CflowError(f"cannot sample: the largest logit is {top}")
            w = np.subtract(x, top, dtype=np.float64)
            w /= self.temperature
            np.exp(w, out=w)
            self._w = w
        return self._w

    @property
    def c(self) -> np.ndarray:
        if self._c is None:
            w = self.w
            if not self.blocked:
                self._c = np.cumsum(w)
            else:
                nb = w.size // BLOCK
                sums = w[: nb * BLOCK].reshape(nb, BLOCK).sum(axis=1)
                if w.size > nb * BLOCK:
                    sums = np.append(sums, w[nb * BLOCK :].sum())
                self._c = np.cumsum(sums)
        return self._c

    def drop(self, i: int) -> bool:
        """Leave token i out of further draws; False if no weight is left."""
        c, w = self.c, self.w  # the sums first: they must include token i
        wi = w[i]
        w[i] = 0.0
        c[i // BLOCK if self.blocked else i :] -= wi
        return c[-1] > 0

    def pick_in(self, allowed: np.ndarray, u: float) -> int | None:
        """A draw among the tokens `allowed` (a bool mask over the first ids; the rest are out) with the same
        weights; None if they carry none (all of them too unlikely to register against the row's best)."""
        w = self.w[: allowed.size] * allowed
        c = np.cumsum(w)
        return _crossing(c, u * c[-1]) if c[-1] > 0 else None

    def pick(self, u: float) -> int:
        if self._c is None:  # nothing left out yet: the Sampler's draw
            return self.sampler.draw(self.x, u)
        c = self.c
        t = u * c[-1]
        j = _crossing(c, t)
        if not self.blocked:
            return j
        lo = j * BLOCK
        return lo + _crossing(np.cumsum(self.w[lo : lo + BLOCK]), t - (c[j - 1] if j else 0.0))


def _holds(ids: np.ndarray, i: int) -> bool:
    """Is i among the ascending ids?"""
    k = int(np.searchsorted(ids, i))
    return k < ids.size and int(ids[k]) == i


def _check(ok: bool, what: str, got) -> None:
    if not ok:
        raise CflowError(f"{what}, not {got!r:.60}")


def sampler_for(sampler, temperature: float, top_k: int, top_p: float, seed: int | None):
    """The chooser of one generation: `sampler` (a Chooser or Sampler) if given, else a Sampler of the options."""
    return Sampler(temperature, top_k, top_p, seed) if sampler is None else sampler


def check_sampler(sampler, speculate: str | None) -> None:
    """Speculative decoding checks drafts against the plain distribution: refuse a chooser with rules."""
    if sampler is not None and speculate is not None and not getattr(sampler, "plain", True):
        raise CflowError("speculate= cannot be combined with a sampler that has rules, a constraint or logprobs "
                         "(penalties, logit_bias, min_p): leave speculate=None")
