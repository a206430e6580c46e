"""Speculative decoding: draft a few tokens cheaply, check them all in one pass of the multi-token body.

A decode step reads every weight once for one token; the multi-token body (the prompt's) reads them once for a
block, so checking k drafted tokens costs about one step while it can emit up to k + 1 tokens. The pass feeds
the pending token and the drafts, [t, d1 .. dk], and returns the logits after each; draft d(i+1) stands if it is
what the model itself would have chosen after t, d1 .. di, and the first one that is not is replaced by the
model's own choice. The KV cache keeps the positions of the tokens that stood; the rest are overwritten later.

Exactness. The block's rows are bitwise those of single steps (tests/runtime/test_prefill.py), and every
generated position draws with its own uniform, the one plain decode would use there (`Uniforms`). With greedy
decoding or deterministic drafts (prompt lookup), each position's token is the model's own, computed exactly as
plain decode computes it, and a draft stands when it equals that token: the output is plain decode's, token for
token, for the same seed, whatever was drafted. Drafts a draft model samples from its distribution q follow the
standard rejection rule (Leviathan et al.; Chen et al.): d stands with probability min(1, p(d) / q(d)), a fallen
one is replaced by a draw from max(p - q, 0) renormalised, so every token is distributed as plain sampling's.

Drafters:
- `NgramDrafter` (prompt lookup): the tokens that followed the latest earlier occurrence of the longest suffix
  of the text so far (prompt and generated), backed by `NgramTable`, a bounded table shared across requests.
- `ModelDrafter`: a smaller compiled model with the same tokenizer, its own KV cache kept in step.

`Speculation` (one per stream) adapts the draft length to the acceptance and turns itself off while drafting
does not pay: it times its passes against plain steps and pauses for a growing number of steps when the
emitted tokens per second of its passes fall below the plain steps' (a paused stream decodes exactly as
without speculation). Greedy output does not depend on those decisions; only the speed does.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np

from ..errors import CflowError
from .sampling import Sampler

MAX_DRAFT = 8  # drafted tokens per pass at most (the block's cost grows past ~8 tokens on 2 cores)
NGRAM_MAX = 4  # longest suffix prompt lookup tries to match
NGRAM_MIN = 2  # shortest: one token in common predicts too little (drafts that fall cost a pass)
TABLE_N = 3  # the shared table's key length
TABLE_ENTRIES = 1 << 16  # shared table size bound (least recently used entries go first)
PAUSE_STEPS = 16  # plain steps after drafting stopped paying, doubled at each further loss, up to PAUSE_MAX
PAUSE_MAX = 1024
PAY = 1.1  # the expected gain drafting must show (the cost model leaves out the calls between passes)
WINDOW = 8  # drafting tokens between two judgements of what drafting gets against plain decode
START_PAUSE_MAX = 64  # a new stream after streams where drafting did not pay starts paused for at most this
RETIME = 32  # drafting passes between two timed plain steps (what drafting is compared with)
EMA = 0.2  # weight of the newest time in the running timings
DECAY = 0.8  # weight of the acceptance evidence before each new pass


class NgramTable:
    """Continuations seen after TABLE_N-token keys, shared by the streams of one model (bounded, LRU)."""

    def __init__(self, entries: int = TABLE_ENTRIES):
        self.entries = entries
        self._d: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def learn(self, ids: list[int], k: int = MAX_DRAFT) -> None:
        """Record what followed each key in `ids` (a finished text: its prompt and what was generated)."""
        d = self._d
        for i in range(TABLE_N, len(ids)):
            key = tuple(ids[i - TABLE_N : i])
            d[key] = tuple(ids[i : i + k])
            d.move_to_end(key)
        while len(d) > self.entries:
            d.popitem(last=False)

    def get(self, key: tuple) -> tuple:
        cont = self._d.get(key, ())
        if cont:
            self._d.move_to_end(key)
        return cont


class NgramDrafter:
    """Prompt lookup over one stream's text: the longest suffix (NGRAM_MIN .. NGRAM_MAX tokens) that occurred
    before proposes what followed its latest occurrence; the shared table is asked when no local suffix of
    TABLE_N tokens matches. The index (one dict: n-gram -> the position after its latest occurrence) is brought
    up to date when a draft is asked for, so tokens decoded while drafting is paused cost a list append."""

    deterministic = True
    catch_up_s = 0.0

    def __init__(self, table: NgramTable | None = None, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN):
        self.table, self.max_n, self.min_n = table, max_n, min_n
        self._index: dict[tuple, int] = {}
        self._ids: list[int] = []
        self._done = 1  # the next continuation start to index (position i is indexed once a token follows it)

    def start(self, ids: list[int]) -> None:
        self._index, self._ids, self._done = {}, list(ids), 1

    def accept(self, ids: list[int], index: bool = True) -> None:
        """Tokens appended to the stream's text (emitted); index=False: decoded while drafting was paused, not
        worth their indexing (what came before them is indexed first)."""
        if not index:
            self._catch_up()
        self._ids.extend(ids)
        if not index:
            self._done = len(self._ids)

    def _catch_up(self) -> None:
        s, index, lo, hi = self._ids, self._index, self.min_n, self.max_n
        for i in range(self._done, len(s)):
            for n in range(lo, min(hi, i) + 1):
                index[tuple(s[i - n : i])] = i
        self._done = max(self._done, len(s))

    def propose(self, k: int) -> tuple[list[int], None]:
        self._catch_up()
        s, index = self._ids, self._index
        for n in range(min(self.max_n, len(s)), self.min_n - 1, -1):
            i = index.get(tuple(s[-n:]))
            if i is not None:
                return s[i : i + k], None
            if n == TABLE_N and self.table is not None:  # no local match this long: what other streams saw
                cont = self.table.get(tuple(s[-TABLE_N:]))
                if cont:
                    return list(cont[:k]), None
        return [], None

    def finish(self, learn: bool = True) -> None:
        if self.table is not None and learn:
            self.table.learn(self._ids)


class ModelDrafter:
    """A smaller model of the same vocabulary drafts greedily (or by sampling, for a sampled stream), with its
    own KV cache kept to the stream's text: only tokens it has not seen are fed before each draft."""

    deterministic = False
    catch_up_s = 0.0  # seconds the last propose spent feeding text the draft had not seen

    def __init__(self, session, sampler: Sampler):
        self.s = session
        self.sampler = sampler
        self.deterministic = sampler.greedy
        self._ids: list[int] = []  # the stream's text
        self._held: list[int] = []  # the tokens whose keys and values the draft's KV cache holds

    def start(self, ids: list[int]) -> None:
        self._ids, self._held = list(ids), []
        self.s.reset()

    def accept(self, ids: list[int], index: bool = True) -> None:
        self._ids.extend(ids)

    def propose(self, k: int) -> tuple[list[int], list[np.ndarray] | None]:
        ids, s = self._ids, self.s
        k = min(k, s.max_seq - len(ids))
        if k <= 0 or not ids:
            return [], None
        common = 0
        n = min(len(self._held), len(ids) - 1)  # at least one token fed, for its logits
        while common < n and self._held[common] == ids[common]:
            common += 1
        s.pos = common
        t0 = time.perf_counter()
        logits = s.prefill(ids[common:])
        if len(ids) - common > 1:  # catching up on text it did not draft (a pause, the prompt): not drafting
            self.catch_up_s = time.perf_counter() - t0
        out, qs = [], []
        for i in range(k):
            if self.deterministic:
                t = int(np.argmax(logits))
            else:
                qs.append(self.sampler.probabilities(logits))
                t = int(self.sampler.rng.choice(qs[-1].size, p=qs[-1]))
            out.append(t)
            if i + 1 < k:
                logits = s.step(t)
        self._held = ids + out[:-1]
        return out, (None if self.deterministic else qs)

    def finish(self, learn: bool = True) -> None:
        pass


