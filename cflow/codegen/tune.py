"""Per-host kernel tuning: a short measured search over the mat-vec kernel's schedule knobs, cached per CPU.

Stage: codegen (used by the runtime before it emits a step). The decode kernels were tuned by hand on one
Intel host; what streams fastest differs between CPUs (prefetch distance, hint and density, units per loop
iteration, 16-row groups per pass, one row group per loop iteration (the group loop: short loop bodies stream
faster on Zen 5), 256- vs 512-bit integer dots, the Q4 unpack sequence), and the knobs
interact (on Zen 4 the 256-bit kernel only pays once the software prefetch is off), so the search is a
coordinate descent: the first time a kernel shape (dtype, columns, tile, gate_up) is met on a CPU, the current
choice and every one-knob change of it (SPACE) are JIT-compiled in one library and timed on >= 64 MiB of real
packed weights per call, each call the next window of a set at least twice the last-level cache (so it streams
from DRAM, as decode does: stream_span), candidates interleaved round by round, the median
kept; the best becomes the current choice if it beats it by more than MARGIN (so noise does not flip the
choice; ties keep the earlier candidate), and the next pass starts from it, up to PASSES passes. The descent runs
once from each loop kind (SEEDS: the unit loop and the group loop want different prefetch distances). Every
descent's end other than the default then meets the default head to head (CONFIRM_ROUNDS), so a chain of
noisy steps cannot drift to a slower kernel. Candidates are compared by the median of their per-round
ratios to the current choice, which cancels slow swings of the host's memory bandwidth (shared machines).
The result is cached in $CFLOW_CACHE_DIR/tune/<cpu>.json, keyed by kernel shape, and the CPU model and
LLVM feature string are part of the file's key; later loads only read it, so the choice is deterministic
given the cache. The program cache's fingerprint includes the choices.

Numerics never change: every knob is a schedule knob (prefetch hints, loop unrolling, how many row groups share a
pass over the tile-row, one group per loop iteration) or changes only how an exact integer block sum is formed (256-
vs 512-bit integer dot products on an AVX-512 host, the Q4 nibble-unpack sequence); each row's per-block arithmetic
and its summation order over blocks stay the same (tests/codegen/test_tune.py checks the candidates are
bit-identical, and measure() checks it again on every search).

CFLOW_TUNE=off (or 0/no/false): no search and no cached choice, the kernels' defaults; `cflow tune FILE`
runs the search explicitly (``force=True`` re-measures) and prints the table.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import time
import warnings
from pathlib import Path

import numpy as np
from llvmlite import ir

from ..errors import CflowError
from ..util import atomic_write_text, switched_off
from . import kernels as K
from .cache import default_cache_dir

MARGIN = 0.03  # a candidate must beat the current choice's median by 3% to replace it
MIN_BYTES = 64 * 2**20  # weights streamed per timed call (milliseconds of DRAM traffic)
MAX_SPAN = 4 * 2**30  # the most memory the rotating set may take (stream_span)
PASSES = 3  # coordinate-descent passes at most (each: the current choice and its one-knob neighbours)
ROUNDS = 9  # timed rounds per candidate (each call streams MIN_BYTES: milliseconds; the JIT costs more)
CONFIRM_ROUNDS = 15  # rounds of the final head-to-head of a non-default choice against the default
CHUNK = 6  # candidates JIT-compiled and timed together in a budgeted search (search(): deadline)
KNOBS = ("unroll", "prefetch", "prefetch_locality", "prefetch_stride", "max_groups", "vector_bits", "unpack",
         "group_loop")
DEFAULT = {"unroll": K.DEFAULT_UNROLL, "prefetch": K.DEFAULT_PREFETCH,
           "prefetch_locality": K.DEFAULT_PREFETCH_LOCALITY, "prefetch_stride": 64, "max_groups": K.MAX_GROUPS,
           "vector_bits": 0, "unpack": 0, "group_loop": 0}
# One descent per loop kind: the group loop's best prefetch distance differs from the unit loop's (on an AMX Xeon
# the group loop is 9% slower than the unit loop at the unit loop's distance and 9% faster one line further), so a
# descent from the unit loop alone never changes both knobs at once.
SEEDS = (DEFAULT, {**DEFAULT, "group_loop": 1})


def default_for(layout, isa, gate_up: bool = False) -> dict:
    """The kernel's built-in knobs for a layout on an ISA path (DEFAULT, with the prefetch distance one unit ahead
    for a GGUF block type, kernels.default_prefetch, and its type's kernels.builtin_knobs on that path, a fused
    gate+up kernel's where they differ)."""
    return _normal({**DEFAULT, "prefetch": K.default_prefetch(layout, isa, gate_up),
                    **K.builtin_knobs(layout, isa, gate_up)})
