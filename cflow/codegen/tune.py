"""Per-host kernel tuning: a short measured search over the mat-vec kernel's schedule knobs, cached per CPU.

Stage: codegen (used by the runtime before it emits a step). The decode kernels were tuned by hand on one
Intel host; what streams fastest differs between CPUs (prefetch distance and hint, units per loop iteration,
16-row groups per pass). The first time a kernel shape (dtype, columns, tile, gate_up) is met on a CPU, each
candidate is JIT-compiled in one library and timed on >= 64 MiB of real packed weights (past the L2/L3, so
it streams from DRAM), candidates interleaved round by round, the median kept. A candidate replaces the
default only when it is faster by more than MARGIN (so noise does not flip the choice); ties keep the
earlier candidate. The result is cached in $CFLOW_CACHE_DIR/tune/<cpu>.json, keyed by kernel shape, and
the CPU model and LLVM feature string are part of the file's key; later loads only read it, so the choice
is deterministic given the cache. The program cache's fingerprint includes the choices.

Numerics never change: every knob is a schedule knob (prefetch hints, loop unrolling, how many row groups
share a pass over the tile-row) or changes only how an exact integer block sum is formed (256- vs 512-bit
integer dot products on an AVX-512 host, the Q4 nibble-unpack sequence); each row's per-block arithmetic and
its summation order over blocks stay the same (tests/codegen/test_tune.py checks the candidates are
bit-identical, and measure() checks it again on every search).

CFLOW_TUNE=off (or 0/no/false): no search and no cached choice, the kernels' defaults; `cflow tune FILE`
runs the search explicitly (``force=True`` re-measures) and prints the table.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
from llvmlite import ir

from ..errors import CflowError
from ..util import atomic_write_text
from . import kernels as K
from .cache import default_cache_dir

MARGIN = 0.03  # a candidate must beat the default's median by 3% to be chosen
MIN_BYTES = 64 * 2**20  # weights streamed per timed call: past L3, like decode
KNOBS = ("unroll", "prefetch", "prefetch_locality", "max_groups", "vector_bits", "unpack")
DEFAULT = {"unroll": K.DEFAULT_UNROLL, "prefetch": K.DEFAULT_PREFETCH,
           "prefetch_locality": K.DEFAULT_PREFETCH_LOCALITY, "max_groups": K.MAX_GROUPS, "vector_bits": 0,
           "unpack": 0}
SCHEMA = 2  # 2: vector_bits and unpack (a table of schema 1 is searched again)


def enabled() -> bool:
    return os.environ.get("CFLOW_TUNE", "on").strip().lower() not in ("off", "0", "no", "false")


def kernel_key(layout, gate_up: bool) -> str:
    """The kernel shape a choice applies to (as step.py's matvec_fn keys its kernels: rows do not matter)."""
    return f"{layout.dtype.label}:{layout.cols}:{layout.tr}x{layout.tc}:{'gate_up' if gate_up else 'plain'}"


def candidates(layout, isa: str | None = None) -> list[dict]:
    """The default first, then one knob changed at a time (prefetch distances in units of the kernel's
    block unit, so they scale with the dtype and tile), then the two promising pairs. On an AVX-512 VNNI host
    (isa) also the 256-bit kernel and, for Q4, the other nibble-unpack sequence."""
    from ..layout.tile import DType
    from .target import ISA

    unit = layout.unit_nbytes
    d = dict(DEFAULT)
    out = [d]
    for pf in (0, unit, 2 * unit, 4 * unit):
        out.append({**d, "prefetch": pf})
    out.append({**d, "prefetch_locality": 2})
    out.append({**d, "prefetch": 2 * unit, "prefetch_locality": 2})
    for u in (1, 4):
        out.append({**d, "unroll": u})
    out.append({**d, "max_groups": 4})
    if isa is not None and ISA.parse(isa) == ISA.AVX512VNNI and layout.dtype in (DType.Q4, DType.Q8):
        out.append({**d, "vector_bits": 256})
        if layout.dtype == DType.Q4:
            out.append({**d, "unpack": 1})
    seen, uniq = set(), []
    for c in out:  # e.g. unit == DEFAULT_PREFETCH makes a duplicate of the default
        k = tuple(c[n] for n in KNOBS)
        if k not in seen:
            seen.add(k)
            uniq.append(c)
    return uniq


def label(knobs: dict) -> str:
    extra = (" v256" if knobs.get("vector_bits") == 256 else "") + (" shift" if knobs.get("unpack") else "")
    return f"u{knobs['unroll']} pf{knobs['prefetch']} L{knobs['prefetch_locality']} g{knobs['max_groups']}{extra}"


# --- the cache ------------------------------------------------------------------------------------
def _host_id(target) -> str:
    from .target import cpu_model

    return f"{cpu_model()}|{target.cpu}|{target.features}"


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
    if not (1 <= c["unroll"] <= 8 and 0 <= c["prefetch"] <= 1 << 16 and c["prefetch_locality"] in (0, 1, 2, 3)
            and 1 <= c["max_groups"] <= 32 and c["vector_bits"] in (0, 256) and c["unpack"] in (0, 1)):
        return None
    return c


# --- the measurement ------------------------------------------------------------------------------
def _weights(layout, gate_up: bool, nbytes: int, seed: int = 0):
    """Real packed weights of one tile-row (random normal values), repeated to >= nbytes: (buffer, layout)."""
    from ..layout.tile import TileLayout, aligned_empty, pack, pack_gate_up

    rng = np.random.default_rng(seed)
    one = TileLayout(layout.dtype, layout.tr, layout.cols, (layout.tr, layout.tc))
    w = (rng.standard_normal((layout.tr, layout.cols)) * 0.05).astype(np.float32)
    row = pack_gate_up(w, w[::-1].copy(), layout.dtype.label, one.tile) if gate_up else pack(
        w, layout.dtype.label, one.tile)
    n = max(1, -(-nbytes // row.nbytes))
    buf = aligned_empty(n * row.nbytes)
    buf.reshape(n, row.nbytes)[:] = np.asarray(row, np.uint8).reshape(1, -1)
    return buf, TileLayout(layout.dtype, layout.tr * n, layout.cols, one.tile)


def measure(layout, gate_up: bool = False, cands: list[dict] | None = None, target=None, rounds: int = 5,
            nbytes: int | None = None, check: bool = True) -> list[dict]:
    """Time each candidate on the same weights, interleaved round by round (one thread).

    Returns [{"knobs", "gbps" (median), "samples"}] in candidate order. check: every candidate's output
    must be bit-identical to the first's (the knobs are schedule-only).
    """
    from .library import Library
    from .target import host_target

    target = target if target is not None else host_target()
    isa = K._check_isa(target.isa)
    cands = cands if cands is not None else candidates(layout, isa)
    w, big = _weights(layout, gate_up, nbytes or MIN_BYTES)
    mod = ir.Module(name="cflow_tune")
    K.emit_quantize_act(mod, "quantize_act", big.cols, big.cols_p)
    for i, c in enumerate(cands):
        K.emit_matvec(mod, f"mv{i}", big, isa, gate_up=gate_up, **c)
    lib = Library(name="cflow_tune", target=target, cache=None)
    lib.add_ir(mod)
    lib.finalize()
    vp = ctypes.c_void_p
    quant = lib.get_cfunc("quantize_act", None, vp, vp, vp, vp)
    fns = [lib.get_cfunc(f"mv{i}", None, vp, vp, vp, vp, vp, vp, ctypes.c_int64, ctypes.c_int64)
           for i in range(len(cands))]
    act = K.Activation(big.cols, big.cols_p)
    act.x[: big.cols] = np.random.default_rng(1).standard_normal(big.cols).astype(np.float32)
    quant(K._p(act.x), K._p(act.xq), K._p(act.xd), K._p(act.xs))
    ys = [np.zeros(big.rows_p, np.float32) for _ in cands]
    args = [K._p(a) for a in (act.x, act.xq, act.xd, act.xs)]

    def call(i):
        fns[i](K._p(w), *args, K._p(ys[i]), 0, big.n_tile_rows)

    for i in range(len(cands)):  # warm-up (page faults, code) and the bit-identity check
        call(i)
    if check:
        for i in range(1, len(cands)):
            if not np.array_equal(ys[0], ys[i]):
                raise CflowError(f"tuning: candidate {label(cands[i])} changes the mat-vec's numbers "
                                 f"(kernel {kernel_key(layout, gate_up)})")
    streamed = big.nbytes * (2 if gate_up else 1)
    samples: list[list[float]] = [[] for _ in cands]
    for r in range(rounds):
        order = range(len(cands)) if r % 2 == 0 else reversed(range(len(cands)))  # no position favoured
        for i in order:
            t0 = time.perf_counter()
            call(i)
            samples[i].append(streamed / (time.perf_counter() - t0) / 1e9)
    return [{"knobs": c, "gbps": float(np.median(s)), "samples": [round(x, 3) for x in s]}
            for c, s in zip(cands, samples)]


def choose(results: list[dict]) -> dict:
    """The default (results[0]) unless a candidate's median beats it by more than MARGIN; the fastest wins,
    ties go to the earlier candidate."""
    best = results[0]
    for r in results[1:]:
        if r["gbps"] > best["gbps"] * (1 + MARGIN if best is results[0] else 1):
            best = r
    return best["knobs"]


def tune_kernel(layout, gate_up: bool, target, rounds: int = 5, nbytes: int | None = None) -> dict:
    """Measure and return the record stored in the table for one kernel shape."""
    from .target import cpu_model

    res = measure(layout, gate_up, target=target, rounds=rounds, nbytes=nbytes)
    return {"choice": choose(res), "cpu": cpu_model(), "isa": target.isa, "rounds": rounds,
            "results": [{"variant": label(r["knobs"]), "knobs": r["knobs"], "gbps": round(r["gbps"], 3)}
                        for r in res]}


def kernel_shapes(tensors) -> dict[str, tuple]:
    """{kernel key: (layout, gate_up)} of every tiled stream a step reads with the mat-vec kernel."""
    from ..layout.packed import Form

    out = {}
    for t in tensors:
        if t.form.is_tiled:
            gu = t.form == Form.GATE_UP
            out.setdefault(kernel_key(t.layout, gu), (t.layout, gu))
    return dict(sorted(out.items()))


def choices(tensors, target, search: bool = True, force: bool = False, rounds: int = 5,
            nbytes: int | None = None, on_result=None, ignore_env: bool = False) -> dict[str, dict]:
    """{kernel key: knobs} for a model's kernels on this host: cached choices, a search for the missing
    ones (search=True), {} when CFLOW_TUNE=off (the defaults) unless ignore_env (`cflow tune`).
    on_result(key, record) sees each record."""
    if not (enabled() or force or ignore_env):
        return {}
    table = read_table(target)
    out, changed = {}, False
    for key, (layout, gate_up) in kernel_shapes(tensors).items():
        rec = table.get(key)
        c = _valid_choice(rec.get("choice")) if isinstance(rec, dict) else None
        if (c is None or force) and (search or force):
            rec = tune_kernel(layout, gate_up, target, rounds=rounds, nbytes=nbytes)
            table[key], changed, c = rec, True, rec["choice"]
        if c is not None:
            if on_result is not None:
                on_result(key, rec)
            if c != DEFAULT:
                out[key] = c
    if changed:
        _write_table(target, table)
    return out
