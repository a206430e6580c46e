"""Load test of `cflow serve`: N concurrent streaming clients against one server, for a bounded time.

    python -m benchmarks.serve --models 114m --threads 1 --json       # N = 1 4 16 64, 20 s each
    python -m benchmarks.serve --quick --threads 1 --json             # 5 s per level, ~2 min
    python -m benchmarks.serve --engine-only --models 114m,bundled --max-batch 1,2,4,8,16,32 --threads 1 --repeat 3 \
        --json                                                        # what a shared step buys (no HTTP)

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
    RSS                 the server's resident memory before the first level and after the last (no growth
                        beyond what the prefix cache holds, within its budget: both printed)

--engine-only measures the engine's backend alone (no HTTP, no clients): every one of B slots decoding, with
temperature 0.8 sampling, the best of 3 x --steps steps; aggregate tok/s and ms per step for each --max-batch
(the measurement behind the default --max-batch in docs/serving.md). For each B > 1 it also times one slot
decoding alone: slot 0 (where BatchedSlots runs the single-sequence decode step) and slot 1 (a one-slot
batch_step, the multi-token program). --repeat R runs the whole sweep R times; every run is recorded.

--chunked-prefill TOKENS (engine, 8 slots, no HTTP): a stream decodes; after its 20th token a TOKENS-token prompt
arrives. It is read once at once (one prefill call) and once a prefill block per loop turn (chunked prefill):
the running stream's longest gap between tokens, its tokens while the prompt is read, the new request's TTFT.

    python -m benchmarks.serve --chunked-prefill 900 --models 114m --threads 1 --repeat 2 --json

--prefix TOKENS (servers, HTTP): the time to first token of a prompt of TOKENS shared tokens and --new (20) new
ones, with the prefix cache off (--cache-mb 0) and on (its default budget, the shared tokens read once by an
earlier request): two servers per --max-batch, --rounds requests each, one at a time, in turns.

    python -m benchmarks.serve --prefix 1000 --models tinyllama --max-batch 1,8 --threads 1 --json

--one-slot (engine, no HTTP): one stream decoding through StreamSlots and through a one-slot BatchedSlots, in
turns (what serving one slot with BatchedSlots costs).

--shapes (server, HTTP): what structured output costs per served token: free text against a JSON schema,
json_object and a GBNF grammar, --rounds requests of each, one at a time in turns, per token by the server's
clock (its `timings`) and the client's (the share of the cores other processes used meanwhile is printed and
recorded); --overlap on,off: a server each way (--no-overlap), requests alternating; --baseline DIR: each
mode also served by another checkout's cflow (MODE@base), requests alternating over all; --load none,spin: the
same with another process busy (benchmarks/load.py's `spin`, started before the servers: what a shared host does
to the overlap, its back-off and the first token), a set of servers per load. With --engine-only, the
engine's side of it in this process (the server's Job and Chooser over a one-slot BatchedSlots): --overlap off,
steps in turn, in thread CPU time per token; on, the step detached, in wall time per token with the host's work
between a step's end and the next one's start.

    python -m benchmarks.serve --shapes --models bundled --threads 1 --rounds 401 --max-tokens 64 \
        --overlap on,off --json
    python -m benchmarks.serve --shapes --models bundled --threads 1 --rounds 101 --max-tokens 64 \
        --overlap on,off --load none,spin --json
    python -m benchmarks.serve --shapes --engine-only --models bundled --threads 1 --rounds 60 --max-tokens 64 \
        --overlap on,off --json

--thread-split (server, HTTP): a served token's time with the step on every core against one core fewer with the
overlap, per model (bundled, 114m, dNNN: an arch2_4_combined of width NNN, or a compiled file).

    python -m benchmarks.serve --thread-split --models bundled,d256,d384,114m --rounds 21 --max-tokens 48 --json

--json writes one record (benchmarks/common/record.py) per level (server runs: tok_s is the aggregate), per B and
run (--engine-only) or per run and mode (--chunked-prefill: no tok_s); the run's extra has the usable cores.
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

from benchmarks.common.record import Run, add_json_argument

GEOMETRY_MODELS = ("tinyllama", "small")  # benchmarks.common.models geometries --models takes (Q4)
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
    elif which.endswith((".vflow", ".cflow")):  # a compiled file, as it is
        path = which
    elif which.startswith("d") and which[1:].isdigit():  # an arch2_4_combined geometry of width D (--thread-split)
        import attrs
        import torch

        from cflow.frontend.torch_module import from_torch
        from cflow.models import PipelineNativeLM, get_preset

        d = int(which[1:])
        cfg = attrs.evolve(get_preset("arch2_4_combined", "small"), vocab_size=16 * d, d_model=d,
                           n_heads=d // 64, n_kv_heads=d // 64, ffn_dim=4 * d, n_experts=8, expert_dim=2 * d,
                           max_seq_len=512)
        torch.manual_seed(0)
        path = os.path.join(out_dir, f"{which}.vflow")
        compile_file(from_torch(PipelineNativeLM(cfg).eval()), path, "q4")
    elif which in GEOMETRY_MODELS:  # a benchmark geometry (random weights), built once into out/bench
        from benchmarks.common.models import compiled_model

        path, _ = compiled_model(which)
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
    def __init__(self, path: str, threads: int | None, max_batch: int, max_queue: int, log: str,
                 speculate: str | None = None, extra: tuple[str, ...] = (), tree: str | None = None):
        self.port = free_port()
        cmd = [sys.executable, "-c", "from cflow.cli import cflow_main; raise SystemExit(cflow_main())"]
        cmd += ["serve", path, "--port", str(self.port), "--max-batch", str(max_batch), "--max-queue", str(max_queue),
                "--model-name", "m", "--log-level", "warning"] + (["--threads", str(threads)] if threads else [])
        cmd += ["--speculate", speculate] if speculate else []
        cmd += list(extra)
        self.log = open(log, "w")
        env = None
        if tree:  # another cflow checkout's package first on the path (benchmarks/common/process.py child_env)
            from benchmarks.common.process import child_env

            env = child_env(tree)
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
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
async def stream_once(port: int, body: dict, timeout: float, light: bool = False) -> dict:
    """One streaming request over HTTP/1.1 (chunked SSE). Returns sent, token times, usage, the server's timings
    and an error. light: parse only the events that carry usage, timings or an error, and take every other one
    for a text event (the client shares the server's cores: what it spends per token, the server waits for)."""
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
                        if light and not any(k in data for k in (b'"usage": {', b'"timings": ', b'"error": ')):
                            rec["times"].append(time.perf_counter())  # (those keys cannot appear inside a text)
                            continue
                        d = json.loads(data)
                        if "timings" in d:  # llama-server's, on the finishing chunk: the engine's clock
                            rec["timings"] = d["timings"]
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


def run_server(which: str, path: str, batch: int, counts, args, cpu: str, hdr: str, tmp: str,
               speculate: str | None = None) -> list[dict]:
    records = []
    label = which if not speculate else f"{which}+{speculate}"
    server = Server(path, args.threads, batch, args.max_queue, os.path.join(tmp, f"{label}_b{batch}.log"), speculate)
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
                       max_tokens=args.max_tokens, cpu=cpu, speculate=speculate)
            records.append(rec)
            print(f"{label:>8} {batch:>3} {n:>3} {rec['requests']:>5} {rec['aggregate_tok_s']:>9.1f} "
                  f"{rec['per_client_tok_s'] or 0:>12.1f} {rec['ttft_p50_ms']:>9.1f} "
                  f"{rec['ttft_p99_ms']:>8.1f} {rec['itl_p50_ms']:>8.2f} {rec['itl_p99_ms']:>7.2f} "
                  f"{rec['errors']:>6}" + (f"  {rec['error_examples']}" if rec["errors"] else ""), flush=True)
        rss1 = server.rss()
        # the prefix cache fills up to its budget with use: RSS may grow by that much, and no more
        held, budget = (_metric(server.port, f"cflow_prefix_cache_{k}") / 2**20 for k in ("bytes", "budget_bytes"))
        print(f"{which}, --max-batch {batch}: server RSS {rss0:.0f} MB before, {rss1:.0f} MB after "
              f"({rss1 - rss0:+.0f} MB; the prefix cache holds {held:.0f} of its {budget:.0f} MB)", flush=True)
        for rec in records:
            rec.update(rss_before_mb=round(rss0, 1), rss_after_mb=round(rss1, 1), prefix_cache_mb=round(held, 1),
                       prefix_cache_budget_mb=round(budget, 1))
    finally:
        server.close()
    return records