def costs_for(kind: str) -> Costs:
    """A drafter kind's Costs. A draft model must also read what it has not seen (the prompt, a pause's tokens)
    before it drafts, so after streams where it did not pay a new stream starts with the whole doubled pause
    (up to PAUSE_MAX); prompt lookup, which costs nothing to resume, probes a new text sooner."""
    return Costs(start_pause_max=PAUSE_MAX if kind == "draft" else START_PAUSE_MAX)


def drafter_for(kind: str, sampler: Sampler, seed: int | None, table: NgramTable | None = None,
                draft_session=None):
    """The drafter a stream asks for: "ngram" (prompt lookup with the shared `table`) or "draft" (the draft
    model's session, sampling with the stream's options from a generator of its own, so that the stream's
    uniforms stay the stream's)."""
    if kind == "ngram":
        return NgramDrafter(table)
    draft_seed = None if seed is None else (int(seed) * 0x9E3779B1 + 1) % 2**64
    return ModelDrafter(draft_session, Sampler(sampler.temperature, sampler.top_k, sampler.top_p, draft_seed))


class Drafting:
    """What one model's streams share for speculative decoding: prompt lookup's table and, per drafter kind, the
    Costs; `start` makes a stream's drafter and its Speculation controller (CompiledModel and the server's
    batched slots each hold one)."""

    def __init__(self):
        self.ngrams: NgramTable | None = None
        self.costs: dict[str, Costs] = {}

    def start(self, kind: str, sampler: Sampler, seed: int | None, draft_session=None):
        """(drafter, Speculation) for one stream of `kind` ("ngram" or "draft")."""
        if kind == "ngram" and self.ngrams is None:
            self.ngrams = NgramTable()
        spec = Speculation(self.costs.setdefault(kind, costs_for(kind)))
        return drafter_for(kind, sampler, seed, self.ngrams, draft_session), spec


