"""The multi-token (mat-mat) kernel in cache: multiply-adds per second of one weight matrix that stays in L2 times
`--tokens` activations, per ISA path and block type, for kernel variants side by side (token group, row groups per
pass). What it isolates: the kernel's instruction stream, not the memory system (prompts and batches are bound by
it: docs/performance.md "Prompts and batches").

    python -m benchmarks.matmat [--isa avx2,avxvnni,avx512vnni] [--dtypes q4,q8,q4_k] [--tokens 8]
        [--variants 'one:max_groups=0;g16:max_groups=16'] [--rounds 15] [--json [FILE]]

Timing is the calling thread's CPU time (time.thread_time), rounds of every variant interleaved, medians: the
machines are shared, and a kernel in cache is slowed by other processes mainly through the CPU they take. A
variant is `name:knob=value,...` with emit_matmat's knobs (token_group, max_groups, unroll, prefetch);
max_groups=0 is one row group per pass (= token_group), the choice before MATMAT_GROUPS.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from llvmlite import ir

from benchmarks.common.record import Run, add_json_argument
from cflow.codegen import kernels as K
from cflow.codegen.library import Library
from cflow.codegen.target import FORCE_FEATURES, ISA, cpu_model, host_target
from cflow.layout import tile as T
from cflow.layout.blocks import FORMATS, random_blocks
from cflow.layout.quant import DType
from cflow.layout.tile import TileLayout

TILE = (128, 256)


def parse_variants(text: str) -> dict[str, dict]:
    out = {}
    for item in filter(None, text.split(";")):
        name, _, knobs = item.partition(":")
        kw = {}
        for kv in filter(None, knobs.split(",")):
            k, _, v = kv.partition("=")
            kw[k.strip()] = int(v)
        out[name.strip()] = kw
    return out


def weights(dtype: DType, rows: int, cols: int, rng) -> np.ndarray:
    """A packed tile stream of random weights (random block bytes, scales of order 1/sqrt(cols), for a block type)."""
    if dtype in FORMATS:
        return T.pack(random_blocks(dtype, rows, cols, rng, 1e-3, jitter=0.5), dtype, TILE)
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    return T.pack(w, dtype, TILE)


def measure(isa: str, dtype: DType, ntok: int, variants: dict[str, dict], rounds: int, rows: int = 256,
            cols: int = 2048) -> dict[str, list[float]]:
    """GMAC/s per round of each variant (one library, rounds interleaved)."""
    host = host_target(env=False)
    target = host.with_features(FORCE_FEATURES[ISA.parse(isa)]) if FORCE_FEATURES[ISA.parse(isa)] else host
    if target.isa != ISA.parse(isa):
        raise SystemExit(f"this CPU cannot run the {isa} path (its best: {host.isa})")
    rng = np.random.default_rng(0)
    qk = FORMATS[dtype].qk if dtype in FORMATS else 32
    cols = -(-cols // qk) * qk  # whole blocks (cflow's 192-input types: 2048 -> 2112)
    L = TileLayout(dtype, rows, cols, TILE)
    w = weights(dtype, rows, cols, rng)
    stride = L.cols_p
    mod = ir.Module("matmat")
    K.emit_quantize_act(mod, "q", cols, L.cols_p)
    for n, kw in variants.items():
        kw = dict(kw)
        if kw.get("max_groups") == 0:  # one row group per pass: as many accumulators as tokens in a group
            kw["max_groups"] = kw.get("token_group") or (8 if isa == ISA.AVX512VNNI else 4)
        K.emit_matmat(mod, f"mm_{n}", L, isa, stride, act_blocks=stride // 32, **kw)
    lib = Library(name="matmat", target=target, cache=False)
    lib.add_ir(mod)
    lib.finalize()
    vp, i64 = ctypes.c_void_p, ctypes.c_int64

    def p(a):
        return ctypes.c_void_p(a.ctypes.data)

    q = lib.get_cfunc("q", None, vp, vp, vp, vp)
    X = rng.standard_normal((ntok, stride)).astype(np.float32)
    XQ = np.zeros((ntok, stride), np.int8)
    XD = np.zeros((ntok, stride // 32), np.float32)
    XS = np.zeros((ntok, stride // 32), np.int32)
    for t in range(ntok):
        q(p(X[t]), p(XQ[t]), p(XD[t]), p(XS[t]))
    Y = np.zeros((ntok, L.rows_p), np.float32)
    args = (p(w), p(X), p(XQ), p(XD), p(XS), p(Y), 0, L.rows_p // TILE[0], ntok, stride, L.rows_p)
    fns = {n: lib.get_cfunc(f"mm_{n}", None, vp, vp, vp, vp, vp, vp, i64, i64, i64, i64, i64) for n in variants}

    def run(fn, reps: int) -> float:
        t0 = time.thread_time()
        for _ in range(reps):
            fn(*args)
        return rows * cols * ntok * reps / (time.thread_time() - t0) / 1e9

    reps = max(20, int(2e9 / (rows * cols * ntok) / 20))  # ~0.1 s a round at 20 GMAC/s
    for fn in fns.values():
        run(fn, reps // 4)
    out = {n: [] for n in variants}
    for _ in range(rounds):
        for n, fn in fns.items():
            out[n].append(run(fn, reps))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", default="avx2,avxvnni,avx512vnni", help="ISA paths (default avx2,avxvnni,avx512vnni)")
    ap.add_argument("--dtypes", default="q4,q8", help="weight types (default q4,q8; also q4_k, q6_k, ...)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per call (default 8)")
    ap.add_argument("--variants", default="one:max_groups=0;default:",
                    help="';'-separated name:knob=value,... (default 'one:max_groups=0;default:')")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    add_json_argument(ap)
    a = ap.parse_args(argv)
    variants = parse_variants(a.variants)
    run, records = Run("matmat", argv), []
    print(f"CPU: {cpu_model()}; {a.tokens} tokens, a 256x2048 matrix in cache, thread CPU time, median of "
          f"{a.rounds} rounds")
    base = next(iter(variants))
    for isa in a.isa.split(","):
        for dt in a.dtypes.split(","):
            res = measure(isa, DType.parse(dt) if dt in ("q4", "q8") else DType[dt.upper()], a.tokens, variants,
                          a.rounds)
            med = {n: float(np.median(r)) for n, r in res.items()}
            cells = ", ".join(f"{n} {m:.1f}" + (f" ({m / med[base]:.2f}x)" if n != base else "")
                              for n, m in med.items())
            print(f"{isa:>10} {dt:>5}: GMAC/s {cells}")
            records.append(run.record(quant=dt, isa_path=isa, threads=1, tokens=a.tokens, gmac_s=med, rounds=res))
    run.write(a.json, records)


if __name__ == "__main__":
    main()