def _start_slots(be, slots, steps: int) -> None:
    """Give each slot an 8-token prompt (read to its end) and a sampler, as the engine does for a request."""
    from cflow.serve.job import SamplingParams

    class _Job:  # what a backend reads of a job
        def __init__(self, ids, params):
            self.prompt_ids, self.params = ids, params

    ctx = be.model.session.max_seq
    if 8 + 4 + 3 * steps > ctx:
        raise SystemExit(f"--steps {steps}: 3 rounds do not fit the context of {ctx} tokens")
    for s in slots:
        be.stop(s)
        ids = [1 + (7 * s + 3 * i) % 200 for i in range(8)]
        left = be.start(s, _Job(ids, SamplingParams(max_tokens=ctx - len(ids), temperature=0.8, seed=s)))
        while left:
            left = be.prefill(s)


def _best_round(be, slots, steps: int) -> float:
    """Seconds of the fastest of 3 rounds of `steps` advances of `slots` (after 4 warm-up steps; a slot that drew
    end-of-text still runs its step, so every step counts len(slots) tokens)."""
    for _ in range(4):
        be.advance(slots)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            be.advance(slots)
        best = min(best, time.perf_counter() - t0)
    return best


def engine_only(which: str, path: str, batches, threads: int | None, steps: int, run: int) -> list[dict]:
    """Aggregate decode tok/s of the serving backend with every slot busy, per --max-batch; and, for each B > 1,
    one slot decoding alone: slot 0 (BatchedSlots uses the single-sequence decode step) and slot 1 (a one-slot
    batch_step, the multi-token program)."""
    from cflow.serve.backends import load_backend

    records, base = [], None
    threads_n = threads or len(os.sched_getaffinity(0))
    for b in batches:
        be = load_backend(path, threads=threads, slots=b)
        try:
            slots = list(range(b))
            _start_slots(be, slots, steps)
            best = _best_round(be, slots, steps)
            alone = {}
            if b > 1:  # rounds of slot 0 alone and of slot 1 alone taken in turn, so that drift hits both alike
                _start_slots(be, [0, 1], steps)
                for _ in range(4):
                    be.advance([0])
                    be.advance([1])
                alone = {0: float("inf"), 1: float("inf")}
                for _ in range(3):
                    for s in (0, 1):
                        t0 = time.perf_counter()
                        for _ in range(steps):
                            be.advance([s])
                        alone[s] = min(alone[s], time.perf_counter() - t0)
        finally:
            be.close()
        tok = b * steps / best
        base = base or tok
        rec = {"model": which, "backend": type(be).__name__, "max_batch": b, "active": b, "threads": threads_n,
               "run": run, "aggregate_tok_s": round(tok, 1), "vs_first": round(tok / base, 2),
               "ms_per_step": round(1e3 * best / steps, 3), "per_stream_tok_s": round(tok / b, 1)}
        records.append(rec)
        print(f"{which:>8} B={b:>3}: {tok:8.0f} tok/s aggregate ({tok / base:4.2f}x), {rec['ms_per_step']:6.2f} ms "
              f"per step, {tok / b:7.0f} tok/s per stream", flush=True)
        for s, sec in alone.items():
            path_name = "decode step" if s == 0 else "multi-token program"
            records.append({"model": which, "backend": type(be).__name__, "max_batch": b, "active": 1, "slot": s,
                            "path": path_name, "threads": threads_n, "run": run,
                            "aggregate_tok_s": round(steps / sec, 1), "ms_per_step": round(1e3 * sec / steps, 3)})
        if alone:
            print(f"{'':>8} B={b:>3}, one slot decoding: slot 0 (decode step) {1e3 * alone[0] / steps:6.3f} ms, "
                  f"slot 1 (multi-token program) {1e3 * alone[1] / steps:6.3f} ms per step: "
                  f"{alone[1] / alone[0]:4.2f}x", flush=True)
    return records


