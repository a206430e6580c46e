"""Prometheus metrics of one engine (GET /metrics), in a registry of its own (several servers per process).

    cflow_queue_length                      requests waiting for a slot
    cflow_active_sequences                  sequences being generated
    cflow_slots                             sequences the engine can run at once
    cflow_requests_total{outcome}           finished requests: stop | length | cancelled | error
    cflow_rejected_requests_total{reason}   requests refused before they ran: queue_full
    cflow_prompt_tokens_total               prompt tokens read
    cflow_generation_tokens_total           tokens generated
    cflow_prompt_seconds_total              engine time spent reading prompts
    cflow_decode_seconds_total              engine time spent in decode steps
    cflow_prompt_tokens_per_second          prompt tok/s over the last WINDOW seconds of engine work
    cflow_decode_tokens_per_second          decode tok/s (all sequences together) over the last WINDOW seconds
    cflow_time_to_first_token_seconds       histogram: request arrival to first token (queueing included)
    cflow_inter_token_latency_seconds       histogram: time between two tokens of one sequence
    cflow_request_duration_seconds          histogram: arrival to last token
    cflow_decode_batch_size                 histogram: sequences advanced by one decode step
    cflow_prefix_cache_hits_total           requests whose prompt started with cached blocks (prefix_cache.py)
    cflow_prefix_cache_hit_tokens_total     prompt tokens those requests copied from the cache instead of reading
    cflow_prefix_cache_misses_total         requests that found no cached block (prompts under 17 tokens too)
    cflow_prefix_cache_evictions_total      blocks evicted, least recently used first, to stay in the budget
    cflow_prefix_cache_bytes                bytes of keys and values the cache holds
    cflow_prefix_cache_blocks               blocks it holds (16 tokens each)
    cflow_prefix_cache_budget_bytes         its budget (--cache-mb; 0: off)
    cflow_steps_ahead_total                 decode steps launched before their token was handed out (the overlap)
    cflow_steps_ahead_dropped_total         of them, dropped: a refused guess, a request joining or stopping
    cflow_backoffs_total                    times the step backed off under load (runtime/workers.py)
    cflow_calls_in_turn_total               native calls run on the engine's thread alone while backing off
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: F401 -- re-exported for the app
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

WINDOW = 10.0  # seconds of engine work the tok/s gauges average over
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _Rate:
    """tokens / busy seconds over the events of the last WINDOW wall seconds."""

    def __init__(self):
        self.events: deque[tuple[float, int, float]] = deque()
        self.lock = threading.Lock()

    def add(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        with self.lock:
            self.events.append((now, tokens, seconds))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self.events and self.events[0][0] < now - WINDOW:
            self.events.popleft()

    def value(self) -> float:
        with self.lock:
            self._trim(time.monotonic())
            tok = sum(e[1] for e in self.events)
            sec = sum(e[2] for e in self.events)
        return tok / sec if sec > 0 else 0.0


class _ReadAtRender:
    """Counters and gauges whose values are read from the objects that keep them when /metrics is rendered:
    read() -> {metric name: value}; counters and gauges: (metric name, help) pairs."""

    def __init__(self, read, counters=(), gauges=()):
        self.read, self.counters, self.gauges = read, counters, gauges

    def collect(self):
        v = self.read()
        for name, doc in self.counters:
            yield CounterMetricFamily(name, doc, value=v[name])
        for name, doc in self.gauges:
            yield GaugeMetricFamily(name, doc, value=v[name])


# the prefix cache's: (PrefixCache attribute, metric name, help); zeros without a cache
_PREFIX_COUNTERS = (("hits", "cflow_prefix_cache_hits", "requests whose prompt started with cached blocks"),
                    ("hit_tokens", "cflow_prefix_cache_hit_tokens",
                     "prompt tokens copied from the prefix cache instead of read"),
                    ("misses", "cflow_prefix_cache_misses", "requests that found no cached block"),
                    ("evictions", "cflow_prefix_cache_evictions",
                     "prefix cache blocks evicted to stay within the budget"))
_PREFIX_GAUGES = (("bytes", "cflow_prefix_cache_bytes", "bytes of keys and values the prefix cache holds"),
                  ("blocks", "cflow_prefix_cache_blocks", "blocks the prefix cache holds"),
                  ("budget", "cflow_prefix_cache_budget_bytes", "the prefix cache's budget in bytes (0: off)"))


def _prefix_cache_metrics(cache) -> _ReadAtRender:
    def read():
        return {name: getattr(cache, attr) if cache else 0 for attr, name, _ in _PREFIX_COUNTERS + _PREFIX_GAUGES}

    return _ReadAtRender(read, [(name, doc) for _, name, doc in _PREFIX_COUNTERS],
                         [(name, doc) for _, name, doc in _PREFIX_GAUGES])


def _overlap_metrics(backend) -> _ReadAtRender:
    """The overlap's and the back-off's counters, from the backend and its model's session (zeros where a backend
    has none: StreamSlots launches nothing ahead)."""
    def read():
        session = getattr(getattr(backend, "model", None), "session", None)
        return {"cflow_steps_ahead": getattr(backend, "ahead_steps", 0),
                "cflow_steps_ahead_dropped": getattr(backend, "ahead_dropped", 0),
                "cflow_backoffs": getattr(session, "backoffs", 0),
                "cflow_calls_in_turn": getattr(session, "solo_calls", 0)}

    return _ReadAtRender(read, [
        ("cflow_steps_ahead", "decode steps launched before their token was handed out"),
        ("cflow_steps_ahead_dropped", "steps launched ahead and dropped (a refused guess, a join, a stop)"),
        ("cflow_backoffs", "times the step backed off under load"),
        ("cflow_calls_in_turn", "native calls run on the engine's thread alone while backing off")])


class ServeMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.queue = Gauge("cflow_queue_length", "requests waiting for a slot", registry=r)
        self.active = Gauge("cflow_active_sequences", "sequences being generated", registry=r)
        self.slots = Gauge("cflow_slots", "sequences the engine can run at once", registry=r)
        self.requests = Counter("cflow_requests", "finished requests by outcome", ["outcome"], registry=r)
        self.rejected = Counter("cflow_rejected_requests", "requests refused before they ran", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("cflow_prompt_tokens", "prompt tokens read", registry=r)
        self.generation_tokens = Counter("cflow_generation_tokens", "tokens generated", registry=r)
        self.prompt_seconds = Counter("cflow_prompt_seconds", "engine seconds spent reading prompts", registry=r)
        self.decode_seconds = Counter("cflow_decode_seconds", "engine seconds spent in decode steps", registry=r)
        self._prompt_rate, self._decode_rate = _Rate(), _Rate()
        Gauge("cflow_prompt_tokens_per_second", f"prompt tok/s over the last {WINDOW:g} s of engine work",
              registry=r).set_function(self._prompt_rate.value)
        Gauge("cflow_decode_tokens_per_second",
              f"decode tok/s, all sequences together, over the last {WINDOW:g} s of engine work",
              registry=r).set_function(self._decode_rate.value)
        self.ttft = Histogram("cflow_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("cflow_inter_token_latency_seconds", "time between two tokens of one sequence",
                             buckets=_ITL, registry=r)
        self.batch = Histogram("cflow_decode_batch_size", "sequences advanced by one decode step",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.duration = Histogram("cflow_request_duration_seconds", "request arrival to its last token",
                                  buckets=_LATENCY, registry=r)

    def watch_prefix_cache(self, cache) -> None:
        """Report `cache`'s counters (a PrefixCache, or None: zeros) under cflow_prefix_cache_*."""
        self.registry.register(_prefix_cache_metrics(cache))

    def watch_backend(self, backend) -> None:
        """Report the backend's overlap and back-off counters (cflow_steps_ahead_*, cflow_backoffs, ...)."""
        self.registry.register(_overlap_metrics(backend))

    # --- called by the engine thread --------------------------------------------------------------
    def prefill(self, tokens: int, seconds: float) -> None:
        self.prompt_tokens.inc(tokens)
        self.prompt_seconds.inc(seconds)
        self._prompt_rate.add(tokens, seconds)

    def decode(self, tokens: int, seconds: float) -> None:
        """One decode step that advanced `tokens` sequences by a token each (counted by the sequences)."""
        self.decode_seconds.inc(seconds)
        self._decode_rate.add(tokens, seconds)
        self.batch.observe(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