class Costs:
    """What drafting costs with one model on this host, shared by its streams (one per drafter kind, held by the
    CompiledModel or the server's backend):
    running times of a plain step, of a pass that checks k drafts, and of drafting one token."""

    def __init__(self, k_max: int = MAX_DRAFT, start_pause_max: int = START_PAUSE_MAX):
        self.start_pause_max = start_pause_max  # a new stream after losses starts paused for at most this
        self.step: float | None = None  # seconds of a plain decode step
        self.check: list[float | None] = [None] * (k_max + 1)  # seconds of a pass feeding 1 + k tokens
        self.draft_token = 0.0  # seconds to draft one token (a draft model's step; prompt lookup ~0)
        self.losses = 0  # pauses in a row, over streams: drafting did not pay (the next pause is longer)
        self.plain_rate: float | None = None  # tokens per second of plain decode, the caller's work included

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else (1 - EMA) * old + EMA * new

    def stepped(self, seconds: float) -> None:
        self.step = self._ema(self.step, seconds)

    def coasted(self, tokens: int, seconds: float) -> None:
        self.plain_rate = self._ema(self.plain_rate, tokens / seconds)

    def checked(self, k: int, seconds: float, draft_seconds: float) -> None:
        self.check[k] = self._ema(self.check[k], seconds)
        self.draft_token = (1 - EMA) * self.draft_token + EMA * draft_seconds / k

    def pass_steps(self, k: int) -> float:
        """A pass drafting and checking k tokens, in plain steps; a length not timed yet is guessed from the
        nearest timed one below it (a block's cost grows slowly with its tokens), else as one step."""
        known = next((j for j in range(k, 0, -1) if self.check[j] is not None), None)
        check = self.check[known] * (1 + 0.05 * (k - known)) if known else self.step
        return (check + k * self.draft_token) / self.step

    def gain(self, k: int, tokens: float) -> float:
        """Speed of a pass of k drafts that emits `tokens` on average, over plain decode's: plain decode takes
        1 / plain_rate per token (its step and the work around it, sampling, the caller); the pass takes its
        drafting and checking plus that same work around each token it emits."""
        if self.plain_rate is None:
            return tokens / self.pass_steps(k)
        per_token = 1.0 / self.plain_rate
        around = max(0.0, per_token - self.step)
        return tokens * per_token / (self.pass_steps(k) * self.step + tokens * around)


