"""Compile speed and memory: a ~1 GB float32 checkpoint to Q4 with `cflowc`, under /usr/bin/time -v.

    python -m benchmarks.compile [--quant q4] [--keep] [--json [FILE]]

Writes a cflow checkpoint directory (config.json + model.safetensors, f32, fixed random weights) of
~1 GB into out/bench/, then runs `cflowc DIR -o out.vflow --quant q4` in a child process measured by
/usr/bin/time -v. Prints wall time, peak RSS, and peak RSS minus the source weights in units of the
largest tensor (the target: under 60 s and at most ~1.5x the largest tensor beyond the source).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import OUT
from benchmarks.common.record import Run, add_json_argument
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig

# ~256M parameters = ~1.0 GB float32 (Llama-style, no MoE so every byte is a dense matrix)
CONFIG = ModelConfig(name="compile_bench_1gb", vocab_size=32000, d_model=1536, n_layers=6, n_heads=12,
                     n_kv_heads=4, ffn_dim=4096, max_seq_len=512)


def state_dict_names(c: ModelConfig) -> dict[str, tuple]:
    """PipelineNativeLM state-dict names and shapes for a dense config (what save_checkpoint writes)."""
    out = {}
    for name, shape in weight_shapes(c).items():
        out[name + ".weight" if not name.endswith((".bq", ".bk", ".bv")) else name] = shape
    return out


def write_source(path: str) -> tuple[int, int]:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in state_dict_names(CONFIG).items():
        tensors[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"format": "cflow", **CONFIG.to_dict()}, f)
    sizes = [t.nbytes for t in tensors.values()]
    return sum(sizes), max(sizes)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="q4")
    ap.add_argument("--keep", action="store_true", help="keep the compiled file")
    add_json_argument(ap, "write the record")
    args = ap.parse_args(argv)
    run = Run("compile", argv)
    src = os.path.join(OUT, "compile_src")
    t0 = time.perf_counter()
    total, largest = write_source(src)
    print(f"# source: {total / 1e9:.2f} GB float32 in {src} (largest tensor {largest / 1e6:.0f} MB), "
          f"written in {time.perf_counter() - t0:.1f} s", flush=True)
    out = os.path.join(OUT, "compile_bench.vflow")
    # The child samples its own anonymous and file-backed RSS: mapped source pages are page cache
    # (file-backed, reclaimable) and are the "source weights"; anonymous memory is what compiling adds.
    child = (
        "import threading, time, sys\n"
        "peak = {'RssAnon': 0, 'RssFile': 0}\n"
        "def sample():\n"
        "    while True:\n"
        "        for line in open('/proc/self/status'):\n"
        "            k = line.split(':')[0]\n"
        "            if k in peak: peak[k] = max(peak[k], int(line.split()[1]) * 1024)\n"
        "        time.sleep(0.02)\n"
        "threading.Thread(target=sample, daemon=True).start()\n"
        "import cflow, cflow.frontend.load, numpy\n"
        "time.sleep(0.1); base = dict(peak)\n"
        "from cflow.cli import cflowc_main\n"
        "code = cflowc_main(sys.argv[1:])\n"
        "time.sleep(0.1)\n"
        "print('MEM', base['RssAnon'], peak['RssAnon'], peak['RssFile'])\n"
        "raise SystemExit(code)\n"
    )
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", child, src, "-o", out, "--quant", args.quant],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cflowc failed: {r.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", r.stderr)
    secs = (int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))) if wall else float("nan")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1)) * 1024
    base_anon, peak_anon, peak_file = (int(v) for v in re.search(r"MEM (\d+) (\d+) (\d+)", r.stdout).groups())
    size = os.path.getsize(out)
    print(f"cflowc {args.quant}: {secs:.1f} s wall, {size / 1e9:.3f} GB written "
          f"({total / secs / 1e6:.0f} MB/s of source)")
    print(f"peak RSS {rss / 1e9:.2f} GB = mapped source pages (file-backed) up to {peak_file / 1e9:.2f} GB + anonymous "
          f"{peak_anon / 1e9:.2f} GB; anonymous memory beyond the loaded libraries: "
          f"{(peak_anon - base_anon) / 1e6:.0f} MB "
          f"= {(peak_anon - base_anon) / largest:.2f}x the largest tensor ({largest / 1e6:.0f} MB)")
    run.write(args.json, [run.record(engine="cflowc", model=CONFIG.name, quant=args.quant, seconds=secs,
                                     source_bytes=total, largest_tensor_bytes=largest, file_bytes=size,
                                     peak_rss_bytes=rss, peak_file_backed_bytes=peak_file, peak_anon_bytes=peak_anon,
                                     base_anon_bytes=base_anon)])
    if not args.keep:
        os.unlink(out)


if __name__ == "__main__":
    main()