def one_slot(which: str, path: str, threads: int | None, steps: int, run: int) -> list[dict]:
    """One stream decoding through the engine's backend both ways, rounds in turns: StreamSlots (m.stream's
    generator over one loaded model) and a one-slot BatchedSlots (max_batch=1: the single-sequence decode step
    through advance); the best of 3 rounds of `steps` tokens each, temperature 0.8, end-of-text ignored."""
    import cflow
    from cflow.serve.backends import BatchedSlots, StreamSlots

    models = [cflow.load(path, threads=threads), cflow.load(path, threads=threads, max_batch=1)]
    for m in models:  # no end-of-text: every advance is a decode step (StreamSlots' generator would end there)
        m.eos_ids = set()
    bes = {"StreamSlots": StreamSlots(models[:1]), "BatchedSlots": BatchedSlots(models[1])}
    best = dict.fromkeys(bes, float("inf"))
    try:
        for be in bes.values():
            _start_slots(be, [0], steps)
            for _ in range(4):
                be.advance([0])
        for _ in range(3):
            for name, be in bes.items():
                t0 = time.perf_counter()
                for _ in range(steps):
                    be.advance([0])
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        for be in bes.values():
            be.close()
    records = []
    for name, sec in best.items():
        records.append({"model": which, "backend": name, "max_batch": 1, "active": 1, "slot": 0, "run": run,
                        "path": "one slot", "threads": threads or len(os.sched_getaffinity(0)),
                        "aggregate_tok_s": round(steps / sec, 1), "ms_per_step": round(1e3 * sec / steps, 4)})
    print(f"{which:>8} one slot, run {run}: StreamSlots {records[0]['ms_per_step']:.4f} ms, BatchedSlots "
          f"{records[1]['ms_per_step']:.4f} ms per token ({best['StreamSlots'] / best['BatchedSlots']:.3f}x)",
          flush=True)
    return records


async def _prompt_beside_stream(be, long_ids):
    """(longest gap of the running stream, its tokens, the new request's TTFT) while long_ids are read."""
    from cflow.serve.engine import Engine
    from cflow.serve.job import Job, Piece, SamplingParams

    eng = Engine(be, max_queue=4)
    a = Job([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=len(long_ids), temperature=0.8, seed=1))
    b = Job(long_ids, SamplingParams(max_tokens=4, temperature=0.8, seed=2))
    eng.submit(a)
    times, sent, first_b = [], None, None

    async def first_token():
        nonlocal first_b
        async for ev in b.events():
            if isinstance(ev, Piece) and first_b is None:
                first_b = time.perf_counter()

    task = None
    async for ev in a.events():
        if isinstance(ev, Piece):
            times.append(time.perf_counter())
        if len(times) == 20 and task is None:
            sent = time.perf_counter()
            eng.submit(b)
            task = asyncio.create_task(first_token())
        if first_b is not None and times[-1] > first_b:
            break
    eng.cancel(a)
    await task
    await asyncio.to_thread(eng.close)
    window = [t for t in times if sent <= t <= first_b]
    gaps = [y - x for x, y in zip([sent] + window, window + [first_b])]
    return max(gaps), len(window), first_b - sent


def chunked_prefill(which: str, path: str, threads: int | None, prompt_len: int, runs: int) -> list[dict]:
    """A prompt of prompt_len tokens arrives while a stream decodes (engine with 8 slots, no HTTP). Read at once
    (the backend's piece set to the whole prompt: one prefill call, the same native calls) or one prefill block
    per loop turn (the default): the running stream's longest gap between two tokens and its tokens while the
    prompt is read, and the new request's time to first token."""
    from cflow.serve.backends import load_backend

    records = []
    rng = random.Random(1)
    long_ids = [rng.randrange(1, 1000) for _ in range(prompt_len)]
    for run in range(runs):
        for mode in ("at once", "blocks"):
            be = load_backend(path, threads=threads, slots=8)
            if be.model.session.max_seq < prompt_len + 16:
                raise SystemExit(f"--chunked-prefill {prompt_len}: no room in a context of {be.model.session.max_seq}")
            block = be.chunk
            if mode == "at once":
                be.chunk = prompt_len

            gap, got, ttft = asyncio.run(_prompt_beside_stream(be, long_ids))
            rec = {"model": which, "threads": threads or len(os.sched_getaffinity(0)), "max_batch": 8, "run": run,
                   "prompt_tokens": prompt_len, "prefill": mode, "prefill_block": block,
                   "longest_gap_s": round(gap, 3), "stream_tokens_meanwhile": got, "new_ttft_s": round(ttft, 3)}
            records.append(rec)
            print(f"{which:>8} run {run} {mode:>8}: running stream's longest gap {gap:6.3f} s, {got:3} tokens while "
                  f"the {prompt_len}-token prompt was read; its first token after {ttft:6.3f} s", flush=True)
    return records


OVERLAP_COUNTERS = ("cflow_steps_ahead_total", "cflow_steps_ahead_dropped_total", "cflow_backoffs_total",
                    "cflow_calls_in_turn_total")


