"""The prefix cache: the pool (a trie of token blocks under an LRU byte budget: the longest whole-block prefix, the
last prompt token always read, leaves evicted first), the backend (a prompt that starts with cached blocks reads
only the rest and gets the tokens it gets without the cache, on one slot and batched; a chat's next turn takes
the previous answer too), the engine's wait for a prompt being read, and /metrics."""

import asyncio
import json
import random
import threading
import urllib.request

import numpy as np
import pytest

from cflow.errors import CflowError
from cflow.serve.backends import BatchedSlots, load_backend
from cflow.serve.engine import Engine
from cflow.serve.job import Job, Piece, SamplingParams
from cflow.serve.metrics import ServeMetrics
from cflow.serve.prefix_cache import MIN_CONTEXTS, PrefixCache, budget_bytes

from ._server import make_app, serving

PREFIX = [(13 * i) % 250 + 1 for i in range(70)]  # 4 whole blocks of 16 and 6 tokens


class Spans:
    """A stand-in for KVSpans.read: block [lo, hi) is 8 entries holding lo; counts the copies."""

    def __init__(self):
        self.reads = 0

    def __call__(self, lo, hi):
        self.reads += 1
        return np.full(8, lo, np.uint16)  # 16 bytes


def _nodes(c: PrefixCache):
    """Every node reachable from the root (checks the trie and the LRU agree)."""
    out, todo = [], [c._root]
    while todo:
        n = todo.pop()
        for child in n.children.values():
            assert child.parent is n
            out.append(child)
            todo.append(child)
    return out


# --- the pool -------------------------------------------------------------------------------------------------
def test_longest_whole_block_prefix_and_the_last_token():
    c, read = PrefixCache(10**6, block=4), Spans()
    ids = list(range(1, 14))  # 13 tokens: 3 whole blocks
    assert c.store(ids, 13, read) == 12 and read.reads == 3
    assert [int(b[0]) for b in c.lookup(ids)] == [0, 4, 8]
    assert len(c.lookup(ids[:12])) == 2  # a 12-token prompt takes 2 blocks: its 12th token is read, for its logits
    assert len(c.lookup(ids[:6] + [99] * 6)) == 1  # the blocks up to the first difference
    assert c.lookup([99] + ids) == [] and c.lookup(ids[:4]) == []
    assert (c.hits, c.hit_tokens, c.misses) == (3, 12 + 8 + 4, 2)
    assert c.cached(ids) == 12 and (c.hits, c.misses) == (3, 2)  # cached() counts nothing
    assert c.store(ids + [50, 51, 52], 16, read) == 16 and read.reads == 4  # only the new block is copied
    assert c.store(ids, 7, read) == 4 and read.reads == 4  # whole blocks of the first n tokens
    assert c.blocks == 4 and c.bytes == 64


def test_lru_evicts_leaves_within_the_budget():
    c, read = PrefixCache(5 * 16, block=4), Spans()  # five blocks
    common = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = common + [10, 11, 12, 13], common + [20, 21, 22, 23]
    c.store(a, 12, read)
    c.store(b, 12, read)  # 4 blocks: the common two, a's and b's last
    c.lookup(a + [0])  # a is the most recently used
    c.store([30, 31, 32, 33, 34, 35, 36, 37], 8, read)  # two more blocks: one must go, b's last (a leaf)
    assert c.evictions == 1 and c.bytes == 80
    assert c.cached(a + [0]) == 12 and c.cached(b + [0]) == 8
    # a prompt longer than the budget keeps the blocks that fit, evicting everything else first
    long = list(range(100, 140))
    assert c.store(long, 40, read) == 20 and c.bytes == 80 and c.blocks == 5
    assert c.cached(a + [0]) == 0 and c.cached(long) == 20
    assert PrefixCache(15, block=4).store(a, 12, read) == 0  # no room for one block: nothing kept


