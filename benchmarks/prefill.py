"""Prompts and batches through the multi-token kernels: prompt tok/s and batched decode, against the limits.

    python -m benchmarks.prefill --quick                       # < 5 minutes
    python -m benchmarks.prefill --json

TinyLlama-1.1B geometry (benchmarks/common/models.py's random weights; --models tinyllama,moe adds the MoE
geometry), Q4 and Q8 (Q4 only with --quick), 1 and 2 threads. In one run: the machine's int8 dot-product
peak on the ISA path in use (independent chains of the kernels' integer dot on registers: vpdpbusd at 512 or 256
bits, or AVX2's vpmaddubsw/vpmaddwd; llvmlite) and read bandwidth per thread
count; prompt tok/s for prompt lengths 128, 512 and 2048 (the model's context permitting) with cflow's
prefill (blocks of --block tokens) and token by token (the old path), and llama.cpp on bit-identical
GGUF weights (Q4_0 / Q8_0) when llama-cpp-python is installed (n_batch 512, its default). Both engines
get the same warm-up (an 8-token prompt after loading) and the best of --reps timed runs.

Batched decode: aggregate tok/s of batch_step for B = 1, 2, 4, 8, 16, as a ratio to single-stream decode
(Session.step, the decode body, loaded with the defaults) and as a fraction of the bound that binds:
the bytes one step reads at the read bandwidth (for MoE the dense weights plus the union of the experts
the B tokens choose; expected union under uniform routing, E * (1 - (1 - k/E)^B) per layer), or the
int8 peak. --rss runs a prompt of that length in a child process and reports its peak RSS against the
KV cache plus one block's buffers (Session.memory_parts), the weights being file-backed (mmapped).

Every record (the schema of benchmarks/common/record.py): its variant says what tok_s counts ("prompt 512",
"prompt 128, token by token", "decode step", "batch 8"); extra holds prompt_tokens, batch, the int8 peak and the
fractions it was judged against. The run's extra: "machine", the per-thread-count peak and bandwidth; "rss",
the memory measurement; "profiles".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

import cflow
from benchmarks.common import OUT
from benchmarks.common.bandwidth import read_gbs
from benchmarks.common.memory import proc_status
from benchmarks.common.models import MODELS, compiled_model
from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument
from cflow.codegen.target import cpu_model, isa_path


def int8_peak(threads: int, seconds: float = 0.5) -> float:
    """int8 multiply-adds per second x 2 (GOP/s) of independent integer-dot chains on the ISA path in use, summed
    over threads: the instruction the kernels use for the u8 x s8 dot, 12 chains on registers: vpdpbusd on 512-bit
    vectors (avx512vnni: 64 multiply-adds each) or 256-bit ones (avxvnni: 32), AVX2's vpmaddubsw + vpmaddwd + vpaddd
    (32 per three instructions), NaN on the generic path (no integer dot instruction)."""
    import threading

    from llvmlite import ir

    from cflow.codegen import kernels as K
    from cflow.codegen.cgutils import V, c64, i8, i32, i64
    from cflow.codegen.library import Library
    from cflow.codegen.target import ISA, host_target

    t = host_target()
    isa = ISA.parse(t.isa)
    if isa == ISA.GENERIC:
        return float("nan")
    lanes = 16 if isa == ISA.AVX512VNNI else 8  # i32 lanes per accumulator
    m = ir.Module("peak")
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [ir.PointerType(i32), i64]), "peak")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    out, n = fn.args
    a = ir.Constant(V(i8, 4 * lanes), [3] * 4 * lanes)
    w = ir.Constant(V(i8, 4 * lanes), [5] * 4 * lanes)
    zero = ir.Constant(V(i32, lanes), [0] * lanes)
    if isa.vnni:  # the kernels' vpdpbusd at the path's width
        def step(acc):
            return K._vpdpbusd(b, acc, w, a)
    else:  # the accumulator's bytes as the u8 operand: a dependency LLVM cannot hoist or fold (it folds constants)
        def step(acc):
            return b.add(acc, K._avx2_madd(b, K._avx2_dot(b, b.bitcast(acc, V(i8, 32)), a)))
    head, body, end = (fn.append_basic_block(x) for x in ("head", "body", "end"))
    pre = b.block
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(i64)
    accs = [b.phi(V(i32, lanes)) for _ in range(12)]  # 12 chains hide the latency
    for acc in accs:
        acc.add_incoming(zero, pre)
    i.add_incoming(c64(0), pre)
    b.cbranch(b.icmp_signed("<", i, n), body, end)
    b.position_at_end(body)
    new = [step(acc) for acc in accs]
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
        rates.append(done * 12 * 4 * lanes * 2 / (time.perf_counter() - t0) / 1e9)

    ts = [threading.Thread(target=run, args=(k * 16,)) for k in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return sum(rates)


WARM = 8  # warm-up prompt tokens after loading, for both engines (the JIT / first-touch of the pages)


def prompt_ids(n: int, vocab: int = 30000) -> list[int]:
    """n token ids drawn from [10, min(vocab, 30000)) (the same ids for every geometry of a vocabulary that large)."""
    return [int(x) for x in np.random.default_rng(n).integers(min(10, vocab - 1), min(vocab, 30000), n)]


def cflow_prompt(path, threads: int, n: int, block: int, reps: int) -> float:
    """A prompt's tok/s, the best of `reps`, its ids inside the file's vocabulary (benchmarks.batch_files' files)."""
    best = 0.0
    with cflow.load(path, threads=threads, prefill_block=block, max_seq=max(n, 16)) as m:
        s = m.session
        ids = prompt_ids(n, s.config.vocab_size)
        s.reset()
        s.prefill(ids[:WARM])
        for _ in range(reps):
            s.reset()
            t0 = time.perf_counter()
            s.prefill(ids)
            best = max(best, n / (time.perf_counter() - t0))
    return best


def llama_prompt(gguf: str, threads: int, n: int, reps: int) -> float:
    """llama.cpp's prompt tok/s; its AMX buffers off where the CPU has AMX (they crash the process there:
    common.peers.llama_open)."""
    from benchmarks.common.peers import llama_open
    from cflow.codegen.target import _cpuinfo

    amx = "amx_tile" in _cpuinfo().get("flags", "").split()
    llm = llama_open(gguf, threads, extra_bufts=not amx, n_ctx=max(n, 64), n_batch=512)
    ids = prompt_ids(n)
    llm.reset()
    llm.eval(ids[:WARM])  # the same warm-up cflow gets
    best = 0.0
    for _ in range(reps):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        best = max(best, n / (time.perf_counter() - t0))
    del llm
    return best


def cflow_single(path, threads: int, steps: int, reps: int) -> float:
    """Single-stream decode tok/s: Session.step (the decode body), loaded the normal way (max_batch 1)."""
    with cflow.load(path, threads=threads) as m:
        s = m.session
        s.reset()
        tok = int(np.argmax(s.prefill([1, 2, 3])))
        for _ in range(2):
            tok = int(np.argmax(s.step(tok)))
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                tok = int(np.argmax(s.step(tok)))
            best = max(best, steps / (time.perf_counter() - t0))
    return best


def cflow_batch(path, threads: int, batch: int, steps: int, reps: int) -> float:
    with cflow.load(path, threads=threads, max_batch=batch, prefill_block=max(batch, 8)) as m:
        slots = list(range(batch))
        toks = [int(np.argmax(m.batch_start([1 + i, 2, 3], i))) for i in slots]
        out = m.batch_step(toks, slots)  # warm-up
        best = 0.0
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(steps):
                out = m.batch_step([int(np.argmax(r)) for r in out], slots)
            best = max(best, batch * steps / (time.perf_counter() - t0))
    return best


def weight_bytes(path) -> tuple[int, int, int, int]:
    """(bytes the decode step reads per token, of which expert bytes, n_experts, top_k) from the file."""
    with cflow.load(path, threads=1) as m:
        c = m.session.config
        experts = sum(t.nbytes for t in m.session.compiled.tensors.values() if t.expert >= 0)
        return m.bytes_per_token, experts, c.n_experts, c.top_k


def step_bytes(bpt: int, experts: int, n_experts: int, top_k: int, batch: int) -> float:
    """Weight bytes one batched step of `batch` tokens reads: the dense part once, each layer's experts in the
    expected union of the tokens' choices (uniform routing: E * (1 - (1 - k/E)^B) distinct experts)."""
    if not n_experts:
        return float(bpt)
    dense = bpt - experts * top_k / n_experts
    return dense + experts * (1 - (1 - top_k / n_experts) ** batch)


def _stage_kind(st) -> str:
    kinds = sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st if x.nbytes})
    return " + ".join(kinds) or "no weights: " + ",".join(sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st}))


