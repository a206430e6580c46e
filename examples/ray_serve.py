"""Scale out with Ray Serve: N replicas of one cflow engine behind Ray's HTTP proxy (docs/serving.md).

    pip install -e ".[serve]"                                                 # fastapi, uvicorn, ray[serve], ...
    python examples/ray_serve.py model.vflow --replicas 2 --threads 1         # two replicas, one core each
    python examples/ray_serve.py model.vflow --autoscale 1:4 --threads 2      # 1..4 replicas, on queue length
    ray start --head --num-cpus 8   (+ `ray start --address=HEAD:6379` on the other machines), then
    python examples/ray_serve.py /same/path/model.vflow --address auto --host 0.0.0.0 --replicas 4 --api-key KEY

Each replica is a Ray actor (a process of its own) holding exactly what `cflow serve` runs: one engine thread
that owns the model, its queue and slots, and the same FastAPI app (so the API, errors, streaming, /metrics
and the --api-key check are the same). Its threads are pinned to cores of its own (replica rank r takes
cores [r*threads, (r+1)*threads) modulo the machine), so replicas do not fight over caches and memory
channels. Ray's proxy routes each request to the replica with the shorter queue; each replica takes
`max_batch + max_queue` requests at once (its engine's capacity), further ones wait in Ray's proxy. With
--autoscale Ray adds replicas while the requests in flight per replica stay above `--target` and removes
them when they fall. We write no balancer: Ray Serve is the distributed engine.

Every response names its replica in the header `x-cflow-instance` (and /health says it), which is how the
test checks that both replicas answer. Ray's usage statistics are switched off; with a loopback --host every
Ray address is 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray's single-machine mode). Ctrl-C or SIGTERM
to this process shuts Serve and Ray down (signal this process, not its whole group: Ray's own processes must
outlive the shutdown calls).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def pin_threads(threads: int, rank: int) -> list[int]:
    """Pin every thread of this process (and the ones it starts later) to `threads` cores chosen by `rank`."""
    cores = sorted(os.sched_getaffinity(0))
    k = max(1, min(threads, len(cores)))
    first = (rank * k) % len(cores)
    chosen = sorted({cores[(first + i) % len(cores)] for i in range(k)})
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), chosen)
        except OSError:  # a thread that just ended
            pass
    return chosen


def cflow_app(path: str, threads: int = 1, max_batch: int = 8, max_queue: int = 16, api_key: str | None = None,
              model_id: str | None = None, replicas: int = 2, autoscale: tuple[int, int] | None = None,
              target: float | None = None):
    """The Ray Serve application: one deployment whose replicas each load `path` into a cflow engine."""
    from ray import serve

    opts: dict = {"ray_actor_options": {"num_cpus": threads}, "max_ongoing_requests": max_batch + max_queue,
                  "health_check_period_s": 5}
    if autoscale:
        lo, hi = autoscale
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                      "target_ongoing_requests": target or max(1.0, float(max_batch)),
                                      "upscale_delay_s": 3, "downscale_delay_s": 30}
    else:
        opts["num_replicas"] = replicas

    @serve.deployment(name="cflow", **opts)
    @serve.ingress()
    class CflowReplica:
        def __init__(self):
            ctx = serve.get_replica_context()
            rank = getattr(getattr(ctx, "rank", None), "local_rank", None)
            if rank is None:  # older Ray: no ranks; spread by the replica's id
                rank = int.from_bytes(ctx.replica_tag.encode()[-4:], "little")
            self.cores = pin_threads(threads, rank)  # before the model starts its worker threads
            from cflow.serve.app import build_app

            self.asgi = build_app(path, threads=threads, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                                  model_id=model_id, instance=f"{ctx.replica_tag}@cpu{','.join(map(str, self.cores))}")

        def __serve_build_asgi_app__(self):
            return self.asgi

        def check_health(self):  # Ray restarts a replica whose engine died
            if not self.asgi.state.engine.alive:
                raise RuntimeError("the cflow engine is not running")

    return CflowReplica.bind()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--host", default="127.0.0.1", help="address of Ray's HTTP proxy (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port of Ray's HTTP proxy (default 8000)")
    p.add_argument("--replicas", type=int, default=2, help="replicas without --autoscale (default 2)")
    p.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="autoscale between MIN and MAX replicas on requests in flight (default: fixed --replicas)")
    p.add_argument("--target", type=float, default=None,
                   help="with --autoscale: requests in flight per replica to aim for (default: --max-batch)")
    p.add_argument("--threads", type=int, default=1, help="threads (pinned cores) per replica (default 1)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences generated together per replica (default 8)")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting per replica (default 16)")
    p.add_argument("--api-key", default=None, help="require this bearer key on /v1/* (default: none)")
    p.add_argument("--model-name", default=None, help="model id (default: the file name without extension)")
    p.add_argument("--address", default="local",
                   help="Ray cluster: 'local' starts one on this machine; 'auto' or HOST:PORT joins one started with "
                   "`ray start --head` / `ray start --address=...` (default local)")
    args = p.parse_args(argv)
    autoscale = tuple(int(x) for x in args.autoscale.split(":")) if args.autoscale else None

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports leave the machine
    local = args.host in ("127.0.0.1", "localhost")
    if local:  # one machine: every Ray address (GCS, raylet, workers) on 127.0.0.1, not the host's own IP
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    if args.address == "local":  # a cluster of this machine alone, sized to the cores we may use
        ray.init(address="local", include_dashboard=False, num_cpus=len(os.sched_getaffinity(0)),
                 object_store_memory=100 * 2**20, logging_level="warning", log_to_driver=False)
    else:  # a running cluster: its nodes' resources are already declared (ray start --num-cpus ...)
        ray.init(address=args.address, logging_level="warning", log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, proxy_location="HeadOnly")
        serve.run(cflow_app(os.path.abspath(args.file), args.threads, args.max_batch, args.max_queue, args.api_key,
                            args.model_name, args.replicas, autoscale, args.target), name="cflow", route_prefix="/")
        n = f"{autoscale[0]}..{autoscale[1]}" if autoscale else str(args.replicas)
        print(f"ready: {n} cflow replicas on http://{args.host}:{args.port}/v1", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        done = threading.Event()

        def watchdog():  # a cluster that lost a process can hang the shutdown calls: do not hang with it
            if not done.wait(60):
                print("ray_serve.py: shutdown did not finish in 60 s, exiting", file=sys.stderr, flush=True)
                os._exit(1)

        threading.Thread(target=watchdog, daemon=True).start()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            done.set()
    return 0


if __name__ == "__main__":
    sys.exit(main())
