"""The model of issue 39: a Qwen3-30B-A3B-geometry MoE with deterministic random Q4 weights, streamed to a .vflow
(and to its GGUF twin for llama.cpp) without the model ever being in memory.

    python -m benchmarks.make_moe --geometry sibling-4g --out /work/models/bigmoe --gguf
    python -m benchmarks.make_moe --geometry qwen3-30b-a3b --out DIR [--gguf] [--pipeline]
    python -m benchmarks.make_moe --geometry tiny --out /tmp/moe --gguf --pipeline

Weights: cflow.models.synthetic.SyntheticWeights (seeded per tensor: every tensor a function of (seed, name); Q4
blocks drawn directly; attention N(0, 0.02) like the presets, experts at unit gain, the head 0.2; each token's
embedding points at the next id's head row, so the model counts, 250 -> 251, 252, ..., by a margin no engine's
rounding can flip, while attention and experts run on the whole context). The .vflow is compile_file of the graph
built on them (the compiler's own planning, packing and writer, fed one tensor at a time); the GGUF is export_gguf
of the same lowered graph (llama.cpp's qwen3moe arch, the experts stacked one expert at a time), so the two files
hold the same Q4_0 blocks bit for bit.

Geometries (GEOMETRIES):
  qwen3-30b-a3b  Qwen3-30B-A3B: 48 layers, d 2048, 32 query / 4 KV heads of 128 (per-head q/k norms), 128
                 experts of width 768, top-8, vocab 151,936, RoPE base 1e6: 30.5 B parameters (3.35 B active),
                 17.7 GB at Q4 (f16 embedding, as cflow stores it). max_seq_len 4096 (the real model's 40,960
                 would size a KV cache of 4 GB at f16 for nothing the benchmark uses).
  sibling-4g     the same with 10 layers: 4.3 GB (4.0 GiB). Only the layer count changes, so every layer is the
                 full model's (128 experts, top-8, the same widths): the routing sparsity, the bytes read per
                 layer and the compute per layer stay, and a 2 GB budget is to it what 8 GB is to the full model
                 (0.46 vs 0.45 of the file). Fewer experts instead would make a random top-8 cover a larger share
                 of them, which a cache of the same share would hit more often than the full model's.
  tiny           the same structure in miniature, for tests (1.8 MB).
--pipeline: the pipeline-native variant, dense delay 1 and expert delay 2 (the same weights: the delays change
which stream each op reads, not any tensor; Qwen3-MoE has no dense FFN, so only the expert delay acts). llama.cpp
computes delays (0, 0) only: no GGUF for it.

Measured: the write speed of each file (bytes / seconds, fsync included), against plain sequential writes of
the same number of bytes (64 MiB buffers, then fsync: what `dd bs=64M conv=fsync` does, buffered and with
O_DIRECT, `oflag=direct`) in the same directory, right before that file (removed at once: the disk's speed
drifts, so each file gets its own); with --cpu-rate
first the writer without the disk (generate, pack, checksum, nothing written); and the peak RSS of the process.
--probe writes nothing: it runs the reference interpreter on the weights generated on demand and prints the
activation scale per layer (minutes for the full model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.common.memory import peak_rss
from cflow.ir.config import ModelConfig

QWEN3_30B_A3B = ModelConfig(
    name="qwen3_30b_a3b_geometry", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
    head_dim=128, rope_theta=1e6, norm_eps=1e-6, max_seq_len=4096, n_experts=128, top_k=8, expert_dim=768,
    norm_topk=True, qk_norm="head")
GEOMETRIES: dict[str, ModelConfig] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "sibling-4g": QWEN3_30B_A3B.evolve(name="qwen3_moe_sibling_4g", n_layers=10, n_blocks=10),
    "tiny": QWEN3_30B_A3B.evolve(name="qwen3_moe_tiny", vocab_size=320, d_model=128, n_layers=3, n_blocks=3,
                                 n_heads=4, n_kv_heads=2, head_dim=32, n_experts=8, top_k=2, expert_dim=64,
                                 max_seq_len=128),
}
PIPELINE_DELAYS = (1, 2)  # (dense delay, expert delay) of the pipeline-native variant
DD_BLOCK = 64 << 20


def geometry(name: str, pipeline: bool = False) -> ModelConfig:
    """The config of a geometry, or of its pipeline-native variant (dd = 1, de = 2)."""
    cfg = GEOMETRIES[name]
    if pipeline:
        dd, de = PIPELINE_DELAYS
        cfg = cfg.evolve(name=f"{cfg.name}_dd{dd}de{de}", dense_delay=dd, expert_delay=de)
    return cfg


def native_steps():
    """The synthetic weights' generator steps from codegen's native loops (PCG64 words and float32 draws, float16
    conversion): NumPy's values at a few times its speed (cflow.models.synthetic.Steps)."""
    from cflow.codegen.half import to_half
    from cflow.codegen.pcg64 import raw_masked, uniform_f32
    from cflow.models.synthetic import Steps

    return Steps(uniform_f32=uniform_f32, raw_masked=raw_masked, to_half=to_half)