# 2: vector_bits and unpack; 3: prefetch_stride and the coordinate descent; 4: group_loop; 5: a descent per loop
# kind, prefetch distances one line past a unit multiple, the timed set page-aligned and past the last-level cache;
# 6: a quarter and half a unit; 7: a GGUF block type's default prefetch one unit ahead; 8: per-ISA built-in knobs for
# the block types (kernels.BUILTIN_KNOBS: a record searched from the older built-in would pin it); 9: Q6_K's group
# loop on AVX-512 (the same); 10: Q6_K's unit loop on AVX-512 again; 11: Q4 / Q8 two units ahead on the 256-bit
# paths (kernels.BUILTIN_KNOBS' prefetch_units); 12: Q5_K / Q6_K a quarter unit ahead there; 13: a fused gate+up
# kernel's own built-ins (kernels.BUILTIN_GATE_UP_KNOBS) and a block type's unit loop taking its halves in one loop
# (older tables: searched again)
SCHEMA = 13


def enabled() -> bool:
    return not switched_off("CFLOW_TUNE")


def kernel_key(layout, gate_up: bool) -> str:
    """The kernel shape a choice applies to (as step.py's matvec_fn keys its kernels: rows do not matter)."""
    return f"{layout.dtype.label}:{layout.cols}:{layout.tr}x{layout.tc}:{'gate_up' if gate_up else 'plain'}"


def space(layout, isa: str | None = None) -> dict[str, tuple]:
    """The values each knob may take for this kernel shape: prefetch distances in units of the kernel's block unit (so
    they scale with the dtype and tile), 1/4, 1/2, 1 or 2 units also one 64-byte line further (the group loop's best
    on an AMX Xeon: each iteration's prefetches then straddle two 256-byte blocks; a quarter unit: Q8's best
    there, 4,352-byte units), the prefetch density (every line,
    or one line per unit: a hint that keeps the hardware prefetchers ahead without an instruction per line; in a
    group loop one line per group), the unit loop or the group loop; on an AVX-512 VNNI host (isa) also the 256-bit
    (AVX2) kernel; on either VNNI path, for Q4, the other nibble-unpack sequence."""
    from ..layout.tile import DType
    from .target import ISA

    unit = layout.unit_nbytes
    q, h = unit // 4 // 64 * 64, unit // 2 // 64 * 64  # a quarter and half a unit, whole lines
    dist = (0, q, q + 64, h, h + 64, unit, unit + 64, 2 * unit, 2 * unit + 64, 4 * unit, 8 * unit, 16 * unit)
    sp = {"prefetch": tuple(dict.fromkeys(min(d, 1 << 17) for d in dist)),
          "prefetch_stride": (64, unit) if unit > 64 else (64,),
          "prefetch_locality": (3, 2, 0), "unroll": (1, 2, 4), "max_groups": (8, 4),
          "vector_bits": (0,), "unpack": (0,), "group_loop": (0, 1)}
    if isa is not None and ISA.parse(isa).vnni and layout.dtype.quantised:
        if ISA.parse(isa) == ISA.AVX512VNNI:
            sp["vector_bits"] = (0, 256)
        if layout.dtype == DType.Q4:
            sp["unpack"] = (0, 1)
    if layout.is_block_type:  # a unit is a whole GGUF block (256 inputs for K-quants): one per iteration
        sp["unroll"] = (1,)
    return sp


def _normal(c: dict) -> dict:
    """One spelling per kernel: without a software prefetch its hint and density mean nothing, and a group loop
    (one row group per iteration) has no units per iteration or groups per pass."""
    if not c["prefetch"]:
        c = {**c, "prefetch_locality": DEFAULT["prefetch_locality"], "prefetch_stride": 64}
    if c["group_loop"]:
        c = {**c, "unroll": DEFAULT["unroll"], "max_groups": DEFAULT["max_groups"]}
    return c