class Speculation:
    """The draft length for one stream's next pass, and whether to draft at all.

    Which length: the acceptance is a per-token estimate a (a recency-weighted count of drafts that stood against
    the first one that fell in each pass, from a prior of one each); a pass of k drafts then emits
    (1 - a^(k+1)) / (1 - a) tokens on average and costs Costs.pass_steps(k) plain steps; the length with the most
    tokens per step's time is drafted if it expects PAY times plain decode's speed.

    Whether: drafting stops for a pause when that best length does not beat a plain step, or when the tokens per
    second the stream actually got over its last WINDOW drafting tokens (everything included: drafting, checking,
    the steps between passes, the caller's work per token) fall below plain decode's (Costs.plain_rate, measured
    the same way while paused). A pause doubles each time (16 .. 1024 steps); the count of pauses in a row is the
    model's, so a stream after streams where drafting did not pay starts paused (at most START_PAUSE_MAX steps).
    After a pause one short pass probes the acceptance again. Greedy output does not depend on any of it."""

    def __init__(self, costs: Costs | None = None, k_max: int = MAX_DRAFT,
                 clock: Callable[[], float] = time.perf_counter):
        self.costs = costs if costs is not None else Costs(k_max)
        self.k_max, self.clock = k_max, clock
        self.stood_w, self.fell_w = 1.0, 1.0  # recency-weighted evidence of the acceptance
        self.pause = 0  # plain steps left before drafting again
        self.probe = False  # the next pass drafts whatever the estimate says (after a pause)
        if self.costs.losses:  # drafting did not pay for the last streams: start paused (not long: a new text)
            self.pause = min(self.costs.start_pause_max, PAUSE_STEPS << min(self.costs.losses - 1, 16))
            self.probe = True
        elif self.costs.plain_rate is None:  # a first stream: plain decode's pace first, measured
            self.pause = WINDOW
        self._since_step = 0  # drafting passes since the last timed plain step
        self._best: tuple[int, float] | None = None  # best(), until the next pass changes the estimate
        self._window: tuple[float, int] | None = None  # (start, tokens) of the current drafting window
        self.pauses = 0  # times drafting paused
        self.proposed = self.accepted = self.passes = 0

    @property
    def acceptance(self) -> float:
        """Drafted tokens that stood, of all drafted (the whole stream)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens each drafting pass emitted on average: the drafts that stood and the model's own next one."""
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0

    @property
    def rate(self) -> float:
        """The current estimate of the chance that the next drafted token stands."""
        return self.stood_w / (self.stood_w + self.fell_w)

    def best(self) -> tuple[int, float]:
        """(k, expected tokens per plain step's time) of the best draft length."""
        if self._best is None:
            self._best = self._find_best()
        return self._best

    def _find_best(self) -> tuple[int, float]:
        a, costs = min(self.rate, 0.999), self.costs
        best = (1, 0.0)
        for k in range(1, self.k_max + 1):
            gain = costs.gain(k, (1 - a ** (k + 1)) / (1 - a))
            if gain > best[1]:
                best = (k, gain)
        return best

    def _stop(self) -> int:
        """Drafting did not pay: pause (longer each time in a row), then probe."""
        self.costs.losses += 1
        self.pauses += 1
        self.pause = min(PAUSE_MAX, PAUSE_STEPS << min(self.costs.losses - 1, 16)) - 1
        self.probe, self._window = True, None
        return 0

    def length(self) -> int:
        """Tokens to draft for the next pass; 0 = a plain step (paused, not paying, or a step due to be timed)."""
        if self.pause:
            self.pause -= 1
            return 0
        if self.costs.step is None or self._since_step >= RETIME:
            self._since_step = 0
            return 0
        self._since_step += 1
        now = self.clock()
        if self._window is None:
            self._window = (now, 0)
        elif self._window[1] >= WINDOW:  # judged by what the stream got, against plain decode's pace
            plain = self.costs.plain_rate or 1.0 / self.costs.step
            if self._window[1] / (now - self._window[0]) < plain:
                return self._stop()
            self.costs.losses = 0
            self._window = (now, 0)
        k, gain = self.best()
        if self.probe:
            self.probe = False
            return min(k, 2)
        if gain < PAY:
            return self._stop()
        return k

    def emitted(self, n: int) -> None:
        """n tokens came out of a pass or a step while drafting was on (the window's time includes everything:
        a draft model reading the prompt or a pause's tokens is part of what drafting costs)."""
        if self._window is not None:
            self._window = (self._window[0], self._window[1] + n)

    def stepped(self, seconds: float) -> None:
        self.costs.stepped(seconds)

    def coasted(self, tokens: int, seconds: float) -> None:
        """tokens came out of plain steps in `seconds`, the caller's time per token included."""
        self.costs.coasted(tokens, seconds)

    def checked(self, drafted: int, stood: int, seconds: float, draft_seconds: float = 0.0) -> None:
        """One pass: `drafted` tokens proposed, `stood` of them accepted; `seconds` checking, `draft_seconds`
        drafting."""
        self.proposed += drafted
        self.accepted += stood
        self.passes += 1
        self.stood_w = DECAY * self.stood_w + stood
        self.fell_w = DECAY * self.fell_w + (stood < drafted)
        self.costs.checked(drafted, seconds, draft_seconds)
        self._best = None


