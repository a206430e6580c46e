"""Per-host tuning of the attention core's prefetch distance (attention.attention's kv_prefetch), in tune.py's table.

Stage: codegen (used by the runtime before it emits a step, next to tune.choices). The K and V scans of the
attention core prefetch kv_prefetch bytes ahead. On an AMX Xeon 4 KiB ahead took the f16 core from 474 to
374 us per layer at 4,064 positions from DRAM (docs/results/intel-amx/attention_core_prefetch_intel.json); on Zen 5
prefetching V ahead was measured slower (docs/journal/performance.md, "Long contexts"). So each host measures it, as the
mat-vec knobs: the first time an attention geometry (query heads, kv heads, head_dim, cache type) is met on a CPU,
every distance in DISTANCES is compiled in one library and timed on 4,096-position caches at position 4,063 (the
prefetch only matters at long contexts), each timed call running up to LAYERS layers' caches in turn (timed_set),
the next ones of a set at least twice the last-level cache (tune.stream_span: from DRAM, as decode reads them),
candidates interleaved round by round. The default
(attention.KV_PREFETCH) stays unless another distance beats it by tune.MARGIN in the median per-round ratio
(tune.choose). The choice is schedule-only: every candidate's output is checked bit-identical to the first's.
Cached in tune.py's table under attention_key(); CFLOW_TUNE=off uses the default.
"""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace

import numpy as np
from llvmlite import ir

from ..errors import CflowError
from . import tune
from .abi import KV_BYTES, kv_floats_per_layer
from .attention import KV_PREFETCH

DISTANCES = (KV_PREFETCH, 0, 1024, 16384)  # bytes ahead; the first is the default
TUNE_SEQ = 4096  # cache positions the timing runs at
POSITION = TUNE_SEQ - 33  # the position timed: a block short of the end
LAYERS = 22  # layers' caches per timed call (TinyLlama's count: ~90 MB of f16 K/V, milliseconds)
ROUNDS = tune.ROUNDS


def attention_key(n_heads: int, n_kv_heads: int, head_dim: int, kv: str, unit: str = "") -> str:
    """The table key of one attention geometry and cache type; unit: what the core's bf16 dot products run on
    (attention.core_unit, resolved for the cache's max_seq): a core on the tile unit ('amx'; a different loop) has its
    own entry."""
    return f"attn:{n_heads}x{n_kv_heads}x{head_dim}:{kv}" + (":amx" if kv == "bf16" and unit == "amx" else "")