def neighbours(cur: dict, layout, isa: str | None = None) -> list[dict]:
    """cur first, then every kernel one knob away from it (SPACE order), each once."""
    out, seen = [], set()
    for c in [cur] + [{**cur, k: v} for k, vals in space(layout, isa).items() for v in vals]:
        c = _normal(c)
        key = tuple(c[n] for n in KNOBS)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def candidates(layout, isa: str | None = None) -> list[dict]:
    """The first pass of the search: the default, then each one-knob change of it."""
    return neighbours(default_for(layout, isa or "generic"), layout, isa)


def label(knobs: dict) -> str:
    """A variant's short name: "u2 pf2304 L3 g8" (units per iteration, prefetch distance[/stride], locality,
    groups per pass), "gloop pf9216 L3" for a group loop (one row group per iteration: no u or g), then v256 /
    shift for the 256-bit dot and the shift unpack."""
    extra = (" v256" if knobs.get("vector_bits") == 256 else "") + (" shift" if knobs.get("unpack") else "")
    st = knobs.get("prefetch_stride", 64)
    pf = f"pf{knobs['prefetch']}" + (f"/{st}" if knobs["prefetch"] and st != 64 else "")
    if knobs.get("group_loop"):
        return f"gloop {pf} L{knobs['prefetch_locality']}{extra}"
    return f"u{knobs['unroll']} {pf} L{knobs['prefetch_locality']} g{knobs['max_groups']}{extra}"


# --- the cache ------------------------------------------------------------------------------------
def _host_id(target) -> str:
    from .target import cpu_name

    return f"{cpu_name()}|{target.cpu}|{target.features}"


def _path(target) -> Path:
    h = hashlib.sha256(_host_id(target).encode()).hexdigest()[:16]
    return default_cache_dir() / "tune" / f"{h}.json"


def read_table(target) -> dict:
    """{kernel key: record}; a missing, unreadable or foreign file is an empty table."""
    try:
        d = json.loads(_path(target).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict) or d.get("schema") != SCHEMA or d.get("host") != _host_id(target):
        return {}
    kernels = d.get("kernels")
    return kernels if isinstance(kernels, dict) else {}