def _metrics(port: int, names, missing: float = float("nan")) -> dict[str, float]:
    """Samples of a server's /metrics, one request for all (`missing` for a name it does not report)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        found = dict(line.rsplit(" ", 1) for line in r.read().decode().splitlines()
                     if line.split(" ", 1)[0] in names)
    return {n: float(found.get(n, missing)) for n in names}


def _metric(port: int, name: str) -> float:
    return _metrics(port, (name,))[name]


def _ttft(port: int, ids: list[int]) -> float:
    """Seconds from sending a streaming greedy request for `ids` to its first token."""
    body = {"model": "m", "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True}
    rec = asyncio.run(stream_once(port, body, 600.0))
    if rec["error"] or not rec["times"]:
        raise SystemExit(f"a --prefix request failed: {rec['error'] or 'no token'}")
    return rec["times"][0] - rec["sent"]


def prefix_ttft(which: str, path: str, batches, args, tmp: str) -> list[dict]:
    """Time to first token of a prompt of --prefix shared tokens and --new new ones, with the prefix cache off
    (--cache-mb 0: every request reads its whole prompt) and on (the default budget: an earlier request read the
    shared prefix, so only the last partial block and the new tokens are read). Two servers at once, one each way,
    per --max-batch; requests one at a time, in turns (off, on, off, ...), so that drift on the host hits both;
    each prompt's new tokens are fresh random ids. The server with the cache reads the shared prefix once first
    (that request is not counted)."""
    rng = random.Random(7)
    records = []
    for batch in batches:
        servers = {mode: Server(path, args.threads, batch, args.max_queue,
                                os.path.join(tmp, f"{which}_b{batch}_cache_{mode}.log"),
                                extra=("--cache-mb", "0") if mode == "off" else ())
                   for mode in ("off", "on")}
        try:
            vocab = 1000 if which not in GEOMETRY_MODELS else 32000
            shared = [rng.randrange(1, vocab) for _ in range(args.prefix)]
            for srv in servers.values():  # warm-up: first touch of the weights (a short prompt)
                _ttft(srv.port, [1, 2, 3])
            # the shared prefix read once by the server with the cache; then each way in turns, fresh new tokens
            first = _ttft(servers["on"].port, shared + [rng.randrange(1, vocab) for _ in range(args.new)])
            ttft = {"off": [], "on": []}
            for _ in range(args.rounds):
                for mode in ("off", "on"):
                    new = [rng.randrange(1, vocab) for _ in range(args.new)]
                    ttft[mode].append(_ttft(servers[mode].port, shared + new))
            hits = _metric(servers["on"].port, "cflow_prefix_cache_hits_total")
            hit_tokens = _metric(servers["on"].port, "cflow_prefix_cache_hit_tokens_total")
            held = _metric(servers["on"].port, "cflow_prefix_cache_bytes")
        finally:
            for srv in servers.values():
                srv.close()
        off, on = statistics.median(ttft["off"]), statistics.median(ttft["on"])
        rec = {"model": which, "max_batch": batch, "threads": args.threads or len(os.sched_getaffinity(0)),
               "prefix_tokens": args.prefix, "new_tokens": args.new, "rounds": args.rounds,
               "ttft_off_s": [round(t, 4) for t in ttft["off"]], "ttft_on_s": [round(t, 4) for t in ttft["on"]],
               "ttft_off_median_s": round(off, 4), "ttft_on_median_s": round(on, 4),
               "ttft_on_vs_off": round(on / off, 4), "first_with_cache_s": round(first, 4),
               "cache_hits": hits, "cache_hit_tokens": hit_tokens, "cache_bytes": held}
        records.append(rec)
        print(f"{which:>9} --max-batch {batch}: TTFT of {args.prefix} shared + {args.new} new tokens: cache off "
              f"{off * 1e3:8.1f} ms, on {on * 1e3:7.1f} ms (median of {args.rounds}): {on / off:6.1%} "
              f"(the first request with the cache: {first * 1e3:.1f} ms; {hits:.0f} hits, {hit_tokens:.0f} tokens "
              f"copied, {held / 2**20:.1f} MiB held)", flush=True)
    return records


SHAPES = {
    "person": {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}},
                                         "city": {"type": "string"}},
        "required": ["name", "age", "pets", "city"], "additionalProperties": False}}}},
    "json_object": {"response_format": {"type": "json_object"}},
    "gbnf": {"grammar": 'root ::= sentence (" " sentence)*\nsentence ::= [A-Z] [a-z ,]{5,60} "."'},
}


def shape_cost(which: str, path: str, args, tmp: str, load: str = "none") -> list[dict]:
    """What structured output costs per served token: one server (--max-batch 1) per --overlap mode, requests one
    at a time in turns (the modes alternating request by request), free text and each shape of SHAPES, the same
    prompts, temperature 0.8, fresh seeds; per request the time between two tokens by the server's clock (the
    `timings` of its last chunk, llama-server's: first to last token handed out / intervals; the HTTP side works on
    the same cores meanwhile) and as the client saw it (request sent to last token / tokens, the prompt included:
    the client is a third process on the same cores, and a server that falls behind writes several tokens'
    events at once), medians compared. Records from before 1400f46 have the client's first-to-last event in
    per_token_us; from it on, the server's clock there and the client's in client_per_token_us. The texts
    differ (a grammar makes the model write something else), the model's step per token does not: the
    difference is the sampler's and the grammar's work per token. Modes: `on` (the server's default: where
    --threads leaves a core free, the next step runs while a token is handed out), `off` (--no-overlap). load:
    benchmarks/load.py's (`none`, `spin`, `spin-pinned`), running from before the servers start to the end; the
    share of the cores other processes used leaves it out."""
    from benchmarks.common.timing import cpu_ticks, other_load
    from benchmarks.load import start_load, stop_load

    label = os.path.basename(which)
    # --baseline: each mode also served by that tree's cflow ("on@base"), requests alternating over all of them
    modes = args.overlap + ([f"{m}@base" for m in args.overlap] if args.baseline else [])
    spinner, servers = start_load(load), {}
    per_token: dict[tuple[str, str], list[float]] = {(m, k): [] for m in modes for k in ("free", *SHAPES)}
    client: dict[tuple[str, str], list[float]] = {key: [] for key in per_token}
    ttft: dict[tuple[str, str], list[float]] = {key: [] for key in per_token}
    counts: dict[tuple[str, str], dict[str, float]] = {key: dict.fromkeys(OVERLAP_COUNTERS, 0.0) for key in per_token}
    rng = random.Random(3)
    try:
        for m in modes:
            servers[m] = Server(path, args.threads, 1, args.max_queue, os.path.join(tmp, f"{label}_shapes_{m}.log"),
                                extra=("--no-overlap",) if m.startswith("off") else (),
                                tree=args.baseline if m.endswith("@base") else None)
        for server in servers.values():
            asyncio.run(stream_once(server.port, {"model": "m", "prompt": "Once", "max_tokens": 8, "stream": True},
                                    60))
        # the overlap counters after each server's last request (0 where a server predates them): a request's
        # share is the difference after it, one /metrics read a request, between requests
        seen = {m: _metrics(servers[m].port, OVERLAP_COUNTERS, 0.0) for m in modes}
        pids = tuple(server.p.pid for server in servers.values()) + ((spinner.pid,) if spinner else ())
        ticks = cpu_ticks(pids)
        for r in range(args.rounds):
            for kind in ("free", *SHAPES):
                body = {"model": "m", "prompt": STORY_PROMPTS[r % len(STORY_PROMPTS)], "max_tokens": args.max_tokens,
                        "temperature": 0.8, "seed": rng.randrange(2**31), "stream": True,
                        "stream_options": {"include_usage": True}, **SHAPES.get(kind, {})}
                for m in (modes if r % 2 == 0 else modes[::-1]):  # the same request to each, in turns
                    rec = asyncio.run(stream_once(servers[m].port, body, 120, light=True))
                    now = _metrics(servers[m].port, OVERLAP_COUNTERS, 0.0)
                    for n, v in now.items():
                        counts[m, kind][n] += v - seen[m][n]
                    seen[m] = now
                    if rec["error"]:
                        raise SystemExit(f"a --shapes request failed: {rec['error']}")
                    if rec.get("timings") is None:
                        raise SystemExit("a --shapes answer carried no timings: the server predates them "
                                         "(llama-server's timings, cflow/serve/job.py Job.timings)")
                    if rec["tokens"] > 8:
                        per_token[m, kind].append(rec["timings"]["predicted_per_token_ms"] / 1e3)
                        client[m, kind].append((rec["times"][-1] - rec["sent"]) / rec["tokens"])
                        ttft[m, kind].append(rec["times"][0] - rec["sent"])
        busy = other_load(ticks, cpu_ticks(pids))
    finally:
        for server in servers.values():
            server.close()
        stop_load(spinner)
    records = []
    for (m, kind), ts in per_token.items():
        c = counts[m, kind]  # this kind's requests' share of the server's overlap counters
        free, med = statistics.median(per_token[m, "free"]), statistics.median(ts)
        cfree, cmed = statistics.median(client[m, "free"]), statistics.median(client[m, kind])
        records.append({"model": which, "shape": kind, "overlap": m, "load": load,
                        "threads": args.threads or len(os.sched_getaffinity(0)),
                        "requests": len(ts), "per_token_us": round(med * 1e6, 1), "vs_free": round(med / free, 4),
                        "client_per_token_us": round(cmed * 1e6, 1), "client_vs_free": round(cmed / cfree, 4),
                        "ttft_ms": round(statistics.median(ttft[m, kind]) * 1e3, 3),
                        "other_load": round(busy, 3), "per_request_us": [round(x * 1e6, 1) for x in ts],
                        **{n.removeprefix("cflow_").removesuffix("_total"): int(v) for n, v in c.items()}})
        print(f"{which:>8} {kind:>12}, overlap {m:>7}, load {load:>4}: {med * 1e6:7.1f} us a served token (the "
              f"server's timings, median of {len(ts)} requests), {med / free - 1:+6.1%} against free text; the "
              f"client's {cmed * 1e6:7.1f} us, {cmed / cfree - 1:+6.1%}; first token after "
              f"{statistics.median(ttft[m, kind]) * 1e3:5.2f} ms", flush=True)
        print(f"{'':>22} steps launched ahead {int(c['cflow_steps_ahead_total'])}, dropped "
              f"{int(c['cflow_steps_ahead_dropped_total'])}; backed off {int(c['cflow_backoffs_total'])} times, "
              f"{int(c['cflow_calls_in_turn_total'])} calls in turn", flush=True)
    print(f"# other processes used {busy:.0%} of the {len(os.sched_getaffinity(0))} cores meanwhile", flush=True)
    return records


def thread_split(which: str, path: str, args, tmp: str) -> list[dict]:
    """--thread-split: a served token's time, free text, with the step on every usable core (the default threads
    without the overlap, as before it: the engine thread is the step's first thread) against the step on one core
    fewer with the overlap (the engine's and the HTTP side's work on a token runs while the next step does: what
    `cflow serve` picks by default for a small model, serve/backends.py OVERLAP_BELOW); one server each, the same
    requests alternating between them."""
    from cflow.serve.backends import token_bytes

    cores = len(os.sched_getaffinity(0))
    # all cores as the default threads take them (backing off to one thread under load: runtime/workers.py)
    ways = {"all cores": (None, ("--no-overlap",)), "one core fewer, overlap": (cores - 1, ())}
    label = os.path.basename(which)  # a compiled file's name, not its path
    servers = {k: Server(path, t, 1, args.max_queue, os.path.join(tmp, f"{label}_split_{t}.log"), extra=x)
               for k, (t, x) in ways.items()}
    text = which == "bundled"
    per: dict[str, list[float]] = {k: [] for k in ways}
    try:
        for r in range(args.rounds):
            prompt = STORY_PROMPTS[r % len(STORY_PROMPTS)] if text else [1, 5, 9, 33, 7, 1 + r % 50]
            body = {"model": "m", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": r,
                    "stream": True}
            for k in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                rec = asyncio.run(stream_once(servers[k].port, body, 300))
                if rec["error"]:
                    raise SystemExit(f"a --thread-split request failed: {rec['error']}")
                t = rec["times"]
                if len(t) > 8:
                    per[k].append((t[-1] - t[0]) / (len(t) - 1))
    finally:
        for server in servers.values():
            server.close()
    med = {k: statistics.median(v) for k, v in per.items()}
    mb = token_bytes(path) / 1e6
    ratio = med["one core fewer, overlap"] / med["all cores"]
    print(f"{which:>8} ({mb:7.1f} MB a token): all {cores} cores {med['all cores'] * 1e6:9.1f} us a served token, "
          f"{cores - 1} and the overlap {med['one core fewer, overlap'] * 1e6:9.1f} us: {ratio:.2f}x the time "
          f"(medians of {len(per['all cores'])} requests)", flush=True)
    return [{"model": which, "split": k, "threads": ways[k][0] or cores, "token_mb": round(mb, 3), "requests": len(v),
             "per_token_us": round(med[k] * 1e6, 1), "vs_all_cores": round(med[k] / med["all cores"], 4),
             "per_request_us": [round(x * 1e6, 1) for x in v]} for k, v in per.items()]


def shape_cost_engine(which: str, path: str, args) -> list[dict]:
    """--shapes --engine-only: the engine's side of a served token for each output shape, in this process (no HTTP,
    no other thread): a one-slot BatchedSlots and the Job the server makes for the request (its Chooser over the
    request's grammar, its detokenizer), the same prompts, turns and temperature as --shapes. Per token the thread
    CPU time of the decode step, of the Chooser and of the whole turn (step, sampling, text), and, timed in
    rounds of their own (every other one: the timing costs a little on each call), of the grammar's calls within
    the Chooser (the constraint's methods: the engine's consume and masks). CPU time, not wall time, so that a
    shared machine's preemptions stay out of it (its cache traffic does not)."""
    import cflow
    from cflow.serve.backends import BatchedSlots
    from cflow.serve.protocol import CompletionRequest
    from cflow.serve.shaping import constraint_factory

    cpu = time.thread_time_ns
    m = cflow.load(path, threads=args.threads, max_batch=1)
    kinds = ("free", *SHAPES)
    spent = {k: {"turn": 0, "step": 0, "chooser": 0, "tokens": 0, "grammar": 0, "grammar_tokens": 0} for k in kinds}
    try:
        backend, loop, tok = BatchedSlots(m), asyncio.new_event_loop(), m.tokenizer
        stops = frozenset(m.eos_ids)
        makers = {k: constraint_factory(CompletionRequest(model="m", prompt="x", **SHAPES.get(k, {})), tok, stops)
                  for k in kinds}
        step, now = m.session.step, [None]

        def timed_step(t):
            a = cpu()
            out = step(t)
            if now[0] is not None:
                now[0]["step"] += cpu() - a
            return out

        m.session.step = timed_step
        rng = random.Random(3)
        for r in range(args.rounds):
            for kind in kinds:
                make, acc = makers[kind], spent[kind]
                grammar = make() if make else None
                if grammar is not None and r % 2:
                    grammar = _TimedConstraint(grammar, acc, cpu)
                job = _engine_job(backend, tok, loop, r, rng.randrange(2**31), args.max_tokens, grammar,
                                  min(stops) if make else None)
                counts = {"turn": 0, "step": 0, "chooser": 0, "tokens": 0}
                backend._sampler[0] = _TimedChooser(backend._sampler[0], counts, cpu)
                now[0] = counts
                a = cpu()
                counts["tokens"] += _decode_job(backend, job)
                counts["turn"] += cpu() - a
                now[0] = None
                backend.stop(0)
                if r % 2:  # the grammar's calls timed: its share only
                    acc["grammar_tokens"] += counts["tokens"]
                else:
                    for k, v in counts.items():
                        acc[k] += v
    finally:
        m.close()
    records = []
    free = spent["free"]["turn"] / spent["free"]["tokens"]
    for kind, acc in spent.items():
        n = acc["tokens"]
        turn, st, ch = (acc[k] / n / 1e3 for k in ("turn", "step", "chooser"))
        gr = acc["grammar"] / max(acc["grammar_tokens"], 1) / 1e3
        records.append({"model": which, "shape": kind, "threads": args.threads or len(os.sched_getaffinity(0)),
                        "engine_only": True, "tokens": n, "cpu_turn_us": round(turn, 1), "cpu_step_us": round(st, 1),
                        "cpu_chooser_us": round(ch, 1), "cpu_grammar_us": round(gr, 1),
                        "vs_free": round(turn * 1e3 / free, 4)})
        print(f"{which:>8} {kind:>12}: {turn:6.1f} us of thread CPU a token (step {st:6.1f}, chooser {ch:5.1f}, of "
              f"which grammar {gr:4.1f}), {turn * 1e3 / free - 1:+6.1%} against free text ({n} tokens)", flush=True)
    return records


def shape_cost_overlap(which: str, path: str, args) -> list[dict]:
    """--shapes --engine-only --overlap on: the engine's side of a served token when the step runs detached (what
    the server does where the step leaves it a core), in this process, no HTTP: a one-slot BatchedSlots over the
    model loaded detached, the Job the server makes, the same prompts and turns as --shapes. Per token, in wall
    time: the turn, and the host's work between a step's end and the next step's start (`critical`: the work
    the step cannot hide: the guess, or the Chooser where it masks first, and the launch), the wait for the step
    and the steps launched ahead on a guess the grammar then refused (dropped)."""
    import cflow
    from cflow.serve.backends import BatchedSlots
    from cflow.serve.protocol import CompletionRequest
    from cflow.serve.shaping import constraint_factory

    clock = time.perf_counter_ns
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) - 1)
    m = cflow.load(path, threads=threads, max_batch=1, detached=True)
    kinds = ("free", *SHAPES)
    spent = {k: {"turn": 0, "critical": 0, "wait": 0, "tokens": 0, "dropped": 0} for k in kinds}
    try:
        backend, loop, tok = BatchedSlots(m), asyncio.new_event_loop(), m.tokenizer
        stops = frozenset(m.eos_ids)
        makers = {k: constraint_factory(CompletionRequest(model="m", prompt="x", **SHAPES.get(k, {})), tok, stops)
                  for k in kinds}
        session, acc_now, ready, charged = m.session, [None], [None], [0]
        launch, wait = session.step_launch, session.step_wait

        def timed_launch(t):
            # from the step's end to the last launch before the next wait (a refused guess's step is dropped and
            # another launched: both count)
            if acc_now[0] is not None and ready[0] is not None:
                spent = clock() - ready[0]
                acc_now[0]["critical"] += spent - charged[0]
                charged[0] = spent
            launch(t)

        def timed_wait():
            a = clock()
            out = wait()
            ready[0], charged[0] = clock(), 0
            if acc_now[0] is not None:
                acc_now[0]["wait"] += ready[0] - a
            return out

        session.step_launch, session.step_wait = timed_launch, timed_wait
        rng = random.Random(3)
        for r in range(args.rounds):
            for kind in kinds:
                make, acc = makers[kind], spent[kind]
                job = _engine_job(backend, tok, loop, r, rng.randrange(2**31), args.max_tokens,
                                  make() if make else None, min(stops) if make else None)
                dropped0 = backend.ahead_dropped
                acc_now[0], ready[0] = acc, None
                a = clock()
                acc["tokens"] += _decode_job(backend, job)
                acc["turn"] += clock() - a
                acc_now[0] = None
                acc["dropped"] += backend.ahead_dropped - dropped0  # refused guesses (not the stop's drop below)
                backend.stop(0)
    finally:
        m.close()
    records = []
    free = spent["free"]["turn"] / spent["free"]["tokens"]
    for kind, acc in spent.items():
        n = acc["tokens"]
        turn, crit, wt = (acc[k] / n / 1e3 for k in ("turn", "critical", "wait"))
        records.append({"model": which, "shape": kind, "threads": threads, "engine_only": True, "overlap": "on",
                        "tokens": n, "wall_turn_us": round(turn, 1), "critical_us": round(crit, 1),
                        "wait_us": round(wt, 1), "dropped_per_token": round(acc["dropped"] / n, 4),
                        "vs_free": round(turn * 1e3 / free, 4)})
        print(f"{which:>8} {kind:>12}, overlap on: {turn:6.1f} us a token (host work between steps {crit:5.1f}, "
              f"waiting for the step {wt:5.1f}; {acc['dropped'] / n:.3f} steps dropped a token), "
              f"{turn * 1e3 / free - 1:+6.1%} against free text ({n} tokens)", flush=True)
    return records