def graph(cfg: ModelConfig, seed: int = 0, native: bool = True):
    """The model's graph on its synthetic weights (nothing generated yet), drawn with the native loops (or
    NumPy's steps: the same values)."""
    from cflow.ir import build_graph
    from cflow.models.synthetic import NUMPY_STEPS, SyntheticWeights

    return build_graph(cfg, SyntheticWeights(cfg, seed, native_steps() if native else NUMPY_STEPS), name=cfg.name)


def planned_bytes(cfg: ModelConfig) -> int:
    """The bytes of the .vflow's tensors, from the plan alone (no weight touched)."""
    from cflow.compiler import lower
    from cflow.ir import build_graph

    return sum(t.nbytes for t in lower(build_graph(cfg, None), "q4").tensors.values())


def dd_write(directory: str, nbytes: int, direct: bool = False) -> dict:
    """A plain sequential write of `nbytes` (64 MiB buffers of random bytes, then fsync) into a scratch file in
    `directory`, removed afterwards: the disk's write speed to compare the writers with. direct: with O_DIRECT
    (`dd bs=64M oflag=direct conv=fsync`: no copy into the page cache, as FileWriter writes tensors)."""
    import numpy as np

    buf = np.frombuffer(os.urandom(DD_BLOCK + 4096), np.uint8)
    buf = memoryview(buf[(-buf.ctypes.data) % 4096 :][:DD_BLOCK])  # aligned, as O_DIRECT needs
    path = os.path.join(directory, f".dd_write_{os.getpid()}.tmp")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        left = -(-nbytes // 4096) * 4096 if direct else nbytes  # whole blocks with O_DIRECT
        while left > 0:
            left -= os.write(fd, buf[: min(left, DD_BLOCK)])
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.remove(path)
    return {"bytes": nbytes, "seconds": seconds, "mb_s": nbytes / seconds / 1e6, "direct": direct}


def write_vflow(cfg: ModelConfig, path: str, seed: int = 0, progress=None) -> dict:
    """compile_file of the synthetic model to `path` (Q4): the file's info plus MB/s."""
    import warnings

    from cflow.compiler import compile_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # delays set in the config are the model's own, not a rewrite
        info = compile_file(graph(cfg, seed), path, "q4", progress=progress).file
    return {**info, "mb_s": info["file_bytes"] / info["seconds"] / 1e6}


def write_gguf(cfg: ModelConfig, path: str, seed: int = 0) -> dict:
    """export_gguf of the same weights (llama.cpp's qwen3moe arch, Q4_0 blocks identical to the .vflow's)."""
    from cflow.compiler import lower
    from cflow.runtime.format.gguf import export_gguf

    info = export_gguf(lower(graph(cfg, seed), "q4").graph, path)
    return {**info, "mb_s": info["file_bytes"] / info["seconds"] / 1e6}


def cpu_rate(cfg: ModelConfig, seed: int = 0) -> dict:
    """The writer without the disk: every tensor generated, packed (by emit_file's own threads, ahead of the
    consumer) and checksummed, nothing written. Its MB/s is what the writer could reach on an infinitely fast
    disk."""
    from cflow.compiler import lower
    from cflow.runtime.emit import packed_tensors
    from cflow.util import crc32

    st = lower(graph(cfg, seed), "q4")
    t0 = time.perf_counter()
    nbytes = 0
    for _, data in packed_tensors(st):
        crc32(data)
        nbytes += data.nbytes
    seconds = time.perf_counter() - t0
    return {"bytes": nbytes, "seconds": seconds, "mb_s": nbytes / seconds / 1e6}


PROBE_PROMPT = [1, 17, 42, 99, 7, 123, 5, 250]


def probe(cfg: ModelConfig, seed: int = 0, ids: list[int] | None = None) -> dict:
    """The activation scale of the model without a file: cflow's reference interpreter (int8 activations, f16 KV)
    on the weights generated on demand, over a prompt; the RMS of each layer's attention output, expert output
    and residual stream at the last position, and the logits' spread and top-2 margin there."""
    import warnings

    import numpy as np

    from cflow.compiler import lower
    from cflow.ir import Interpreter
    from cflow.ir import names as N

    ids = list(PROBE_PROMPT if ids is None else ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = Interpreter(lower(graph(cfg, seed), "q4").graph, act_quant="q8", cache_weights=False, kv="f16")
    for t in ids:
        z = np.asarray(it.step(t), np.float64).reshape(-1)
    v = it.values

    def rms(name):
        return float(np.sqrt(np.mean(np.square(np.asarray(v[name], np.float64)[-1]))))

    layers = [{"attn": rms(N.attn(l)), "moe": rms(N.moe(l)), "residual": rms(N.x(l) if N.x(l) in v else N.a(l))}
              for l in range(1, cfg.n_layers + 1)]  # noqa: E741
    top = np.sort(z)
    return {"prompt": ids, "embedding": rms(N.EMBED), "layers": layers, "logit_std": float(z.std()),
            "argmax": int(z.argmax()), "top2_margin": float(top[-1] - top[-2])}


def _with_cpu(fn, *args) -> dict:
    """fn's result plus the CPU time this process spent meanwhile (user + system, every thread) and the wall time:
    cpu_s / wall_s is the share of a core it got or used (on a shared machine, other processes take the rest)."""
    import resource

    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    out = fn(*args)
    r1, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    return {**out, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime), "wall_s": wall,
            "sys_s": r1.ru_stime - r0.ru_stime}


def _cpu_text(r: dict) -> str:
    gb = r.get("file_bytes", r.get("bytes", 0)) / 1e9
    return (f"CPU {r['cpu_s'] / gb:.2f} s/GB ({r['sys_s'] / gb:.2f} system), {r['cpu_s'] / r['wall_s']:.2f} cores "
            f"busy on average")


def _progress(every: float = 10.0):
    state = {"t0": time.perf_counter(), "last": 0.0}

    def report(done: int, total: int, name: str) -> None:
        now = time.perf_counter() - state["t0"]
        if now - state["last"] >= every or done == total:
            state["last"] = now
            print(f"#   {done / 1e9:6.2f} / {total / 1e9:.2f} GB  {done / max(now, 1e-9) / 1e6:7.1f} MB/s  {name}",
                  file=sys.stderr, flush=True)

    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.make_moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="sibling-4g")
    ap.add_argument("--out", help="directory for the files (required unless --probe)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", action="store_true", help="also write the GGUF twin (not with --pipeline)")
    ap.add_argument("--pipeline", action="store_true", help="the pipeline-native variant: dd = 1, de = 2")
    ap.add_argument("--no-vflow", action="store_true", help="write only the GGUF")
    ap.add_argument("--no-dd", action="store_true", help="skip the plain-write baseline before each file")
    ap.add_argument("--cpu-rate", action="store_true", help="first measure the writer without the disk")
    ap.add_argument("--json", metavar="FILE", help="write the measurements here")
    ap.add_argument("--probe", action="store_true",
                    help="only print the activation scale per layer (the interpreter on generated weights, no file)")
    a = ap.parse_args(argv)
    if a.gguf and a.pipeline:
        ap.error("--gguf with --pipeline: llama.cpp computes delays (0, 0) only")
    if not a.out and not a.probe:
        ap.error("--out DIR is required")
    cfg = geometry(a.geometry, a.pipeline)
    if a.probe:
        r = probe(cfg, a.seed)
        print(f"# {cfg.name}: embedding RMS {r['embedding']:.2f}; per layer: attention out / experts out / residual")
        for i, x in enumerate(r["layers"], 1):
            print(f"layer {i:2d}  {x['attn']:.3f}  {x['moe']:.3f}  {x['residual']:.3f}")
        print(f"# logits std {r['logit_std']:.2f}, argmax {r['argmax']} after {r['prompt'][-1]}, "
              f"top-2 margin {r['top2_margin']:.1f}")
        return r
    os.makedirs(a.out, exist_ok=True)
    size = planned_bytes(cfg)
    print(f"# {cfg.name}: {cfg.n_params() / 1e9:.2f} B parameters ({cfg.n_params(active=True) / 1e9:.2f} B active), "
          f"{size / 1e9:.2f} GB at Q4", flush=True)
    out: dict = {"geometry": a.geometry, "config": cfg.name, "seed": a.seed, "planned_bytes": size}
    if a.cpu_rate:
        out["cpu"] = r = _with_cpu(cpu_rate, cfg, a.seed)
        print(f"# generate + pack + checksum, nothing written: {r['mb_s']:.0f} MB/s; {_cpu_text(r)}", flush=True)
    files = ([("vflow", write_vflow)] if not a.no_vflow else []) + ([("gguf", write_gguf)] if a.gguf else [])
    for kind, write in files:
        if not a.no_dd:  # the disk's speed right before this file: it drifts from minute to minute
            for direct in (False, True):
                key = f"dd_{kind}" + ("_direct" if direct else "")
                out[key] = dd = _with_cpu(dd_write, a.out, size, direct)
                print(f"# plain write of {size / 1e9:.2f} GB (64 MiB blocks{', O_DIRECT' if direct else ''} + fsync): "
                      f"{dd['mb_s']:.0f} MB/s; {_cpu_text(dd)}", flush=True)
        path = os.path.join(a.out, f"{cfg.name}.{kind}")
        out[kind] = info = _with_cpu(write, cfg, path, a.seed, *([_progress()] if kind == "vflow" else []))
        ratio = (f" ({info['mb_s'] / out[f'dd_{kind}']['mb_s']:.0%} of the plain write, "
                 f"{info['mb_s'] / out[f'dd_{kind}_direct']['mb_s']:.0%} of the O_DIRECT one)") if not a.no_dd else ""
        print(f"# {path}: {info['file_bytes'] / 1e9:.2f} GB in {info['seconds']:.1f} s, {info['mb_s']:.0f} MB/s"
              f"{ratio}; {_cpu_text(info)}", flush=True)
    out["peak_rss"] = peak_rss()
    print(f"# peak RSS {out['peak_rss'] / 2**20:.0f} MiB", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