@contextlib.contextmanager
def sharing_cores(*sessions):
    """Sessions that take turns on the same cores for one generation (a model and its draft model) keep their
    thread counts: each one's idle workers spin while the other runs, which their load back-off would take for
    another process and answer by running on one thread. Only when there are two or more (None entries are
    skipped): a model alone keeps its back-off."""
    live = [s for s in sessions if s is not None]
    steps = [s.native for s in live] if len(live) > 1 else []
    for n in steps:
        n.hold_threads = True
    try:
        yield
    finally:
        for n in steps:
            n.hold_threads = False


class Uniforms:
    """The sampler's uniforms by generated position: the n-th token uses the n-th number its generator gives,
    as in plain decode, however many passes and drafts it took to reach it."""

    def __init__(self, sampler: Sampler):
        self.rng, self._u = sampler.rng, []

    def __getitem__(self, n: int) -> float:
        while len(self._u) <= n:
            self._u.append(self.rng.random())
        return self._u[n]


def verify(rows: np.ndarray, drafts: list[int], qs, sampler: Sampler, u: Uniforms | None = None,
           n: int = 0) -> tuple[int, int]:
    """(drafts that stand, the next token): rows[i] are the logits after the pending token and drafts[:i], the
    first of them the model's n-th generated position.

    Deterministic drafts (qs None): the model's own token at each position, drawn with that position's uniform
    `u[n + i]` exactly as plain decode draws it; a draft stands when it is that token (probability p(d), as the
    rejection rule with q = one-hot(d)), so the output is plain decode's, token for token, for the same seed.
    Drafts drawn from q (a sampling draft model): the rejection rule, with the sampler's generator."""
    for i, d in enumerate(drafts):
        if qs is None:
            t = sampler.draw(rows[i], None if sampler.greedy else u[n + i])
            if t != d:
                return i, t
            continue
        p = sampler.probabilities(rows[i])
        if sampler.rng.random() * qs[i][d] < p[d]:  # accept with probability min(1, p(d) / q(d))
            continue
        r = np.maximum(p - qs[i], 0.0)
        total = r.sum()
        if total <= 0.0:  # p <= q everywhere means p == q: nothing to correct towards
            r, total = p, p.sum()
        return i, int(sampler.rng.choice(r.size, p=r / total))
    k = len(drafts)
    if qs is None:
        return k, sampler.draw(rows[k], None if sampler.greedy else u[n + k])
    return k, sampler(rows[k])