@contextlib.contextmanager
def _table_lock(target):
    """Held from reading the table to writing it when something is measured: a second process loading on the same
    host waits for the first's search (timing both at once on the same cores would mislead both), then finds the
    records cached; nor can one process's write drop the other's records. Where no lock can be had (no fcntl, a
    cache without write access to the lock file, a file system without locks) the search runs unlocked, as before."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        fcntl = None
    p = _path(target).with_suffix(".lock")
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY) if fcntl else ():  # flock works read-only too
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, flags, 0o644)
            break
        except OSError:
            continue
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # stacklevel: this, contextlib, cached_choices, choices, its caller
                warnings.warn(f"waiting for another process's kernel search on this CPU ({p})", stacklevel=5)
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # ENOLCK and the like: search unlocked
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _write_table(target, table: dict) -> None:
    p = _path(target)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, json.dumps({"schema": SCHEMA, "host": _host_id(target), "kernels": table},
                                        indent=1, sort_keys=True), durable=False)
    except (OSError, CflowError):
        pass  # a read-only cache only costs a search next time


def _valid_choice(c) -> dict | None:
    if not isinstance(c, dict) or set(c) != set(KNOBS):
        return None
    if not all(isinstance(c[k], int) and not isinstance(c[k], bool) for k in KNOBS):
        return None
    if not (1 <= c["unroll"] <= 8 and 0 <= c["prefetch"] <= 1 << 17 and c["prefetch_locality"] in (0, 1, 2, 3)
            and 64 <= c["prefetch_stride"] <= 1 << 16 and c["prefetch_stride"] % 64 == 0
            and 1 <= c["max_groups"] <= 32 and c["vector_bits"] in (0, 256) and c["unpack"] in (0, 1)
            and c["group_loop"] in (0, 1)):
        return None
    return c


# --- the measurement ------------------------------------------------------------------------------
def stream_span(nbytes: int) -> int:
    """Bytes of distinct weights the timed calls cycle through, each call reading the next `nbytes` window: at
    least twice the last-level cache, so a window has left the cache before it is read again, as decode's
    weights have. A fixed 64 MiB set streamed from DRAM on Zen 4 and Zen 5 (32 MiB L3) but stayed in an AMX
    Xeon's 480 MiB L3, where the search then timed L3 speed (up to 28.9 GB/s against 18.5 from DRAM:
    docs/results/intel-amx/tune_table_intel_l3.json)."""
    from .target import last_level_cache

    return max(nbytes, min(2 * last_level_cache()[1], MAX_SPAN))


PAGE = 4096  # a loaded file's tensors start on a page boundary (FORMAT: data sections aligned for direct I/O)
_ARENA: list = []  # inside reusing_one_buffer(): [the buffer every WeightSet of the searches fills in turn]


@contextlib.contextmanager
def reusing_one_buffer():
    """The searches of one model (cached_choices) build their WeightSets one after the other, each a set twice the
    last-level cache (960 MiB on an AMX Xeon): inside this they fill one buffer, so its pages are faulted in
    once, not once per kernel shape (4 of the 21 s `cflow tune` took on the 114m preset were the kernel's page
    faults). Released on exit."""
    _ARENA.append(None)
    try:
        yield
    finally:
        _ARENA.pop()


def _buffer(nbytes: int) -> np.ndarray:
    """uint8[nbytes], page-aligned: the shared buffer inside reusing_one_buffer() (grown when too small), else new."""
    from ..layout.tile import aligned_empty

    if not _ARENA:
        return aligned_empty(nbytes, PAGE)
    if _ARENA[-1] is None or _ARENA[-1].nbytes < nbytes:
        _ARENA[-1] = None  # the old one freed before the new one is faulted in
        # an eighth more: the sets of other shapes differ by up to a window (whole tile-rows); pages never
        # written are never faulted in
        _ARENA[-1] = aligned_empty(nbytes + nbytes // 8, PAGE)
    return _ARENA[-1][:nbytes]


def _weights(layout, gate_up: bool, nbytes: int, seed: int = 0, phase: int = 0):
    """Real packed weights of one tile-row (random normal values), repeated to >= nbytes: (buffer, layout).

    The buffer starts `phase` bytes past a page boundary; 0 is where a loaded file's tensors start. The phase
    matters: on an AMX Xeon the group loop streamed 1.23x faster 64 bytes past a page boundary than on it
    (docs/journal/performance.md, "A third host kind"), and a set timed at NumPy's allocation offset chose a kernel that
    decode, reading page-aligned tensors, ran 15% slower."""
    from ..layout.tile import TileLayout, pack, pack_gate_up

    rng = np.random.default_rng(seed)
    one = TileLayout(layout.dtype, layout.tr, layout.cols, (layout.tr, layout.tc))
    if one.is_block_type:  # a GGUF block type: random block bytes, fp16 scales small and finite
        w = _random_blocks(one, rng)
        row = pack_gate_up(w, w, layout.dtype, one.tile) if gate_up else pack(w, layout.dtype, one.tile)
        n = max(1, -(-nbytes // row.nbytes))
        buf = _buffer(n * row.nbytes + phase)[phase:]
        buf.reshape(n, row.nbytes)[:] = np.asarray(row, np.uint8).reshape(1, -1)
        return buf, TileLayout(layout.dtype, layout.tr * n, layout.cols, one.tile)
    w = (rng.standard_normal((layout.tr, layout.cols)) * 0.05).astype(np.float32)
    row = pack_gate_up(w, w[::-1].copy(), layout.dtype.label, one.tile) if gate_up else pack(
        w, layout.dtype.label, one.tile)
    n = max(1, -(-nbytes // row.nbytes))
    buf = _buffer(n * row.nbytes + phase)[phase:]
    buf.reshape(n, row.nbytes)[:] = np.asarray(row, np.uint8).reshape(1, -1)
    return buf, TileLayout(layout.dtype, layout.tr * n, layout.cols, one.tile)


def _random_blocks(layout, rng):
    """One tile-row of random blocks of a GGUF block type (every field random but the whole-block scales, ~1e-3)."""
    from ..layout.blocks import random_blocks

    return random_blocks(layout.dtype, layout.tr, layout.cols_p, rng)


class WeightSet:
    """Real packed weights of one kernel shape (`weights`, over `layout`: its tile-row repeated), cut into windows
    of >= nbytes (`window` tile-rows, `window_bytes` each, `n_windows` of them, >= span bytes in all), starting
    `phase` bytes past a page boundary. Filling a 960 MiB set takes seconds, so a search builds one per shape and
    every pass times on it."""

    def __init__(self, layout, gate_up: bool, nbytes: int, span: int | None = None, phase: int = 0):
        from ..layout.tile import TileLayout

        # bytes of one tile-row (gate_up: both halves); the set is a whole number of windows
        per_row = TileLayout(layout.dtype, layout.tr, layout.cols, (layout.tr, layout.tc)).nbytes * (1 + gate_up)
        self.window = -(-nbytes // per_row)
        self.n_windows = max(1, -(-(span or 0) // (self.window * per_row)))
        self.window_bytes = self.window * per_row
        self.weights, self.layout = _weights(layout, gate_up, self.n_windows * self.window_bytes, phase=phase)
        assert self.layout.n_tile_rows == self.n_windows * self.window
        self.cursor = 0  # the next window a timed call reads; it runs on across measure() calls on this set

    def window_rows(self, w: int) -> tuple[int, int]:
        """The tile-row range of window w (cyclic)."""
        lo = (w % self.n_windows) * self.window
        return lo, lo + self.window

    def take(self) -> tuple[int, int]:
        """The next window's tile-row range: consecutive calls never read the same window while it is cached."""
        self.cursor += 1
        return self.window_rows(self.cursor - 1)