def _engine_job(backend, tok, loop, r: int, seed: int, max_tokens: int, constraint, eos_id):
    """--engine-only's request r (the story prompts in turn, temperature 0.8), started in slot 0 and its prompt
    read; no client: the text is made, not sent."""
    from cflow.serve.job import Job, SamplingParams

    job = Job(tok.encode(STORY_PROMPTS[r % len(STORY_PROMPTS)]),
              SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed), tok, loop=loop,
              constraint=constraint, eos_id=eos_id)
    job._emit = lambda ev: None
    left = backend.start(0, job)
    while left:
        left = backend.prefill(0)
    return job


def _decode_job(backend, job) -> int:
    """Slot 0's tokens until the job ends (the engine's loop without its queue): how many."""
    n = 0
    while True:
        out = backend.advance([0])[0]
        if out is None or isinstance(out, BaseException):
            return n
        n += 1
        if job._feed(out) is not None:
            return n


class _TimedConstraint:
    """A grammar constraint whose calls add their thread CPU time to acc["grammar"]."""

    def __init__(self, constraint, acc, clock):
        self.c, self.acc, self.clock = constraint, acc, clock

    def _timed(self, f, *a):
        t = self.clock()
        out = f(*a)
        self.acc["grammar"] += self.clock() - t
        return out

    def __getattr__(self, name):  # allowed, accept, and try_accept and forced where the constraint has them
        f = getattr(self.c, name)
        return lambda *a: self._timed(f, *a)

    @property
    def finished(self):
        return self._timed(lambda: self.c.finished)