class Speculator:
    """One stream's speculative decode on slot 0 of session `s` (where the single-sequence decode step runs),
    pass by pass: `draw` the token the prompt's logits give, then `advance(tok)` feeds the pending token (and
    drafts) and returns the tokens that follow it. `draw` is also for a caller that ran a plain step for this
    stream itself (a server's batched step): the token at the stream's next position, with that position's
    uniform, noted as emitted."""

    def __init__(self, s, sampler: Sampler, drafter, spec: Speculation, ids: list[int],
                 guard: Callable[[], None] = lambda: None, check: Callable[[np.ndarray], None] = lambda rows: None):
        if s.tmax < 2:
            raise CflowError("speculative decoding needs the multi-token body (prefill_block >= 2, weights in RAM)")
        self.s, self.sampler, self.drafter, self.spec = s, sampler, drafter, spec
        self.guard, self.check = guard, check  # before each native call; on each row of logits
        self.uniforms = Uniforms(sampler)
        self.emitted = 0  # tokens generated so far: the next one is the stream's position `emitted`
        drafter.start(ids)
        # a draft model and this one take turns on the same cores until finish(): both keep their threads
        self._sharing = sharing_cores(s, getattr(drafter, "s", None))
        self._sharing.__enter__()

    def draw(self, logits: np.ndarray) -> int:
        self.check(logits)
        tok = self.sampler.draw(logits, None if self.sampler.greedy else self.uniforms[self.emitted])
        self.emitted += 1
        self.drafter.accept([tok])
        return tok

    def advance(self, tok: int, left: int) -> list[int]:
        """Feed `tok` (the last emitted token) and return the tokens after it, at most `left` (>= 1): the drafts
        that stood and the model's own next token. The slot's position then counts exactly the fed tokens."""
        s, spec = self.s, self.spec
        pos = s.pos
        k = min(spec.length(), left - 1, s.tmax - 1, s.max_seq - pos - 1)
        drafts, qs = [], None
        if k > 0:
            self.drafter.catch_up_s = 0.0
            t0 = spec.clock()
            drafts, qs = self.drafter.propose(k)
            drafts, qs = drafts[:k], (qs[:k] if qs is not None else None)
        self.guard()
        if not drafts:
            t1 = spec.clock()
            logits = s.step(tok)
            spec.stepped(spec.clock() - t1)
            spec.emitted(1)
            return [self.draw(logits)]
        t1 = spec.clock()
        rows = s.prefill([tok, *drafts], all_logits=True)
        self.check(rows)
        stood, nxt = verify(rows, drafts, qs, self.sampler, self.uniforms, self.emitted)
        s.pos = pos + 1 + stood
        spec.checked(len(drafts), stood, spec.clock() - t1, t1 - t0 - self.drafter.catch_up_s)
        out = [*drafts[:stood], nxt]
        spec.emitted(len(out))
        self.emitted += len(out)
        self.drafter.accept(out)
        return out

    def coast(self, tok: int, n: int) -> Iterator[int]:
        """Up to n tokens after `tok` by plain steps on slot 0, as plain decode runs them (drafting paused): the
        drafter hears of them, and the steps' time is noted, once at the end."""
        s, sampler, uniforms, guard, check = self.s, self.sampler, self.uniforms, self.guard, self.check
        greedy, out = sampler.greedy, []
        t0 = self.spec.clock()
        try:
            for _ in range(n):
                guard()
                logits = s.step(tok)
                check(logits)
                tok = sampler.draw(logits, None if greedy else uniforms[self.emitted])
                self.emitted += 1
                out.append(tok)
                yield tok
        finally:
            if out:
                dt = self.spec.clock() - t0
                self.spec.stepped(dt / len(out))
                if len(out) == n:  # a whole pause (the caller's time per token included): plain decode's pace
                    self.spec.coasted(len(out), dt)
                self.spec.pause = max(0, self.spec.pause - len(out))
                self.drafter.accept(out, index=False)

    def finish(self) -> None:
        self._sharing.__exit__(None, None, None)
        self.drafter.finish(learn=not self.spec.costs.losses)  # a model where drafting does not pay: no table