class Candidates:
    """Kernel variants `cands` of one shape JIT-compiled in one library, with real packed weights (a WeightSet:
    `wset`, built here unless given; `weights` and `layout` are its) and a quantised random activation: what a
    timing of the variants needs (measure() here, benchmarks/tune_threads.py on several threads). call(i, y, lo,
    hi) runs variant i over tile-rows [lo, hi) (default: all) into y; `weights` may be replaced by a copy of itself
    (e.g. a memory-mapped one): every call passes its pointer."""

    def __init__(self, layout, gate_up: bool, cands: list[dict], target, nbytes: int, span: int | None = None,
                 phase: int = 0, wset: WeightSet | None = None):
        from .library import Library

        isa = K._check_isa(target.isa)
        self.wset = wset if wset is not None else WeightSet(layout, gate_up, nbytes, span, phase)
        self.weights, self.layout = self.wset.weights, self.wset.layout
        big = self.layout
        self.streamed = big.nbytes * (2 if gate_up else 1)  # bytes one whole call reads (gate_up: both halves)
        mod = ir.Module(name="cflow_tune")
        K.emit_quantize_act(mod, "quantize_act", big.cols, big.cols_p)
        for i, c in enumerate(cands):
            K.emit_matvec(mod, f"mv{i}", big, isa, gate_up=gate_up, **c)
        self.lib = Library(name="cflow_tune", target=target, cache=None)  # kept: the functions live in it
        self.lib.add_ir(mod)
        self.lib.finalize()
        vp = ctypes.c_void_p
        quant = self.lib.get_cfunc("quantize_act", None, vp, vp, vp, vp)
        self.fns = [self.lib.get_cfunc(f"mv{i}", None, vp, vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64)
                    for i in range(len(cands))]
        self.act = K.Activation(big.cols, big.cols_p)
        self.act.x[: big.cols] = np.random.default_rng(1).standard_normal(big.cols).astype(np.float32)
        quant(K._p(self.act.x), K._p(self.act.xq), K._p(self.act.xd), K._p(self.act.xs))
        self._args = [K._p(a) for a in (self.act.x, self.act.xq, self.act.xd, self.act.xs)]

    def call(self, i: int, y: np.ndarray, lo: int = 0, hi: int | None = None) -> None:
        hi = self.layout.n_tile_rows if hi is None else hi
        self.fns[i](K._p(self.weights), *self._args, K._p(y), lo, hi)


def round_skip(per_round: int, n_windows: int) -> int:
    """Windows to skip after each round of `per_round` timed calls so that the stride between rounds is prime to
    the window count (measure() here, attn_tune.measure): every candidate then reads different windows."""
    return next(k for k in range(n_windows) if math.gcd(per_round + k, n_windows) == 1)