class _TimedChooser:
    """A Chooser whose calls add their thread CPU time to acc["chooser"]."""

    def __init__(self, chooser, acc, clock):
        self.chooser, self.acc, self.clock = chooser, acc, clock

    def __call__(self, logits):
        a = self.clock()
        tok = self.chooser(logits)
        self.acc["chooser"] += self.clock() - a
        return tok

    def __getattr__(self, name):
        return getattr(self.chooser, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bundled,114m",
                   help="bundled, preset sizes (114m) and/or benchmark geometries (tinyllama) (default bundled,114m)")
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
    add_json_argument(p, "write the records")
    p.add_argument("--engine-only", action="store_true",
                   help="measure the backend alone, no server or clients (see above) (default: off)")
    p.add_argument("--steps", type=int, default=50,
                   help="--engine-only, --one-slot: decode steps per round (default 50)")
    p.add_argument("--one-slot", action="store_true",
                   help="one stream decoding through StreamSlots and through a one-slot BatchedSlots, in turns "
                   "(engine only, no HTTP) (default: off)")
    p.add_argument("--chunked-prefill", type=int, default=None, metavar="TOKENS",
                   help="measure a prompt of TOKENS tokens arriving beside a decoding stream, read at once and in "
                   "prefill blocks (engine only, --max-batch 8; see above) (default: off)")
    p.add_argument("--speculate", default=None, metavar="KINDS",
                   help="also serve with `--speculate KIND` for each of these (ngram), each level run with and "
                   "without in the same run (default: without only)")
    p.add_argument("--prefix", type=int, default=None, metavar="TOKENS",
                   help="time to first token of TOKENS shared + --new new prompt tokens with the prefix cache off "
                   "and on (servers of each --max-batch, requests one at a time; see above) (default: off)")
    p.add_argument("--shapes", action="store_true",
                   help="what structured output costs per served token: free text against each shape (response_format "
                   "json_schema / json_object, a GBNF grammar), one server, requests in turns (default: off)")
    p.add_argument("--new", type=int, default=20, help="--prefix: new tokens after the shared ones (default 20)")
    p.add_argument("--thread-split", action="store_true",
                   help="a served token's time with the step on every core against one core fewer with the overlap "
                   "(the engine's work hidden behind the next step); --models takes bundled, 114m, dNNN (an "
                   "arch2_4_combined of width NNN) and .vflow paths")
    p.add_argument("--overlap", type=lambda v: v.split(","), default=["on"],
                   help="--shapes: the server's overlap modes, each its own server, requests alternating: on (the "
                   "default: the next step runs while a token is handed out, where --threads leaves a core free), "
                   "off (--no-overlap); with --engine-only: on, the step detached (wall time), off, in turn (thread "
                   "CPU time); e.g. on,off (default on)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="--shapes: each --overlap mode also served by DIR's cflow (another checkout), requests "
                   "alternating; recorded as MODE@base (default: off)")
    p.add_argument("--load", default="none",
                   help="--shapes: comma-separated background loads, a set of servers each: none, spin, spin-pinned "
                   "(benchmarks/load.py's; default none)")
    p.add_argument("--rounds", type=int, default=5, help="--prefix, --shapes: requests each way (default 5)")
    p.add_argument("--repeat", type=int, default=1,
                   help="--engine-only, --chunked-prefill: runs, every one recorded (default 1)")
    args = p.parse_args(argv)
    run = Run("serve", argv)
    if args.quick:
        args.duration, args.drain = 5.0, 30.0
    counts = [int(x) for x in args.clients.split(",")]
    records = []
    from cflow.codegen.target import cpu_model

    cpu = cpu_model()
    load_test = not (args.prefix or args.one_slot or args.engine_only or args.chunked_prefill or args.shapes
                     or args.thread_split)
    print(f"# cflow serve{' load test' if load_test else ''}: {cpu}, {len(os.sched_getaffinity(0))} usable cores; "
          f"--threads {args.threads or 'default'}" + (f" --max-queue {args.max_queue}; {args.max_tokens} tokens per "
                                                      f"request, {args.duration:g} s per level" if load_test else ""),
          flush=True)
    hdr = (f"{'model':>8} {'B':>3} {'N':>3} {'reqs':>5} {'agg tok/s':>9} {'client tok/s':>12} {'TTFT p50':>9} "
           f"{'p99 ms':>8} {'ITL p50':>8} {'p99 ms':>7} {'errors':>6}")
    with tempfile.TemporaryDirectory(prefix="cflow-serve-bench-") as tmp:
        for which in args.models.split(","):
            path = compile_model(which, tmp)
            batches = [int(b) for b in args.max_batch.split(",")]
            if args.chunked_prefill:
                records += chunked_prefill(which, path, args.threads, args.chunked_prefill, args.repeat)
                continue
            if args.prefix:
                records += prefix_ttft(which, path, batches, args, tmp)
                continue
            if args.thread_split:
                records += thread_split(which, path, args, tmp)
                continue
            if args.shapes and args.engine_only:
                for mode in args.overlap:
                    records += (shape_cost_overlap if mode == "on" else shape_cost_engine)(which, path, args)
                continue
            if args.shapes:
                for load in args.load.split(","):
                    records += shape_cost(which, path, args, tmp, load)
                continue
            if args.one_slot:
                for r in range(args.repeat):
                    records += one_slot(which, path, args.threads, args.steps, r)
                continue
            if args.engine_only:
                for r in range(args.repeat):
                    records += engine_only(which, path, batches, args.threads, args.steps, r)
                continue
            for batch in batches:
                for spec in [None, *(args.speculate.split(",") if args.speculate else [])]:
                    records += run_server(which, path, batch, counts, args, cpu, hdr, tmp, spec)
    run.write(args.json, [schema_record(run, r) for r in records], {"usable_cores": len(os.sched_getaffinity(0))})
    return 0