def test_random_use_keeps_the_trie_whole():
    """Random stores and lookups of prompts sharing prefixes under a small budget: the bytes never pass it, every
    node is reachable (no block stranded behind an evicted parent), and what a lookup returns is the prompt's own
    blocks in order."""
    rng = random.Random(3)
    c = PrefixCache(12 * 16, block=4)
    stems = [[rng.randrange(1, 9) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    for _ in range(400):
        ids = rng.choice(stems) + [rng.randrange(1, 9) for _ in range(rng.randrange(0, 12))]
        if rng.random() < 0.5:
            c.store(ids, rng.randrange(0, len(ids) + 1), lambda lo, hi, ids=ids: np.array(ids[lo:hi] * 2, np.uint16))
        else:
            got = c.lookup(ids)
            assert len(got) * 4 <= len(ids) - 1
            for i, kv in enumerate(got):
                assert kv.tolist() == ids[4 * i : 4 * i + 4] * 2
        nodes = _nodes(c)
        assert len(nodes) == c.blocks and sum(n.kv.nbytes for n in nodes) == c.bytes <= c.budget
        assert set(nodes) == set(c._lru)
    assert c.evictions > 0 and c.hits > 0


def test_worth_waiting():
    c, read = PrefixCache(10**6, block=4), Spans()
    a = list(range(1, 30))
    b = a[:20] + [0] * 5
    assert c.worth_waiting(b, a)  # 5 shared blocks, none cached yet
    c.store(a, len(a), read)
    assert not c.worth_waiting(b, a)  # cached already: nothing to wait for
    assert not c.worth_waiting([5, 6, 7, 8, 9], a)  # nothing shared
    assert not c.worth_waiting(a[:4], a)  # a 4-token prompt takes no block (its last token is read)


def test_budget():
    mb = 2**20
    assert budget_bytes(None, 10 * mb, 8, None) == 80 * mb  # a context per slot
    assert budget_bytes(None, 10 * mb, 1, None) == MIN_CONTEXTS * 10 * mb  # at least MIN_CONTEXTS
    assert budget_bytes(None, 10 * mb, 8, 100 * mb) == 25 * mb  # at most a quarter of what is available
    assert budget_bytes(0, 10 * mb, 8, 100 * mb) == 0
    assert budget_bytes(1.5, 10 * mb, 8, 100 * mb) == int(1.5 * mb)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(CflowError, match="--cache-mb must be"):
            budget_bytes(bad, 10 * mb, 8, 100 * mb)
    with pytest.raises(CflowError, match="--cache-mb 200: more than the 100.0 MiB"):
        budget_bytes(200, 10 * mb, 8, 100 * mb)


# --- the backend ------------------------------------------------------------------------------------------------
class _Req:
    def __init__(self, ids, params):
        self.prompt_ids, self.params = list(ids), params


def _run(be, slot, ids, params):
    """Start, read and decode one request on a backend alone: (its tokens, prompt tokens start left to read)."""
    left = to_read = be.start(slot, _Req(ids, params))
    while left:
        left = be.prefill(slot)
    out = []
    while len(out) < params.max_tokens:
        tok = be.advance([slot])[0]
        assert not isinstance(tok, BaseException), tok
        if tok is None:
            break
        out.append(tok)
    be.stop(slot)
    return out, to_read


@pytest.mark.parametrize("slots", [1, 2])
def test_a_cached_prefix_is_not_read_again(tiny_path, ref_tiny, slots):
    be = load_backend(tiny_path, threads=1, slots=slots, prefill_block=8)
    try:
        assert isinstance(be, BatchedSlots) and be.prefix_cache is not None
        c = be.prefix_cache
        p = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
        a, b = PREFIX + [7, 8, 9], PREFIX + [10, 11, 12, 13, 14]
        ta, ra = _run(be, 0, a, p)
        assert ra == len(a) and (c.hits, c.misses) == (0, 1)
        tb, rb = _run(be, slots - 1, b, p)  # another slot when there is one
        assert rb == len(b) - 64 and (c.hits, c.hit_tokens) == (1, 64)
        assert ta == ref_tiny.generate(a, 12, temperature=0.8, seed=3)
        assert tb == ref_tiny.generate(b, 12, temperature=0.8, seed=3)
        # a chat's next turn: the prompt and answer so far, and more; the answer's blocks came in when b stopped
        # (its last token was drawn, never fed: 75 + 11 positions, five whole blocks)
        assert len(tb) == 12
        nxt = b + tb + [20, 21]
        tn, rn = _run(be, 0, nxt, SamplingParams(max_tokens=8, temperature=0))
        assert rn == len(nxt) - 80 and tn == ref_tiny.generate(nxt, 8)
    finally:
        be.close()


def test_one_slot_with_experts_on_disk(tiny_path, ref_tiny):
    """A disk tier with one slot is a one-slot BatchedSlots too (prompts read token by token): the cache applies."""
    be = load_backend(tiny_path, threads=1, slots=1, experts="disk")
    try:
        assert isinstance(be, BatchedSlots) and be.chunk == 1
        p = SamplingParams(max_tokens=6, temperature=0)
        _run(be, 0, PREFIX[:40], p)
        toks, read = _run(be, 0, PREFIX[:40] + [5, 6], p)
        assert read == 42 - 32 and toks == ref_tiny.generate(PREFIX[:40] + [5, 6], 6)
    finally:
        be.close()


def test_off_and_refused(tiny_path):
    be = load_backend(tiny_path, threads=1, slots=2, prefill_block=8, cache_mb=0)
    try:
        assert be.prefix_cache is None
        _run(be, 0, PREFIX, SamplingParams(max_tokens=2, temperature=0))
        assert be.start(1, _Req(PREFIX, SamplingParams(max_tokens=2))) == len(PREFIX)
    finally:
        be.close()
    with pytest.raises(CflowError, match="--cache-mb must be"):
        load_backend(tiny_path, threads=1, slots=2, cache_mb=-1)
    with pytest.raises(CflowError, match="--cache-mb: the prefix cache copies"):
        load_backend(tiny_path, threads=1, slots=2, experts="disk", cache_mb=4)


# --- the engine: a prompt being read is waited for ------------------------------------------------------------
class Gated:
    """Passes a backend through (prefix cache included) and logs its calls; prefill waits for `gate`."""

    def __init__(self, inner):
        self.inner, self.slots, self.log = inner, inner.slots, []
        self.prefix_cache, self.reused = inner.prefix_cache, inner.reused
        self.gate = threading.Event()
        self.gate.set()

    @property
    def model(self):
        return self.inner.model

    def start(self, slot, job):
        self.log.append(("start", tuple(job.prompt_ids)))
        return self.inner.start(slot, job)

    def prefill(self, slot):
        assert self.gate.wait(20)
        left = self.inner.prefill(slot)
        self.log.append(("prefill", slot, left))
        return left

    def advance(self, slots):
        return self.inner.advance(slots)

    def stop(self, slot):
        self.log.append(("stop", slot))
        self.inner.stop(slot)

    def close(self):
        self.inner.close()


async def _collect(job):
    toks, fin = [], None
    async for ev in job.events():
        if isinstance(ev, Piece):
            toks += [int(t) for t in ev.text.split()]
        else:
            fin = ev
    return toks, fin


def test_a_request_waits_for_its_prefix_being_read(tiny_path, ref_tiny):
    """Three requests at once, two with the same long prefix: the second is admitted only once the first prompt
    is read, and copies its blocks (the third, behind it, waits its turn); the metrics count the copied tokens as
    hits, not as prompt tokens read."""
    be = Gated(load_backend(tiny_path, threads=1, slots=3, prefill_block=8))
    metrics = ServeMetrics()
    a, b, c = PREFIX + [1, 2], PREFIX + [3, 4, 5], [9, 8, 7]

    async def main():
        eng = Engine(be, max_queue=4, metrics=metrics)
        p = SamplingParams(max_tokens=6, temperature=0)
        jobs = [Job(ids, p) for ids in (a, b, c)]
        be.gate.clear()  # the first prompt's first piece waits until all three are queued
        for j in jobs:
            eng.submit(j)
        be.gate.set()
        out = await asyncio.gather(*(_collect(j) for j in jobs))
        await asyncio.to_thread(eng.close)
        return out

    out = asyncio.run(main())
    for ids, (toks, fin) in zip((a, b, c), out):
        assert fin.reason == "length" and toks == ref_tiny.generate(ids, 6)
    log = be.log
    a_read = next(i for i, e in enumerate(log) if e[0] == "prefill" and e[2] == 0)
    assert log.index(("start", tuple(b))) > a_read and log.index(("start", tuple(c))) > log.index(("start", tuple(b)))
    cache = be.prefix_cache
    assert (cache.hits, cache.hit_tokens) == (1, 64)
    sample = metrics.registry.get_sample_value
    assert sample("cflow_prompt_tokens_total") == len(a) + len(b) - 64 + len(c)
    assert sample("cflow_prefix_cache_hits_total") == 1 and sample("cflow_prefix_cache_hit_tokens_total") == 64
    assert sample("cflow_prefix_cache_misses_total") == 2


def test_the_wait_ends_when_the_prompt_it_waits_for_is_cancelled(tiny_path, ref_tiny):
    be = Gated(load_backend(tiny_path, threads=1, slots=2, prefill_block=8))

    async def main():
        eng = Engine(be, max_queue=4)
        p = SamplingParams(max_tokens=5, temperature=0)
        first, second = Job(PREFIX + [1], p), Job(PREFIX + [2], p)
        be.gate.clear()
        eng.submit(first)
        while ("start", tuple(first.prompt_ids)) not in be.log:
            await asyncio.sleep(0.005)
        eng.submit(second)
        eng.cancel(first)
        be.gate.set()
        out = await asyncio.gather(_collect(first), _collect(second))
        await asyncio.to_thread(eng.close)
        return out

    (_, fin1), (toks, fin2) = asyncio.run(main())
    assert fin1.reason == "cancelled" and fin2.reason == "length"
    assert toks == ref_tiny.generate(PREFIX + [2], 5)
    assert be.log.index(("start", tuple(PREFIX + [2]))) > be.log.index(("stop", 0))


# --- over HTTP ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache_server(tiny_path):
    app = make_app(tiny_path, slots=2, model_id="tiny", cache_mb=1)
    with serving(app) as url:
        yield url, app


def _complete(url, prompt, max_tokens):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [int(t) for t in json.loads(r.read())["choices"][0]["text"].split()]


def test_metrics_over_http(cache_server, ref_tiny):
    url, app = cache_server
    for tail in ([1, 2], [3, 4, 5]):
        assert _complete(url, PREFIX + tail, 4) == ref_tiny.generate(PREFIX + tail, 4)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("cflow_prefix_cache"))
    assert float(values["cflow_prefix_cache_hits_total"]) == 1
    assert float(values["cflow_prefix_cache_hit_tokens_total"]) == 64
    assert float(values["cflow_prefix_cache_budget_bytes"]) == 2**20
    # 72 + 3 and 73 + 3 positions held (the last answer token is never fed): the same four blocks
    assert float(values["cflow_prefix_cache_blocks"]) == 4
    assert float(values["cflow_prefix_cache_bytes"]) == 4 * app.state.engine.backend._spans.nbytes(16)
    assert float(values["cflow_prefix_cache_evictions_total"]) == 0