def measure(layout, gate_up: bool = False, cands: list[dict] | None = None, target=None, rounds: int = ROUNDS,
            nbytes: int | None = None, check: bool = True, wset: WeightSet | None = None) -> list[dict]:
    """Time each candidate on the same weights, interleaved round by round (one thread).

    Returns [{"knobs", "gbps" (median), "samples"}] in candidate order. check: every candidate's output
    must be bit-identical to the first's (the knobs are schedule-only). wset: the weights to time on (search()
    passes one set to all its passes); by default a set of nbytes windows past the last-level cache.
    """
    from .target import host_target

    target = target if target is not None else host_target()
    cands = cands if cands is not None else candidates(layout, K._check_isa(target.isa))
    if wset is None:
        wset = WeightSet(layout, gate_up, nbytes or MIN_BYTES, span=stream_span(nbytes or MIN_BYTES))
    bench = Candidates(layout, gate_up, cands, target, 0, wset=wset)
    ys = [np.zeros(bench.layout.rows_p, np.float32) for _ in cands]
    # Each timed call reads the next window, so its bytes come from DRAM (stream_span). A round is len(cands)
    # calls; `skip` windows more per round make that stride prime to the window count, so over the rounds every
    # candidate reads different windows (with a stride sharing a factor with it, a candidate read the same few
    # windows in every round, and a slower or faster region of the set biased it).
    skip = round_skip(len(cands), wset.n_windows)

    def call(i):
        bench.call(i, ys[i], *wset.take())

    warm = wset.take()
    for i in range(len(cands)):  # warm-up (code) and the bit-identity check, all on one window (untimed)
        bench.call(i, ys[i], *warm)
    if check:
        for i in range(1, len(cands)):
            if not np.array_equal(ys[0], ys[i]):
                raise CflowError(f"tuning: candidate {label(cands[i])} changes the mat-vec's numbers "
                                 f"(kernel {kernel_key(layout, gate_up)})")
    streamed = wset.window_bytes
    samples: list[list[float]] = [[] for _ in cands]
    for r in range(rounds):
        wset.cursor += skip
        order = range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))  # no position favoured
        for i in order:
            t0 = time.perf_counter()
            call(i)
            samples[i].append(streamed / (time.perf_counter() - t0) / 1e9)
    return [{"knobs": c, "gbps": float(np.median(s)), "samples": [round(x, 3) for x in s]}
            for c, s in zip(cands, samples)]


def _ratio(r: dict, ref: dict) -> float:
    """r's speed relative to ref: the median of per-round ratios (each round times both within milliseconds, so a
    burst of other memory traffic that lasts several rounds cancels out); the ratio of medians without samples."""
    a, b = r.get("samples") or [], ref.get("samples") or []
    if a and len(a) == len(b) and all(x > 0 for x in b):
        return float(np.median([x / y for x, y in zip(a, b)]))
    return r["gbps"] / ref["gbps"]


def choose(results: list[dict]) -> dict:
    """results[0] (the current choice) unless a candidate beats it by more than MARGIN (per-round ratio, _ratio);
    the fastest wins, ties go to the earlier candidate."""
    ref = results[0]
    best, best_ratio = ref, 1.0 + MARGIN
    for r in results[1:]:
        q = _ratio(r, ref)
        if q > best_ratio:
            best, best_ratio = r, q
    return best["knobs"]


def _shipped(layout, gate_up: bool, target) -> dict | None:
    from .tune_defaults import kernel_choice

    shipped = kernel_choice(layout, gate_up, target)
    return _normal(shipped) if shipped is not None else None


def start_for(layout, gate_up: bool, target) -> dict:
    """Where a load starts without a cached record, and a search starts its first descent: the choice shipped for
    this host's microarchitecture family (tune_defaults), else the built-in default_for(layout, isa)."""
    return _shipped(layout, gate_up, target) or default_for(layout, target.isa, gate_up)