def schema_record(run: Run, r: dict) -> dict:
    """One measurement of this benchmark as a record of the schema: the variant says which kind it is."""
    if "clients" in r:
        variant, tok_s = f"server, max-batch {r['max_batch']}, {r['clients']} clients", r["aggregate_tok_s"]
        if r.get("speculate"):
            variant += f", speculate {r['speculate']}"
    elif "prefill" in r:
        variant, tok_s = f"{r['prompt_tokens']}-token prompt beside a stream, read {r['prefill']}", None
    elif "prefix_tokens" in r:
        variant = f"server, max-batch {r['max_batch']}, TTFT of {r['prefix_tokens']} cached + {r['new_tokens']} new"
        tok_s = None
    elif "shape" in r and r.get("engine_only") and r.get("overlap") == "on":
        variant, tok_s = f"engine, max-batch 1, output {r['shape']}, detached, wall", 1e6 / r["wall_turn_us"]
    elif "shape" in r and r.get("engine_only"):
        variant, tok_s = f"engine, max-batch 1, output {r['shape']}, thread CPU", 1e6 / r["cpu_turn_us"]
    elif "shape" in r:
        variant = f"server, max-batch 1, output {r['shape']}, overlap {r['overlap']}"
        variant += f", load {r['load']}" if r.get("load", "none") != "none" else ""
        tok_s = 1e6 / r["per_token_us"]
    elif "split" in r:
        variant, tok_s = f"server, max-batch 1, {r['threads']} threads ({r['split']})", 1e6 / r["per_token_us"]
    elif r.get("path") == "one slot":
        variant, tok_s = f"engine, one slot, {r['backend']}", r["aggregate_tok_s"]
    elif "slot" in r:
        variant, tok_s = f"engine, max-batch {r['max_batch']}, slot {r['slot']} alone", r["aggregate_tok_s"]
    else:
        variant, tok_s = f"engine, max-batch {r['max_batch']}", r["aggregate_tok_s"]
    if r["model"] in GEOMETRY_MODELS:
        from benchmarks.common.models import MODELS

        model = MODELS[r["model"]].name
    else:
        model = (r["model"] if r["model"] == "bundled" or r["model"].endswith((".vflow", ".cflow"))
                 else f"arch2_4_combined@{r['model']}")
    return run.record(engine="cflow", model=model, quant="q4", threads=r["threads"], variant=variant, tok_s=tok_s,
                      **{k: v for k, v in r.items() if k not in ("model", "threads", "cpu")})


if __name__ == "__main__":
    sys.exit(main())
