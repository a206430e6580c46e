"""Load test of `cflow serve`: N concurrent streaming clients against one server, for a bounded time.

    python benchmarks/serve.py                                   # bundled model and the 114m preset, N = 1 4 16 64
    python benchmarks/serve.py --quick                           # 5 s per level, about 4 minutes
    python benchmarks/serve.py --max-batch 1,8,32 --threads 1 --json docs/results/serve.json
    python benchmarks/serve.py --engine-only --max-batch 1,2,4,8,16,32 --models 114m   # what a shared step buys

For each model the server is `cflow serve` in a process of its own on 127.0.0.1 (a free port). For each N,
N clients each loop for --duration seconds: send a streaming /v1/completions request (--max-tokens tokens,
temperature 0.8, a random prompt), read its server-sent events, and send the next; requests still running
at the end are read to their end (bounded by --drain seconds, then counted as errors). The clients are one
asyncio process speaking HTTP/1.1 directly (no client library: its parsing would compete with the server
for the same cores) and take the time of every event.

Reported per (model, N):
    aggregate tok/s     tokens all clients received / wall time of the level
    per-client tok/s    how fast an answer streams once it has started: (tokens - 1) / (last - first token),
                        the median over requests
    TTFT p50/p99        request sent -> first token (queueing included: with one sequence at a time a request
                        waits for the ones ahead of it)
    ITL p50/p99         time between two tokens of one stream
    errors              non-200 answers, error events, broken or unfinished streams (0 expected below the queue)
    RSS                 the server's resident memory before the first level and after the last (no growth)

--engine-only measures the engine's backend alone (no HTTP, no clients): every one of B slots decoding, with
temperature 0.8 sampling, the best of 3 x --steps steps; aggregate tok/s and ms per step for each --max-batch
(the measurement behind the default --max-batch in docs/serving.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

STORY_PROMPTS = ["Once upon a time", "One day, a little girl named Lily", "Tom and his dog went to the park",
                 "The sun was shining and", "There was a big red ball", "Sue wanted to bake a cake"]


# --- models and the server -----------------------------------------------------------------------------------
def compile_model(which: str, out_dir: str) -> str:
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph

    if which == "bundled":
        from cflow.models.bundled import default_model_dir

        g = load_graph(default_model_dir())
        path = os.path.join(out_dir, "bundled.vflow")
        compile_file(g, path, tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    else:
        path = os.path.join(out_dir, f"{which}.vflow")
        compile_file(load_graph(f"preset:arch2_4_combined@{which}"), path, "q4")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, path: str, threads: int | None, max_batch: int, max_queue: int, log: str):
        self.port = free_port()
        cmd = [sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())"]
        cmd += ["serve", path, "--port", str(self.port), "--max-batch", str(max_batch), "--max-queue", str(max_queue),
                "--model-name", "m", "--log-level", "warning"] + (["--threads", str(threads)] if threads else [])
        self.log = open(log, "w")
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180
        while True:
            if self.p.poll() is not None:
                raise RuntimeError(f"cflow serve exited: {open(log).read()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    self.health = json.loads(r.read())
                    break
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("cflow serve did not come up in 180 s") from None
                time.sleep(0.2)

    def rss(self) -> float:
        return rss_mb(self.p.pid)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self.log.close()


# --- the clients ------------------------------------------------------------------------------------------------
async def stream_once(port: int, body: dict, timeout: float) -> dict:
    """One streaming request over HTTP/1.1 (chunked SSE). Returns sent, token times, usage and an error."""
    rec = {"sent": time.perf_counter(), "times": [], "tokens": 0, "error": None}
    payload = json.dumps(body).encode()
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
                await writer.drain()
                status = int((await reader.readline()).split()[1])
                headers = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    k, _, v = line.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                if status != 200:
                    rec["error"] = f"HTTP {status}"
                    return rec
                buf = b""
                done = False
                while not done:
                    size = int((await reader.readline()).strip() or b"0", 16)
                    if size == 0:
                        break
                    buf += await reader.readexactly(size)
                    await reader.readexactly(2)
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event.removeprefix(b"data: ")
                        if data == b"[DONE]":
                            done = True
                            break
                        d = json.loads(data)
                        if "error" in d:
                            rec["error"] = d["error"]["message"]
                        elif d.get("usage"):
                            rec["tokens"] = d["usage"]["completion_tokens"]
                        elif d["choices"] and d["choices"][0]["text"]:
                            rec["times"].append(time.perf_counter())
                if not done and rec["error"] is None:
                    rec["error"] = "stream ended without [DONE]"
            finally:
                writer.close()
    except TimeoutError:
        rec["error"] = "timeout"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def client_loop(port: int, prompts, max_tokens: int, until: float, drain: float, rng: random.Random):
    out = []
    while time.perf_counter() < until:
        body = {"model": "m", "prompt": rng.choice(prompts), "max_tokens": max_tokens, "temperature": 0.8,
                "seed": rng.randrange(2**31), "stream": True, "stream_options": {"include_usage": True}}
        out.append(await stream_once(port, body, until - time.perf_counter() + drain))
    return out


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def level(port: int, n: int, prompts, max_tokens: int, duration: float, drain: float, seed: int) -> dict:
    t0 = time.perf_counter()
    until = t0 + duration
    rngs = [random.Random(seed * 1000 + i) for i in range(n)]
    # clients start a few ms apart, as real ones would
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(client_loop(port, prompts, max_tokens, until, drain, rngs[i])))
        await asyncio.sleep(0.002)
    results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    wall = max([r["times"][-1] for r in results if r["times"]] + [time.perf_counter()]) - t0
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["times"][0] - r["sent"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    rates = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in ok
             if len(r["times"]) > 2 and r["times"][-1] > r["times"][0]]
    errors = [r["error"] for r in results if r["error"] is not None]
    return {"clients": n, "requests": len(results), "tokens": tokens, "wall_s": round(wall, 2),
            "aggregate_tok_s": round(tokens / wall, 1),
            "per_client_tok_s": round(statistics.median(rates), 1) if rates else None,
            "ttft_p50_ms": round(1e3 * pct(ttft, 50), 1), "ttft_p99_ms": round(1e3 * pct(ttft, 99), 1),
            "itl_p50_ms": round(1e3 * pct(itl, 50), 2), "itl_p99_ms": round(1e3 * pct(itl, 99), 2),
            "errors": len(errors), "error_examples": sorted(set(errors))[:3]}


def run_server(which: str, path: str, batch: int, counts, args, cpu: str, hdr: str, tmp: str) -> list[dict]:
    records = []
    server = Server(path, args.threads, batch, args.max_queue, os.path.join(tmp, f"{which}_b{batch}.log"))
    try:
        if which == "bundled":
            prompts = STORY_PROMPTS
        else:
            r = random.Random(0)
            prompts = [[r.randrange(1, 1000) for _ in range(8)] for _ in range(6)]
        # warm-up: first touch of the weights and of every slot's KV cache
        asyncio.run(level(server.port, max(2, batch), prompts, 8, 1.0, 10.0, 99))
        rss0 = server.rss()
        print(f"\n{which}, --max-batch {batch}: server RSS {rss0:.0f} MB after warm-up\n{hdr}", flush=True)
        for i, n in enumerate(counts):
            rec = asyncio.run(level(server.port, n, prompts, args.max_tokens, args.duration, args.drain, i))
            rec.update(model=which, max_batch=batch, threads=args.threads or len(os.sched_getaffinity(0)),
                       max_tokens=args.max_tokens, cpu=cpu)
            records.append(rec)
            print(f"{which:>8} {batch:>3} {n:>3} {rec['requests']:>5} {rec['aggregate_tok_s']:>9.1f} "
                  f"{rec['per_client_tok_s'] or 0:>12.1f} {rec['ttft_p50_ms']:>9.1f} "
                  f"{rec['ttft_p99_ms']:>8.1f} {rec['itl_p50_ms']:>8.2f} {rec['itl_p99_ms']:>7.2f} "
                  f"{rec['errors']:>6}" + (f"  {rec['error_examples']}" if rec["errors"] else ""), flush=True)
        rss1 = server.rss()
        print(f"{which}, --max-batch {batch}: server RSS {rss0:.0f} MB before, {rss1:.0f} MB after "
              f"({rss1 - rss0:+.0f} MB)", flush=True)
        for rec in records:
            rec.update(rss_before_mb=round(rss0, 1), rss_after_mb=round(rss1, 1))
    finally:
        server.close()
    return records


def engine_only(which: str, path: str, batches, threads: int | None, steps: int) -> list[dict]:
    """Aggregate decode tok/s of the serving backend with every slot busy, per --max-batch."""
    from cflow.serve.engine import SamplingParams, load_backend

    class _Job:  # what a backend reads of a job
        def __init__(self, ids, params):
            self.prompt_ids, self.params = ids, params

    records, base = [], None
    for b in batches:
        be = load_backend(path, threads=threads, slots=b)
        try:
            ctx = be.model.session.max_seq
            slots = list(range(b))
            for s in slots:
                ids = [1 + (7 * s + 3 * i) % 200 for i in range(8)]
                left = be.start(s, _Job(ids, SamplingParams(max_tokens=ctx - len(ids), temperature=0.8, seed=s)))
                while left:
                    left = be.prefill(s)
            if 8 + 4 + 3 * steps > ctx:
                raise SystemExit(f"--steps {steps}: 3 rounds do not fit the context of {ctx} tokens")
            for _ in range(4):  # warm-up (a slot that drew end-of-text still runs its step: all are counted)
                be.advance(slots)
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(steps):
                    be.advance(slots)
                best = min(best, time.perf_counter() - t0)
        finally:
            be.close()
        tok = b * steps / best
        base = base or tok
        rec = {"model": which, "max_batch": b, "threads": threads or len(os.sched_getaffinity(0)),
               "aggregate_tok_s": round(tok, 1), "vs_first": round(tok / base, 2),
               "ms_per_step": round(1e3 * best / steps, 2), "per_stream_tok_s": round(tok / b, 1)}
        records.append(rec)
        print(f"{which:>8} B={b:>3}: {tok:8.0f} tok/s aggregate ({tok / base:4.2f}x), {rec['ms_per_step']:6.2f} ms "
              f"per step, {tok / b:7.0f} tok/s per stream", flush=True)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled,114m", help="bundled and/or preset sizes (default bundled,114m)")
    p.add_argument("--clients", default="1,4,16,64", help="concurrent clients per level (default 1,4,16,64)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds each level sends requests (default 20)")
    p.add_argument("--drain", type=float, default=60.0,
                   help="seconds running requests may take to finish after that (default 60)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--threads", type=int, default=None, help="server threads (default: usable cores)")
    p.add_argument("--max-batch", default="1,8",
                   help="server --max-batch values, one server each (default 1,8)")
    p.add_argument("--max-queue", type=int, default=64, help="server --max-queue (default 64)")
    p.add_argument("--quick", action="store_true", help="5 s per level, 30 s drain (default: off)")
    p.add_argument("--json", default=None, help="write the records to this file (default: none)")
    p.add_argument("--engine-only", action="store_true",
                   help="measure the backend alone, no server or clients (see above) (default: off)")
    p.add_argument("--steps", type=int, default=50, help="--engine-only: decode steps per round (default 50)")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.drain = 5.0, 30.0
    counts = [int(x) for x in args.clients.split(",")]
    records = []
    cpu = next((ln.split(":", 1)[1].strip() for ln in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ln.startswith("Model name")), "?")
    print(f"# cflow serve load test: {cpu}, {len(os.sched_getaffinity(0))} usable cores; server --threads "
          f"{args.threads or 'default'} --max-queue {args.max_queue}; {args.max_tokens} tokens per request, "
          f"{args.duration:g} s per level", flush=True)
    hdr = (f"{'model':>8} {'B':>3} {'N':>3} {'reqs':>5} {'agg tok/s':>9} {'client tok/s':>12} {'TTFT p50':>9} "
           f"{'p99 ms':>8} {'ITL p50':>8} {'p99 ms':>7} {'errors':>6}")
    with tempfile.TemporaryDirectory(prefix="cflow-serve-bench-") as tmp:
        for which in args.models.split(","):
            path = compile_model(which, tmp)
            batches = [int(b) for b in args.max_batch.split(",")]
            if args.engine_only:
                records += engine_only(which, path, batches, args.threads, args.steps)
                continue
            for batch in batches:
                records += run_server(which, path, batch, counts, args, cpu, hdr, tmp)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
