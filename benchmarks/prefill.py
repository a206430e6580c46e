"""Prompts and batches through the multi-token kernels: prompt tok/s and batched decode, against the limits.

    python benchmarks/prefill.py --quick                       # < 5 minutes
    python benchmarks/prefill.py --json docs/results/prefill.json

TinyLlama-1.1B geometry (benchmarks/decode.py's random weights), Q4 and Q8 (Q4 only with --quick), 1 and 2
threads. In one run: the machine's int8 dot-product peak (a VNNI loop of independent vpdpbusd chains on
registers, llvmlite); prompt tok/s for prompt lengths 128, 512 and 2048 (the model's context permitting)
with cflow's prefill (blocks of --block tokens) and token by token (the old path), and llama.cpp on
bit-identical GGUF weights when llama-cpp-python is installed (n_batch 512, its default); batched decode
aggregate tok/s for B = 1, 2, 4, 8, 16 and its fraction of the bound that binds (weights read once per
step at the read bandwidth, or the int8 peak). Every record: engine, geometry, quant, threads,
prompt_tokens, batch, tok_s.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bandwidth import measure_read_bandwidth  # noqa: E402
from decode import MODELS, OUT, compiled_model  # noqa: E402

import cflow  # noqa: E402


def int8_peak(threads: int, seconds: float = 0.5) -> float:
    """int8 multiply-adds per second x 2 (GOP/s) of independent vpdpbusd chains, summed over threads."""
    import threading

    from llvmlite import ir

    from cflow.codegen.cgutils import V, c64, i8, i32, i64, intrinsic
    from cflow.codegen.library import Library
    from cflow.codegen.target import host_target

    t = host_target()
    if not t.has_avx512_vnni:
        return float("nan")
    m = ir.Module("peak")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ir.PointerType(i32), i64]), "peak")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    out, n = fn.args
    vd = intrinsic(m, "llvm.x86.avx512.vpdpbusd.512", V(i32, 16), [V(i32, 16), V(i8, 64), V(i8, 64)])
    a = ir.Constant(V(i8, 64), [3] * 64)
    w = ir.Constant(V(i8, 64), [5] * 64)
    zero = ir.Constant(V(i32, 16), [0] * 16)
    head, body, end = (fn.append_basic_block(x) for x in ("head", "body", "end"))
    pre = b.block
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64)
    accs = [b.phi(V(i32, 16)) for _ in range(12)]  # 12 chains hide the latency
    for acc in accs:
        acc.add_incoming(zero, pre)
    i.add_incoming(c64(0), pre)
    b.cbranch(b.icmp_signed("<", i, n), body, end)
    b.position_at_end(body)
    new = [b.call(vd, [acc, w, a]) for acc in accs]
    for acc, v in zip(accs, new):
        acc.add_incoming(v, body)
    i.add_incoming(b.add(i, c64(1)), body)
    b.branch(head)
    b.position_at_end(end)
    tot = accs[0]
    for acc in accs[1:]:
        tot = b.add(tot, acc)
    b.store(b.extract_element(tot, ir.Constant(i32, 0)), out)
    b.ret_void()
    lib = Library(name="peak", target=t, cache=False)
    lib.add_ir(m)
    lib.finalize()
    f = lib.get_cfunc("peak", None, ctypes.c_void_p, ctypes.c_int64)
    iters = 2_000_000
    sink = np.zeros(64, np.int32)
    f(ctypes.c_void_p(sink.ctypes.data), 1000)
    rates = []

    def run(k):
        t0 = time.perf_counter()
        done = 0
        while time.perf_counter() - t0 < seconds:
            f(ctypes.c_void_p(sink[k:].ctypes.data), iters)
            done += iters
        rates.append(done * 12 * 64 * 2 / (time.perf_counter() - t0) / 1e9)

    ts = [threading.Thread(target=run, args=(k * 16,)) for k in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return sum(rates)


def cflow_prompt(path, threads: int, n: int, block: int, reps: int) -> float:
    ids = [int(x) for x in np.random.default_rng(n).integers(10, 30000, n)]
    best = 0.0
    with cflow.load(path, threads=threads, prefill_block=block, max_seq=max(n, 16)) as m:
        s = m.session
        s.reset()
        s.prefill(ids[: min(8, n)])  # warm up (the JIT and the pages)
        for _ in range(reps):
            s.reset()
            t0 = time.perf_counter()
            s.prefill(ids)
            best = max(best, n / (time.perf_counter() - t0))
    return best


def llama_prompt(gguf: str, threads: int, n: int, reps: int) -> float:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=max(n, 64), n_batch=512,
                logits_all=False, verbose=False)
    ids = [int(x) for x in np.random.default_rng(n).integers(10, 30000, n)]
    best = 0.0
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        best = max(best, n / (time.perf_counter() - t0))
    return best


def cflow_batch(path, threads: int, batch: int, steps: int) -> float:
    with cflow.load(path, threads=threads, max_batch=batch, prefill_block=max(batch, 8)) as m:
        s = m.session
        toks = []
        for i in range(batch):
            toks.append(int(np.argmax(s.prefill([1 + i, 2, 3], slot=i))))
        slots = list(range(batch))
        out = s.step_batch(toks, slots)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = s.step_batch([int(np.argmax(r)) for r in out], slots)
        return batch * steps / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tinyllama", choices=list(MODELS))
    ap.add_argument("--quants", default="q4,q8", help="weight types (default q4,q8)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--lengths", default="128,512,2048", help="prompt lengths (default 128,512,2048)")
    ap.add_argument("--batches", default="1,2,4,8,16", help="batched-decode sizes (default 1,2,4,8,16)")
    ap.add_argument("--block", type=int, default=64, help="prompt tokens per native call (default 64)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions, best kept (default 2)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if installed")
    ap.add_argument("--quick", action="store_true", help="Q4, lengths 128 and 512, batches 1,4,8 (< 5 minutes)")
    ap.add_argument("--json", help="write the records to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.quants, args.lengths, args.batches, args.reps = "q4", "128,512", "1,4,8", 1
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    try:
        import llama_cpp  # noqa: F401

        have_llama = not args.no_llama
    except ImportError:
        have_llama = False
    geom = MODELS[args.model]
    print(f"# {cpu}; {args.model} geometry; prefill blocks of {args.block}; llama.cpp "
          f"{'yes' if have_llama else 'not installed (pip install llama-cpp-python)'}", flush=True)
    records = []
    for quant in args.quants.split(","):
        path, c = compiled_model(args.model, quant)
        gguf = None
        if have_llama and quant in ("q4", "q8"):
            from peers import gguf_file  # the exporter writes bit-identical Q4_0 / Q8_0

            gguf = gguf_file(args.model, c) if quant == "q4" else None
        bpt = cflow.load(path, threads=1).bytes_per_token
        params = 2 * bpt / (0.5625 if quant == "q4" else 1.0625)  # ops per token ~ 2 x weights
        for threads in (int(t) for t in args.threads.split(",")):
            peak = int8_peak(threads)
            read = measure_read_bandwidth(threads)
            print(f"## {quant}, {threads} thread(s): int8 peak {peak:.0f} GOP/s, read bandwidth {read:.1f} GB/s",
                  flush=True)
            for n in (int(x) for x in args.lengths.split(",")):
                if n > geom.max_seq_len:
                    print(f"   prompt {n}: skipped (context {geom.max_seq_len})")
                    continue
                row = {"geometry": args.model, "quant": quant, "threads": threads, "prompt_tokens": n, "batch": 1}
                pre = cflow_prompt(path, threads, n, args.block, args.reps)
                one = cflow_prompt(path, threads, min(n, 128), 1, 1)  # token by token (128 tokens is enough)
                records += [{**row, "engine": "cflow", "tok_s": pre},
                            {**row, "engine": "cflow-token-by-token", "tok_s": one}]
                line = (f"   prompt {n:5d}: cflow {pre:7.1f} tok/s ({pre * params / 1e9 / peak:5.1%} of int8 peak), "
                        f"token by token {one:6.1f}")
                if gguf:
                    lp = llama_prompt(gguf, threads, n, args.reps)
                    records.append({**row, "engine": "llama.cpp", "tok_s": lp})
                    line += f", llama.cpp {lp:6.1f} ({pre / lp:.2f}x)"
                print(line, flush=True)
            base = None
            for bsz in (int(x) for x in args.batches.split(",")):
                agg = cflow_batch(path, threads, bsz, 8 if args.quick else 16)
                base = base or agg
                bound = min(read * 1e9 / bpt * bsz, peak * 1e9 / params)  # tok/s: memory or compute
                records.append({"engine": "cflow", "geometry": args.model, "quant": quant, "threads": threads,
                                "prompt_tokens": 0, "batch": bsz, "tok_s": agg})
                print(f"   batch {bsz:3d}: {agg:7.1f} tok/s aggregate ({agg / base:4.2f}x B=1), "
                      f"{agg / bound:5.1%} of the binding limit ({bound:.0f} tok/s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "records": records}, f, indent=1)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    main()