def search(layout, gate_up: bool, target, rounds: int = ROUNDS, nbytes: int | None = None,
           passes: int = PASSES, deadline: float | None = None) -> tuple[dict, list[dict]]:
    """The coordinate descent (module docstring), first from the shipped start (start_for), then from each of
    SEEDS' loop kinds not yet tried: (choice, [{"pass", "seed", "knobs", "gbps"}] of every timing). Pass numbers
    count from 1; the final head to head of the start, the default and every descent's end is pass 0. Every timing
    reads the same WeightSet, built once here.

    deadline (time.perf_counter() seconds): a pass is timed in chunks of CHUNK candidates beside the current
    choice, and no chunk or pass starts that would end after it, were it as long as the last chunk (and the head
    to head half as long); the descents still to come are left out. The first chunk always runs, and the head to
    head always runs when a descent moved, so a choice other than the start is always confirmed."""
    nbytes = nbytes or MIN_BYTES
    wset = WeightSet(layout, gate_up, nbytes, span=stream_span(nbytes))
    log, ends = [], []
    base, start = default_for(layout, target.isa, gate_up), start_for(layout, gate_up, target)
    seeds = [start] + [_normal({**seed, "prefetch": base["prefetch"]}) for seed in SEEDS
                       if seed["group_loop"] != start["group_loop"]]
    last = 0.0  # seconds the last pass took: a pass is not started unless one as long would end by the deadline

    def out_of_time() -> bool:  # the head to head after the descents takes about half a pass
        return deadline is not None and time.perf_counter() + 1.5 * last > deadline

    for s, cur in enumerate(seeds):
        if s and out_of_time():
            break
        for p in range(1, passes + 1):
            if p > 1 and out_of_time():
                break
            cands = neighbours(cur, layout, target.isa)
            # without a deadline one timing of the whole pass; with one, chunks of CHUNK candidates, each beside
            # the current choice (its reference), the JIT and timing of the next chunk only if the last one's
            # time still fits: a path whose ~20 candidates JIT slowly (AVX2) keeps its budget
            step = len(cands) if deadline is None else CHUNK
            best, best_ratio = cur, 1.0 + MARGIN
            for i in range(1, max(2, len(cands)), step):
                if i > 1 and out_of_time():
                    break
                t0 = time.perf_counter()
                res = measure(layout, gate_up, cands=[cur] + cands[i:i + step], target=target, rounds=rounds,
                              wset=wset)
                last = time.perf_counter() - t0
                log += [{"pass": p, "seed": s, **r} for r in res]
                for r in res[1:]:
                    q = _ratio(r, res[0])
                    if q > best_ratio:
                        best, best_ratio = r["knobs"], q
            if best == cur:
                break
            cur = best
        ends.append(cur)
    finalists = list({json.dumps(c, sort_keys=True): c for c in [start, base] + ends}.values())
    cur = finalists[0]
    if len(finalists) > 1:  # head to head with the start, so noisy steps cannot add up to a slower kernel
        res = measure(layout, gate_up, cands=finalists, target=target, rounds=max(rounds, CONFIRM_ROUNDS),
                      wset=wset)
        log += [{"pass": 0, **r} for r in res]
        cur = choose(res)
    return cur, log


def tune_kernel(layout, gate_up: bool, target, rounds: int = ROUNDS, nbytes: int | None = None,
                passes: int = PASSES, deadline: float | None = None) -> dict:
    """Search and return the record stored in the table for one kernel shape."""
    from .target import cpu_model

    t0 = time.perf_counter()
    choice, log = search(layout, gate_up, target, rounds=rounds, nbytes=nbytes, passes=passes, deadline=deadline)
    return {"choice": choice, "cpu": cpu_model(), "isa": target.isa, "rounds": rounds,
            "seconds": round(time.perf_counter() - t0, 2),
            "results": [{"pass": r["pass"], "seed": r.get("seed", 0), "variant": label(r["knobs"]), "knobs": r["knobs"],
                         "gbps": round(r["gbps"], 3)} for r in log]}


def kernel_shapes(tensors) -> dict[str, tuple]:
    """{kernel key: (layout, gate_up)} of every tiled stream a step reads with the mat-vec kernel."""
    from ..layout.packed import Form

    out = {}
    for t in tensors:
        if t.form.is_tiled:
            gu = t.form == Form.GATE_UP
            out.setdefault(kernel_key(t.layout, gu), (t.layout, gu))
    return dict(sorted(out.items()))


def choices(tensors, target, search: bool = False, force: bool = False, rounds: int = ROUNDS,
            nbytes: int | None = None, passes: int = PASSES, on_result=None,
            ignore_env: bool = False, budget: float | None = None) -> dict[str, dict]:
    """{kernel key: knobs} for a model's kernels on this host, where they differ from the built-in default: cached
    choices, else the shipped ones (start_for); a search for the shapes without a cached record when `search` is
    set (`cflow tune`, or a load under CFLOW_TUNE=search), in `budget` seconds in all (cached_choices); {} when
    CFLOW_TUNE=off (the defaults) unless ignore_env (`cflow tune`). on_result(key, record) sees each record; a
    caller without one is told by a warning that a search is about to run and how long it may take."""
    if not (enabled() or force or ignore_env):
        return {}
    shapes = kernel_shapes(tensors)
    return cached_choices(
        target, shapes, _valid_choice, lambda key: default_for(shapes[key][0], target.isa, shapes[key][1]),
        lambda shape, deadline: tune_kernel(shape[0], shape[1], target, rounds=rounds, nbytes=nbytes, passes=passes,
                                            deadline=deadline),
        lambda n: f"mat-vec kernel variants for {n} kernel shape{'s' * (n != 1)}",
        search=search, force=force, on_result=on_result, budget=budget,
        shipped=lambda key: _shipped(*shapes[key], target))