def host_unit(geom: tuple[int, int, int], kv: str, target, max_seq: int) -> str:
    """attention.core_unit for one geometry on this target. target.bf16_unit is asked for a bf16 cache only: on an AMX
    host asking requests the tile state for the process (target.amx_permitted), which other caches never need."""
    from .attention import core_unit

    H, KV, hd = geom
    return core_unit(kv, target.bf16_unit if kv == "bf16" else "", H // KV, hd, max_seq)


def geometries(nodes) -> set[tuple[int, int, int]]:
    """The (query heads, kv heads, head_dim) of a graph's attention nodes."""
    return {(n.n_heads, n.n_kv_heads, n.head_dim) for n in nodes if n.kind == "attention"}


class AttentionBench:
    """The attention core at each prefetch distance, JIT-compiled in one library, and `n_caches` layer caches of
    max_seq positions in one page-aligned buffer (random K/V, one layer's worth repeated: the timing does not
    depend on the values). call(i, c, pos) runs variant i on cache c (cyclic) at position pos for every kv head
    on one thread, as a decode step's attention stage does. Also benchmarks/attention.py's harness."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, kv: str, max_seq: int, target,
                 distances=DISTANCES, n_caches: int = 1, seed: int = 0, bf16_unit: str | None = None,
                 softcap: float = 0.0):
        from ..ir import Attention
        from ..layout.quant import bf16_bits
        from ..layout.tile import aligned_empty
        from .attention import attention
        from .cgutils import P, f32, i16, i64
        from .library import Library

        H, KV, hd, S = n_heads, n_kv_heads, head_dim, max_seq
        self.kv, self.n_kv_heads, self.head_dim, self.max_seq = kv, KV, hd, S
        n = Attention(name="attn.1", inputs=("x",), prefix="layers.1.attn", dim=H * hd, n_heads=H, n_kv_heads=KV,
                      head_dim=hd, rope_theta=10000.0, softcap=softcap)  # softcap: Gemma 2's score cap
        m = ir.Module(name="cflow_attn_tune")
        offs = (0, H * hd, H * hd + KV * hd)
        kvp = P(i16) if KV_BYTES[kv] == 2 else P(f32)
        args = [P(f32)] * 6 + [kvp, kvp] + [P(f32)] * 4 + [i64, i64, i64]
        # bf16_unit: the unit to emit for (None: the host's, as a session of this max_seq would: host_unit)
        self.unit = host_unit((H, KV, hd), kv, target, S) if bf16_unit is None else bf16_unit
        for i, d in enumerate(distances):
            fn = attention(m, n, offs, target.isa, kv, S, self.unit, d)
            w = ir.Function(m, ir.FunctionType(ir.VoidType(), args), f"attn{i}")
            b = ir.IRBuilder(w.append_basic_block("entry"))
            b.call(fn, list(w.args))
            b.ret_void()
        self.lib = Library(name="cflow_attn_tune", target=target, cache=None)  # kept: the functions live in it
        self.lib.add_ir(m)
        self.lib.finalize()
        vp = ctypes.c_void_p
        self.fns = [self.lib.get_cfunc(f"attn{i}", None, *([vp] * 12), ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64) for i in range(len(distances))]
        rng = np.random.default_rng(seed)
        ang = rng.random((S, hd // 2)).astype(np.float32)  # any angles: the timing does not depend on them
        self.cos, self.sin = np.cos(ang), np.sin(ang)
        self.qkv = rng.standard_normal((H + 2 * KV) * hd).astype(np.float32)
        self.att = np.zeros(H * hd, np.float32)
        self.scores = np.zeros((H // KV) * (S + 32), np.float32)  # abi.ScratchLayout.scores: rep x (S + 2 x 16)
        self.per = kv_floats_per_layer(SimpleNamespace(n_kv_heads=KV, head_dim=hd), S)  # K (or V) entries per layer
        one = rng.standard_normal(2 * self.per).astype(np.float32)
        one = one.astype(np.float16).view(np.int16) if kv == "f16" else bf16_bits(one) if kv == "bf16" else one
        self.n_caches = max(1, n_caches)
        buf = aligned_empty(self.n_caches * one.nbytes, tune.PAGE)
        self.caches = buf.view(one.dtype).reshape(self.n_caches, one.size)
        self.caches[:] = one  # one layer's K/V repeated: distinct addresses, so the set streams from DRAM

    def kv_bytes(self, pos: int) -> int:
        """K and V bytes one call reads at position pos (every kv head)."""
        return 2 * (pos + 1) * self.n_kv_heads * self.head_dim * KV_BYTES[self.kv]

    def call(self, i: int, c: int, pos: int) -> None:
        if not 0 <= pos < self.max_seq:  # the core writes K/V at pos: past the cache would corrupt memory
            raise ValueError(f"position {pos} outside the cache's 0..{self.max_seq - 1}")
        cache = self.caches[c % self.n_caches]
        p = cache.ctypes.data
        self.fns[i](self.qkv.ctypes.data, None, None, None, None, None, p, p + self.per * cache.itemsize,
                    self.cos.ctypes.data, self.sin.ctypes.data, self.att.ctypes.data, self.scores.ctypes.data,
                    pos, 0, self.n_kv_heads)


def timed_set(geom: tuple[int, int, int], kv: str) -> tuple[int, int, int]:
    """(bytes of one layer's cache, layers per timed call, calls in the rotation) for a search: up to LAYERS layers
    per call but about tune.MIN_BYTES at most (one large model's layer cache is 64 MiB), and enough calls that the
    set is tune.stream_span (twice the last-level cache) before a cache is read again."""
    _, KV, hd = geom
    cache_bytes = 2 * kv_floats_per_layer(SimpleNamespace(n_kv_heads=KV, head_dim=hd), TUNE_SEQ) * KV_BYTES[kv]
    layers = max(1, min(LAYERS, -(-tune.MIN_BYTES // cache_bytes)))
    calls = max(2, -(-tune.stream_span(layers * cache_bytes) // (layers * cache_bytes)))
    return cache_bytes, layers, calls


def measure(geom: tuple[int, int, int], kv: str, target, rounds: int = ROUNDS, distances=DISTANCES,
            check: bool = True, unit: str | None = None) -> list[dict]:
    """Time each distance (module docstring): [{"knobs": {"kv_prefetch": d}, "gbps" (median K/V read rate),
    "samples"}] in `distances` order. unit: the bf16 core's unit to time (None: the host's; attention.core_unit)."""
    H, KV, hd = geom
    _, layers, n_calls = timed_set(geom, kv)
    bench = AttentionBench(H, KV, hd, kv, TUNE_SEQ, target, distances, n_caches=layers * n_calls, bf16_unit=unit)
    pos = POSITION
    nd = len(distances)

    def call(i: int, c: int) -> None:  # variant i over the layers of rotation slot c
        for layer in range(c % n_calls * layers, (c % n_calls + 1) * layers):
            bench.call(i, layer, pos)

    outs = []
    for i in range(nd):  # warm-up (code) and the bit-identity check, on slot 0 (untimed; the rounds start at 1)
        call(i, 0)
        outs.append(bench.att.copy())
    if check:
        for i in range(1, nd):
            if not np.array_equal(outs[0], outs[i]):
                raise CflowError(f"tuning: attention prefetch {distances[i]} changes the core's numbers "
                                 f"({attention_key(H, KV, hd, kv, bench.unit)})")
    # as tune.measure: every call reads the next slot; `skip` more per round make the stride prime to the slots
    skip = tune.round_skip(nd, n_calls)
    samples: list[list[float]] = [[] for _ in distances]
    slot = 1
    for r in range(rounds):
        for i in (range(nd) if r % 2 == 0 else reversed(range(nd))):
            t0 = time.perf_counter()
            call(i, slot)
            samples[i].append(layers * bench.kv_bytes(pos) / (time.perf_counter() - t0) / 1e9)
            slot += 1
        slot += skip
    return [{"knobs": {"kv_prefetch": d}, "gbps": float(np.median(s)), "samples": [round(x, 3) for x in s]}
            for d, s in zip(distances, samples)]


def _valid(c) -> dict | None:
    if isinstance(c, dict) and set(c) == {"kv_prefetch"}:
        d = c["kv_prefetch"]
        if isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 1 << 17 and d % 64 == 0:
            return c
    return None


def tune_attention(geom: tuple[int, int, int], kv: str, target, rounds: int = ROUNDS, unit: str | None = None) -> dict:
    """Search and return the record stored in the table for one attention geometry and cache type (unit: the
    bf16 core's, as measure)."""
    from .target import cpu_model

    res = measure(geom, kv, target, rounds=rounds, unit=unit)
    return {"choice": tune.choose(res), "cpu": cpu_model(), "isa": target.isa, "rounds": rounds,
            "position": POSITION, "layers_per_call": timed_set(geom, kv)[1],
            "results": [{"variant": f"kv_prefetch {r['knobs']['kv_prefetch']}", "knobs": r["knobs"],
                         "gbps": round(r["gbps"], 3)} for r in res]}


def choices(geoms, kv: str, target, search: bool = False, force: bool = False, rounds: int = ROUNDS,
            on_result=None, ignore_env: bool = False, max_seq: int = TUNE_SEQ) -> dict[str, dict]:
    """{attention_key: {"kv_prefetch": d}} for these geometries and cache type on this host, by tune.choices'
    rules (tune.cached_choices: cached choices, else the distance shipped for this microarchitecture
    (tune_defaults); a search for missing ones when `search` is set; {} under CFLOW_TUNE=off unless ignore_env;
    the default's entries left out). on_result(key, record) sees each record. max_seq: the sessions' cache
    positions, which decide whether a bf16 core runs on the tile unit (attention.core_unit). The search measures every
    distance in DISTANCES, about a second per geometry (tune.ATTENTION_SECONDS, kept from a model's budget)."""
    from .tune_defaults import attention_choice

    if not (tune.enabled() or force or ignore_env):
        return {}
    units = {g: host_unit(g, kv, target, max_seq) for g in geoms}  # the core a session of max_seq runs
    keys = {attention_key(*g, kv, units[g]): g for g in sorted(geoms)}
    shipped = attention_choice(kv)
    return tune.cached_choices(
        target, keys, _valid, {"kv_prefetch": KV_PREFETCH},
        lambda g, deadline: tune_attention(g, kv, target, rounds, units[g]),
        lambda n: f"attention prefetch distance for {n} attention geometr{'ies' if n != 1 else 'y'}",
        search=search, force=force, on_result=on_result, budget=tune.ATTENTION_SECONDS * len(keys),
        shipped=(lambda key: {"kv_prefetch": shipped}) if shipped is not None else None)
