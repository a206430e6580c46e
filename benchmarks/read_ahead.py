"""Dense weights streamed from disk: .vflow (stage-major) vs .cflow (layer-major) read-ahead, cold file.

    python -m benchmarks.read_ahead --quick              # < 5 minutes
    python -m benchmarks.read_ahead --json

The paper left ".vflow read-ahead" inconclusive: its scheduler had no asynchronous I/O for the dense
weights. Here `--weights-on-disk` streams every dense matrix from the file in schedule-stage order with
O_DIRECT (the page cache is bypassed: every token's weights come from the disk), `read_ahead` stages ahead
of the one computing. The same model with the same weights is written twice: as a .vflow, whose bytes are
in stage order (one request per stage), and as a .cflow, in layer order (a stage of a delayed model holds
tensors of two layers: more, smaller requests, further apart). Each run is its own process; the two layouts
alternate, so drifting load hits both alike. The experts stay on disk too (the tier), in a cache that holds
them all, so after the first tokens only the dense stream is read.

Printed per layout and read-ahead depth: tok/s, disk MB and requests per token, the time the step waited
for its weights, effective read GB/s, and the disk's own sequential O_DIRECT rate measured in the same run
(requests of one stage's size, one at a time and two in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numpy as np

from benchmarks.common.memory import peak_rss
from benchmarks.common.models import GEOMETRIES, compile_random, geometry_config
from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument


def build(geometry: str, suffix: str, out_dir: str) -> str:
    # the same weights (seed 0) in the .vflow and the .cflow file
    return compile_random(geometry_config(geometry), os.path.join(out_dir, f"read_ahead_{geometry}{suffix}"), seed=0)


def worker(path: str, depth: int, tokens: int, threads: int) -> dict:
    import cflow

    kw = dict(weights="disk", read_ahead=depth, expert_cache_mb=1e4) if depth >= 0 else {}
    with cflow.load(path, threads=threads, **kw) as m:
        s = m.session
        logits = s.prefill([1, 2, 3, 4])
        for _ in range(2):  # warm: the expert cache fills, the stream reaches its steady state
            logits = s.step(int(np.argmax(logits)))
        st = s.streamer.stats if s.streamer is not None else None
        base = (st.bytes_read, st.requests, st.wait_seconds) if st else (0, 0, 0.0)
        t0 = time.perf_counter()
        for _ in range(tokens):
            logits = s.step(int(np.argmax(logits)))
        dt = time.perf_counter() - t0
        rec = {"tok_s": tokens / dt, "peak_rss": peak_rss()}
        if st:
            rec.update(disk_bytes_per_token=(st.bytes_read - base[0]) / tokens,
                       requests_per_token=(st.requests - base[1]) / tokens,
                       wait_ms_per_token=1e3 * (st.wait_seconds - base[2]) / tokens, direct=s.streamer.direct,
                       stage_bytes=max(len(b) for b in s.streamer.buffers))
        return rec


def run_one(path: str, depth: int, tokens: int, threads: int) -> dict:
    cmd = module_command("benchmarks.read_ahead", "--worker", path, depth, tokens, threads)
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if r.returncode:
        raise SystemExit(f"worker failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def disk_rate(path: str, chunk: int, n: int = 48) -> tuple[float, float]:
    """GB/s of O_DIRECT reads of `chunk` bytes at increasing offsets: one at a time, and two in flight."""
    import concurrent.futures as cf

    from cflow.layout.tile import aligned_empty
    from cflow.runtime.format.spec import ALIGN, pad

    chunk = pad(chunk)
    size = os.path.getsize(path)
    offs = [(i * chunk) % max(ALIGN, size - chunk) // ALIGN * ALIGN for i in range(n)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    bufs = [aligned_empty(chunk, ALIGN) for _ in range(2)]
    try:
        t0 = time.perf_counter()
        for o in offs:
            os.preadv(fd, [memoryview(bufs[0])], o)
        one = n * chunk / (time.perf_counter() - t0) / 1e9
        with cf.ThreadPoolExecutor(2) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda io: os.preadv(fd, [memoryview(bufs[io[0] % 2])], io[1]), enumerate(offs)))
            two = n * chunk / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
    return one, two


def main(argv=None) -> None:
    from cflow.codegen.target import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=list(GEOMETRIES), default="wide", help="model geometry (default wide)")
    ap.add_argument("--depths", default="0,1,2,4", help="read-ahead depths in stages (default 0,1,2,4)")
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per run (default 24)")
    ap.add_argument("--threads", type=int, default=2, help="decode threads (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="runs per layout and depth, alternating; medians (default 3)")
    ap.add_argument("--quick", action="store_true", help="the 114m geometry, 2 runs each (under 5 minutes)")
    ap.add_argument("--out-dir", default=os.environ.get("CFLOW_BENCH_DIR", "/tmp/cflow-bench"),
                    help="where the compiled models go (default /tmp/cflow-bench)")
    add_json_argument(ap, "write one record per layout and depth")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        path, depth, tokens, threads = args.worker
        print(json.dumps(worker(path, int(depth), int(tokens), int(threads))))
        return
    run = Run("read_ahead", argv)
    if args.quick:
        args.geometry, args.reps = "114m", 2
    os.makedirs(args.out_dir, exist_ok=True)
    cpu = cpu_model()
    files = {"vflow": build(args.geometry, ".vflow", args.out_dir),
             "cflow": build(args.geometry, ".cflow", args.out_dir)}
    depths = [int(d) for d in args.depths.split(",")]
    ram = {k: run_one(p, -1, args.tokens, args.threads)["tok_s"] for k, p in files.items()}
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.reps):
        for depth in depths:
            for layout, path in files.items():
                runs.setdefault((layout, depth), []).append(run_one(path, depth, args.tokens, args.threads))
    first = runs[("vflow", depths[0])][0]
    one, two = disk_rate(files["vflow"], int(first["stage_bytes"]))
    print(f"# {cpu}, {os.cpu_count()} cores; arch2_4_combined geometry {args.geometry}, q4; {args.threads} threads; "
          f"{args.tokens} tokens; median of {args.reps} alternating runs; O_DIRECT: {first['direct']}")
    print(f"# weights in RAM: {ram['vflow']:.1f} tok/s (.vflow), {ram['cflow']:.1f} tok/s (.cflow); disk, O_DIRECT "
          f"requests of one stage ({first['stage_bytes'] / 1e6:.1f} MB): {one:.2f} GB/s one at a time, "
          f"{two:.2f} GB/s two in flight")
    print(f"{'layout':>6} {'ahead':>5} {'tok/s':>7} {'MB/tok':>7} {'req/tok':>7} {'wait ms/tok':>11} "
          f"{'read GB/s':>9} {'of disk':>7} {'peak RSS MB':>11}")
    records = []
    for depth in depths:
        for layout in files:
            rs = sorted(runs[(layout, depth)], key=lambda r: r["tok_s"])
            r = rs[len(rs) // 2]
            gbps = r["tok_s"] * r["disk_bytes_per_token"] / 1e9
            records.append(run.record(
                engine="cflow", model=f"arch2_4_combined {args.geometry}", quant="q4", threads=args.threads,
                variant=f"{layout}, read-ahead {depth}", tok_s=r["tok_s"], bytes_per_token=r["disk_bytes_per_token"],
                layout=layout, read_ahead=depth, tok_s_runs=[x["tok_s"] for x in rs],
                requests_per_token=r["requests_per_token"], wait_ms_per_token=r["wait_ms_per_token"],
                disk_read_gbps=gbps, disk_gbps_one=one, disk_gbps_two=two, ram_tok_s=ram[layout],
                peak_rss=r["peak_rss"], tokens=args.tokens))
            print(f"{layout:>6} {depth:>5} {r['tok_s']:>7.2f} {r['disk_bytes_per_token'] / 1e6:>7.1f} "
                  f"{r['requests_per_token']:>7.1f} {r['wait_ms_per_token']:>11.1f} {gbps:>9.2f} "
                  f"{gbps / max(one, two):>6.0%} {r['peak_rss'] / 2**20:>11.0f}", flush=True)
    run.write(args.json, records)


if __name__ == "__main__":
    main()