BUDGET = 15.0  # seconds `cflow tune` spends on one model's searches by default (all shapes and attention)
ATTENTION_SECONDS = 1.5  # what one attention geometry's search takes (0.8 s on an AMX Xeon): kept from BUDGET
SETUP_SECONDS = 1.5  # the rest of `cflow tune`: Python, NumPy and LLVM start-up, reading the file's header


def kernel_budget(budget: float | None, n_attention: int) -> float | None:
    """The mat-vec searches' share of a model's budget: what the start-up and the attention searches (not
    budgeted: a fixed set of distances) leave, at least half of it."""
    return None if budget is None else max(budget / 2, budget - SETUP_SECONDS - ATTENTION_SECONDS * n_attention)


def search_at_load() -> bool:
    """CFLOW_TUNE=search: a load measures the shapes this CPU's table lacks (in BUDGET seconds), as `cflow tune`;
    otherwise a load only reads the table and the shipped choices."""
    return os.environ.get("CFLOW_TUNE", "").strip().lower() == "search"


def cached_choices(target, keys: dict, valid, default, measure, what, search: bool = False,
                   force: bool = False, on_result=None, budget: float | None = None, shipped=None) -> dict[str, dict]:
    """The table logic every tuned choice shares (choices() here, attn_tune.choices): {key: choice} for `keys`
    ({key: what measure() takes}) on this host. A cached record whose choice passes valid() is reused; the others
    (all with force) are measured (measure(arg, deadline) -> record with "choice") when search is set, stored, and
    the table written once; without a search they take shipped(key) (the microarchitecture's shipped choice, or
    None). Choices equal to `default` (a dict, or a function of the key: the built-in) are left out.

    budget: seconds for all the searches; each key gets an equal share of what is left (its deadline), so a model
    with more shapes searches each one less deeply. on_result(key, record) sees each record (a shipped choice's
    record is {"choice", "shipped": True}); without one a warning says that a search is about to run (what(n):
    what is measured, for n keys) and how long it may take. A search holds the table's lock (_table_lock) from its
    read to its write."""

    def missing(table):
        cached = {k: valid(table[k].get("choice")) if isinstance(table.get(k), dict) else None for k in keys}
        return cached, [k for k in keys if force or (search and cached[k] is None)]

    default_of = default if callable(default) else (lambda key: default)
    table = read_table(target)
    cached, todo = missing(table)
    with _table_lock(target) if todo else contextlib.nullcontext():
        if todo:  # another process may have measured while this one waited for the lock
            table = read_table(target)
            cached, todo = missing(table)
        if todo and on_result is None:
            how_long = f"about {budget:.0f} s" if budget else "seconds per shape"
            warnings.warn(f"measuring this CPU's {what(len(todo))} ({how_long}, once per CPU model; cached in "
                          f"{_path(target)}; CFLOW_TUNE=off uses the defaults)", stacklevel=3)
        out = {}
        t_end = time.perf_counter() + budget if budget else None
        with reusing_one_buffer() if todo else contextlib.nullcontext():
            for key, arg in keys.items():
                rec, c = table.get(key), cached[key]
                if key in todo:  # an equal share of the budget left
                    left = len(todo) - todo.index(key)
                    deadline = time.perf_counter() + max(0.0, t_end - time.perf_counter()) / left if t_end else None
                    rec = measure(arg, deadline)
                    table[key], c = rec, rec["choice"]
                elif c is None and shipped is not None:
                    c = shipped(key)
                    rec = {"choice": c, "shipped": True} if c is not None else None
                if c is not None:
                    if on_result is not None:
                        on_result(key, rec)
                    if c != default_of(key):
                        out[key] = c
        if todo:  # merged into the table as it is now: a writer that took no lock keeps its records
            _write_table(target, {**read_table(target), **{k: table[k] for k in todo}})
    return out