def _stage_dtypes(session, st) -> str:
    """' q4_k' / ' q4_k,q6_k': the types of a stage's weight matrices (a decode profile's kinds are split by them)."""
    types = set()
    for x in st:
        for name in x.tensors:
            try:
                e = session.reader.entry(name)
            except KeyError:
                continue
            if len(e.shape) > 1:
                types.add(e.dtype.label)
    return " " + ",".join(sorted(types)) if types else ""


def profile_stages(path: str, threads: int, n: int, block: int, batch: int = 0, decode: bool = False) -> dict:
    """Where the time goes in the multi-token body: per-stage cycle stamps of a profiling build (worker 0 stamps
    after each stage's barrier), summed over the native calls and scaled to their wall time. batch = 0: an
    n-token prompt in blocks of `block` (per-block times too, to show the growth with position); batch = B:
    n steps of B sequences (batch_step); decode: n single-token steps after a 4-token prompt (the decode step;
    kinds split by the types of their weight matrices, each kind's weight bytes a token over its time too:
    `gbps`)."""
    from cflow.runtime.session import Session

    s = Session(path, threads=threads, profile=True, prefill_block=max(batch, 8) if batch else block,
                max_batch=max(batch, 1),
                max_seq=max(n + 16, 16))
    stages = s.run_state.schedule.stages
    # each stage's kind (split by weight type in a decode profile: the file's tensor table, read before close)
    kinds = [_stage_kind(st) + (_stage_dtypes(s, st) if decode else "") for st in stages]
    ticks = np.zeros(len(stages))
    wall, per_call = 0.0, []
    if batch:
        for i in range(batch):
            s.prefill([1 + i, 2, 3], slot=i)
        toks, slots = [5] * batch, list(range(batch))
        calls = [lambda: s.step_batch(toks, slots)] * n
    elif decode:
        ids = [t % s.config.vocab_size for t in prompt_ids(n + 8)]
        s.prefill(ids[:4])
        for t in ids[4:8]:  # warm-up: the code and the caches (not counted)
            s.step(t)
        calls = [lambda t=t: s.step(t) for t in ids[8:]]
    else:
        ids = prompt_ids(n)
        calls = [lambda c=ids[i : i + block]: s.prefill(c) for i in range(0, n, block)]
    if not decode:
        calls[0]()  # warm-up (not counted); for a prompt the first block runs again below
    if not batch and not decode:
        s.reset()
    for call in calls:
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        wall += dt
        per_call.append(dt)
        ticks += np.diff(s.prof[0])
    s.close()
    per_tick = wall / ticks.sum()
    groups: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    for k, st, t in zip(kinds, stages, ticks):
        groups[k] = groups.get(k, 0.0) + t * per_tick
        nbytes[k] = nbytes.get(k, 0) + sum(x.nbytes for x in st)
    toks_done = n * batch if batch else n
    out = {"threads": threads, "prompt_tokens": 0 if batch or decode else n, "batch": batch or 1, "block": block,
           "decode": decode, "wall_s": wall, "tok_s": toks_done / wall,
           "stages_ms_per_token": {k: 1e3 * v / toks_done for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
           "share": {k: v / wall for k, v in groups.items()},
           "ms_per_call": [1e3 * x for x in per_call]}
    if decode:  # every step reads each stage's weights once
        out["gbps"] = {k: nbytes[k] * n / v / 1e9 for k, v in groups.items() if nbytes[k] and v > 0}
    return out


def print_profile(p: dict, label: str) -> None:
    print(f"   profile, {label} ({p['threads']} threads, {p['tok_s']:.1f} tok/s):", flush=True)
    gbps = p.get("gbps", {})
    for k, v in p["stages_ms_per_token"].items():
        print(f"      {k:<44} {v:8.3f} ms/token {p['share'][k]:6.1%}"
              + (f" {gbps[k]:6.2f} GB/s" if k in gbps else ""))
    if p["batch"] == 1 and not p.get("decode") and len(p["ms_per_call"]) > 1:
        c = p["ms_per_call"]
        print(f"      per block of {p['block']}: first {c[0]:.0f} ms, last {c[-1]:.0f} ms", flush=True)


def rss_child(path: str, threads: int, n: int, block: int) -> None:
    """In its own process: load, feed an n-token prompt, print one JSON line with the memory figures."""
    def status():
        return proc_status("VmHWM", "VmRSS", "RssAnon", "RssFile")

    before = status()
    with cflow.load(path, threads=threads, prefill_block=block, max_seq=n) as m:
        loaded = status()
        m.session.prefill(prompt_ids(n))
        after = status()
        parts = m.session.memory_parts()
    print(json.dumps({"prompt_tokens": n, "threads": threads, "block": block, "before_load": before,
                      "after_load": loaded, "after_prompt": after, "memory_parts": parts}))


def measure_rss(path: str, threads: int, n: int, block: int) -> dict:
    import subprocess

    out = subprocess.run(module_command("benchmarks.prefill", "--rss-child", path, threads, n, block), check=True,
                         capture_output=True, text=True, env=child_env()).stdout
    r = json.loads(out.strip().splitlines()[-1])
    parts = r["memory_parts"]
    kv = next(v for k, v in parts.items() if k.startswith("the KV cache"))
    block_bufs = sum(v for k, v in parts.items() if not k.startswith("the KV cache"))
    a, b, p = r["before_load"], r["after_load"], r["after_prompt"]
    r.update({"kv_cache_bytes": kv, "block_buffers_bytes": block_bufs,
              "anon_growth_bytes": p["RssAnon"] - a["RssAnon"],  # what loading + the prompt allocated
              "prompt_anon_growth_bytes": p["RssAnon"] - b["RssAnon"],  # what the prompt itself added
              "peak_rss_bytes": p["VmHWM"], "file_backed_bytes": p["RssFile"]})
    r["within_target"] = r["anon_growth_bytes"] <= kv + block_bufs
    return r


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tinyllama", help=f"geometries, of {','.join(MODELS)} (default tinyllama)")
    ap.add_argument("--quants", default="q4,q8", help="weight types (default q4,q8)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--lengths", default="128,512,2048", help="prompt lengths (default 128,512,2048)")
    ap.add_argument("--batches", default="1,2,4,8,16", help="batched-decode sizes (default 1,2,4,8,16); '' skips")
    ap.add_argument("--block", type=int, default=64, help="prompt tokens per native call (default 64)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions, best kept (default 2)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed batched repetition (default 16)")
    ap.add_argument("--rss", type=int, default=2048, help="prompt length of the peak-RSS child (0: skip)")
    ap.add_argument("--profile", type=int, default=0,
                    help="also profile the stages of an N-token prompt and of N steps of the largest batch")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if installed")
    ap.add_argument("--quick", action="store_true",
                    help="Q4, lengths 128 and 512, batches 1,4,8, one rep, RSS at 512 (< 5 minutes)")
    add_json_argument(ap, "write one record per engine, model, weight type, thread count and prompt or batch")
    args = ap.parse_args(argv)
    run = Run("prefill", argv)
    if args.quick:
        args.quants, args.lengths, args.batches, args.reps, args.steps = "q4", "128,512", "1,4,8", 1, 8
        args.rss = min(args.rss, 512)
    t_start = time.perf_counter()
    cpu = cpu_model()
    try:
        import llama_cpp

        have_llama = not args.no_llama
        llama_version = llama_cpp.__version__
    except ImportError:
        have_llama, llama_version = False, None
    isa = isa_path()
    print(f"# {cpu}, ISA path {isa}; prefill blocks of {args.block}; llama.cpp "
          f"{llama_version if have_llama else 'not used (pip install llama-cpp-python)'}", flush=True)
    threads_list = [int(t) for t in args.threads.split(",")]
    machine = {}
    for threads in threads_list:
        machine[threads] = {"int8_peak_gops": int8_peak(threads), "read_gbs": read_gbs(threads)}
        print(f"# {threads} thread(s): int8 peak {machine[threads]['int8_peak_gops']:.0f} GOP/s (the path's dot), "
              f"read bandwidth {machine[threads]['read_gbs']:.1f} GB/s", flush=True)
    records, rss, profiles = [], [], []
    for model in args.models.split(","):
        geom = MODELS[model]
        for quant in args.quants.split(","):
            path, c = compiled_model(model, quant)
            gguf = None
            if have_llama and quant in ("q4", "q8"):
                from benchmarks.common.peers import gguf_file  # the exporter writes bit-identical Q4_0 / Q8_0

                try:
                    gguf = gguf_file(model, c, quant=quant)
                except cflow.CflowError as e:  # e.g. a geometry the exporter cannot write
                    print(f"# no GGUF for {model} {quant}: {e}", flush=True)
            del c
            bpt, experts, n_exp, top_k = weight_bytes(path)
            params = bpt / (0.5625 if quant == "q4" else 1.0625)  # active weights per token
            ops = 2 * params  # int8 ops per token (a multiply-add = 2)
            for threads in threads_list:
                peak, read = machine[threads]["int8_peak_gops"], machine[threads]["read_gbs"]
                print(f"## {model} {quant}, {threads} thread(s): {bpt / 1e6:.0f} MB read per token", flush=True)
                for n in (int(x) for x in args.lengths.split(",") if x):
                    if n > geom.max_seq_len:
                        print(f"   prompt {n}: skipped (context {geom.max_seq_len})")
                        continue
                    row = dict(model=geom.name, quant=quant, threads=threads, bytes_per_token=bpt, read_gbs=read,
                               prompt_tokens=n, batch=1, int8_peak_gops=peak)
                    pre = cflow_prompt(path, threads, n, args.block, args.reps)
                    one = cflow_prompt(path, threads, min(n, 128), 1, 1)  # token by token (128 tokens is enough)
                    frac = pre * ops / 1e9 / peak
                    records += [run.record(engine="cflow", variant=f"prompt {n}", tok_s=pre, frac_int8_peak=frac,
                                           **row),
                                run.record(engine="cflow", variant=f"prompt {n}, token by token", tok_s=one,
                                           frac_int8_peak=one * ops / 1e9 / peak, **row)]
                    line = (f"   prompt {n:5d}: cflow {pre:7.1f} tok/s ({frac:5.1%} of int8 peak), "
                            f"token by token {one:6.1f}")
                    if gguf:
                        lp = llama_prompt(gguf, threads, n, args.reps)
                        records.append(run.record(engine="llama.cpp", variant=f"prompt {n}", tok_s=lp,
                                                  frac_int8_peak=lp * ops / 1e9 / peak, cflow_over_llama=pre / lp,
                                                  **row))
                        line += f", llama.cpp {lp:6.1f} (cflow {pre / lp:.2f}x)"
                    print(line, flush=True)
                batches = [int(x) for x in args.batches.split(",") if x]
                if batches:
                    single = cflow_single(path, threads, args.steps * 2, args.reps)
                    records.append(run.record(engine="cflow", model=geom.name, quant=quant, threads=threads,
                                              variant="decode step", tok_s=single, bytes_per_token=bpt,
                                              read_gbs=read, prompt_tokens=0, batch=1, int8_peak_gops=peak,
                                              bandwidth_bound_tok_s=read * 1e9 / bpt))
                    print(f"   single-stream decode (Session.step): {single:7.1f} tok/s "
                          f"({single * bpt / 1e9 / read:5.1%} of the read bandwidth)", flush=True)
                for bsz in batches:
                    agg = cflow_batch(path, threads, bsz, args.steps, args.reps)
                    nbytes = step_bytes(bpt, experts, n_exp, top_k, bsz)
                    mem = read * 1e9 / nbytes * bsz  # tok/s if the step is bound by reading its weights
                    comp = peak * 1e9 / ops  # tok/s if bound by the int8 peak
                    bound = min(mem, comp)
                    records.append(run.record(engine="cflow", model=geom.name, quant=quant, threads=threads,
                                              variant=f"batch {bsz}", tok_s=agg, bytes_per_token=bpt,
                                              read_gbs=read, prompt_tokens=0, batch=bsz, int8_peak_gops=peak,
                                              step_weight_bytes=nbytes, bandwidth_bound_tok_s=mem,
                                              compute_bound_tok_s=comp,
                                              binds="bandwidth" if mem <= comp else "compute",
                                              frac_bound=agg / bound, x_single_stream=agg / single))
                    print(f"   batch {bsz:3d}: {agg:7.1f} tok/s aggregate ({agg / single:4.2f}x single stream), "
                          f"{agg / bound:5.1%} of the {'bandwidth' if mem <= comp else 'compute'} limit "
                          f"({bound:.0f} tok/s; {nbytes / 1e6:.0f} MB read per step)", flush=True)
                if args.profile and threads == threads_list[-1]:
                    for bsz in [0] + batches[-1:]:
                        p = profile_stages(path, threads, args.profile if not bsz else 16, args.block, bsz)
                        p.update({"geometry": model, "quant": quant})
                        profiles.append(p)
                        print_profile(p, f"batch of {bsz}" if bsz else f"{args.profile}-token prompt")
                if args.rss and args.rss <= geom.max_seq_len and threads == threads_list[-1]:
                    r = measure_rss(path, threads, args.rss, args.block)
                    r.update({"geometry": model, "quant": quant})
                    rss.append(r)
                    print(f"   RSS, {args.rss}-token prompt in its own process: peak {r['peak_rss_bytes'] / 2**20:.0f} "
                          f"MiB ({r['file_backed_bytes'] / 2**20:.0f} MiB file-backed weights); anonymous memory grew "
                          f"{r['anon_growth_bytes'] / 2**20:.0f} MiB (the prompt itself: "
                          f"{r['prompt_anon_growth_bytes'] / 2**20:.1f} MiB) vs KV cache "
                          f"{r['kv_cache_bytes'] / 2**20:.0f} MiB + one block's buffers "
                          f"{r['block_buffers_bytes'] / 2**20:.0f} MiB: "
                          f"{'within' if r['within_target'] else 'ABOVE'} the target", flush=True)
    seconds = time.perf_counter() - t_start
    print(f"# {seconds:.0f} s", flush=True)
    run.write(args.json, records, {"llama_cpp": llama_version if have_llama else None, "seconds": seconds,
                                   "machine": {str(k): v for k, v in machine.items()}, "rss": rss,
                                   "profiles": profiles})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rss-child"]:
        rss_child(sys.argv[2], *(int(x) for x in sys.argv[3:6]))
    else:
        os.makedirs(OUT, exist_ok=True)
        main()
