"""cflow serve FILE: an OpenAI-compatible HTTP server (completions, chat, SSE streaming) for a compiled model."""

DEFAULT_BATCH = 8

HELP = "serve a compiled model over HTTP with OpenAI's API (completions, chat, streaming, /metrics)"


def add_args(p):
    from . import KV_CHOICES, add_activations_argument, size_mb

    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; anything but loopback is reachable by others, so give --api-key "
                   "(default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--threads", type=int, default=None,
                   help="worker threads of the decode step (default: usable cores)")
    p.add_argument("--max-batch", type=int, default=None, metavar="B",
                   help="sequences generated together: requests join and leave at token boundaries and one pass "
                   "over the weights advances all of them; each costs a KV cache (with experts or weights on "
                   f"disk: a loaded copy, taking turns) (default {DEFAULT_BATCH}; 1 with experts or weights on disk)")
    p.add_argument("--max-queue", type=int, default=64, metavar="Q",
                   help="requests that may wait for a free sequence; more are answered 429 with Retry-After "
                   "(default 64)")
    p.add_argument("--cache-mb", type=float, default=None, metavar="MB",
                   help="RAM for the prefix cache: keys and values of earlier prompts and answers, reused by "
                   "requests that start with the same tokens (a system prompt, a chat's earlier turns); least "
                   "recently used blocks go first; 0 turns it off (default: as many whole contexts as "
                   "--max-batch, at least 4, at most a quarter of the memory available after loading; off with "
                   "a disk tier and --max-batch > 1)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: none; also read from "
                   "$CFLOW_API_KEY)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the file name without extension)")
    p.add_argument("--experts-on-disk", action="store_true",
                   help="keep the experts in the file and read the chosen ones on demand (for MoE models larger "
                   "than RAM; see docs/expert-tier.md) (default: all weights mapped in RAM)")
    p.add_argument("--expert-cache-mb", type=float, default=None, metavar="MB",
                   help="with --experts-on-disk: RAM for recently used experts, per sequence slot (default: the "
                   "runtime's choice)")
    p.add_argument("--max-ram", type=size_mb, default=None, metavar="SIZE",
                   help="memory for the whole server process (8G, 512M): the weights stay mapped if they fit, else "
                   "the experts go to disk with a cache of what is left, else the big matrices are streamed too; "
                   "with --max-batch 1 (default: no budget)")
    p.add_argument("--weights-on-disk", action="store_true",
                   help="stream the big matrices from the file every token (a model larger than RAM; implies "
                   "--experts-on-disk) (default: mapped in RAM)")
    p.add_argument("--kv", choices=KV_CHOICES, default="auto",
                   help="KV cache element type (f32, f16, bf16); auto: f16 for q4/q8 weights (measured equal in "
                   "perplexity), f32 for f16/f32 weights (default auto)")
    add_activations_argument(p)
    p.add_argument("--speculate", choices=("ngram", "draft"), default=None,
                   help="speculative decoding for a request decoding alone: drafts from prompt lookup (ngram) or "
                   "from --draft, checked in one pass; the same tokens as without (default: off)")
    p.add_argument("--draft", default=None, metavar="FILE",
                   help="a smaller compiled model with the same tokenizer, for --speculate draft (default: none)")
    p.add_argument("--no-overlap", action="store_true",
                   help="run each decode step only once the previous token has been handed out; by default, where "
                   "--threads leaves a core free, a lone request's next step runs while the server handles the "
                   "token just drawn (docs/serving.md)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level; 'warning' hides the access log (default info)")


def is_loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """CflowError unless this process can listen on host:port now (bound and released at once, with the
    SO_REUSEADDR uvicorn sets, so a port in TIME_WAIT is not refused)."""
    import socket

    from ..errors import CflowError

    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CflowError(f"--host {host}: {e.strerror or e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise CflowError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? give "
                             "--port)") from None


def run(args) -> int:
    import os
    import sys

    from ..errors import CflowError

    try:
        import uvicorn

        from ..serve.app import build_app
    except ImportError as e:
        raise CflowError(f"cflow serve needs the 'serve' extra: pip install 'cflow[serve]' ({e.name} is missing)") \
            from None
    if not 0 <= args.port <= 65535:
        raise CflowError(f"--port must be in 0..65535, not {args.port}")
    if args.max_batch is None:
        args.max_batch = 1 if args.experts_on_disk or args.weights_on_disk else DEFAULT_BATCH
    if args.max_batch < 1:
        raise CflowError(f"--max-batch must be >= 1, not {args.max_batch}")
    if args.max_queue < 0:
        raise CflowError(f"--max-queue must be >= 0, not {args.max_queue}")
    if args.cache_mb is not None and not args.cache_mb >= 0:  # (NaN too)
        raise CflowError(f"--cache-mb must be >= 0 (0 turns the prefix cache off), not {args.cache_mb:g}")
    if args.threads is not None and args.threads < 1:
        raise CflowError(f"--threads must be >= 1, not {args.threads}")
    if args.expert_cache_mb is not None and not (args.experts_on_disk or args.weights_on_disk):
        raise CflowError("--expert-cache-mb needs --experts-on-disk")
    if args.max_ram is not None and (args.max_batch != 1 or args.expert_cache_mb is not None):
        raise CflowError("--max-ram sizes one model's expert cache: give it with --max-batch 1 and without "
                         "--expert-cache-mb")
    if not os.path.isfile(args.file):
        raise CflowError(f"{args.file}: no such file")
    check_port(args.host, args.port)  # before the model loads: a busy port is one line, not a load and exit 3
    if args.draft is not None and args.speculate != "draft":
        raise CflowError("--draft is the draft model of --speculate draft: give both")
    api_key = args.api_key or os.environ.get("CFLOW_API_KEY") or None
    if not is_loopback(args.host) and not api_key:
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this port can use the "
              "model", file=sys.stderr)
    app = build_app(args.file, threads=args.threads, max_batch=args.max_batch, max_queue=args.max_queue,
                    api_key=api_key, model_id=args.model_name, cache_mb=args.cache_mb,
                    experts="disk" if args.experts_on_disk else "ram", expert_cache_mb=args.expert_cache_mb,
                    weights="disk" if args.weights_on_disk else "ram", kv=args.kv, speculate=args.speculate,
                    activations=args.activations, overlap=not args.no_overlap,
                    **({"draft": args.draft} if args.draft else {}),
                    **({"max_ram_mb": args.max_ram} if args.max_ram is not None else {}))
    st = app.state.engine.stats()
    m = app.state.model
    cache = getattr(app.state.engine.backend, "prefix_cache", None)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {args.file} as '{app.state.model_id}' on http://{host}:{args.port}/v1 | {st.slots} "
          f"sequence{'s' if st.slots > 1 else ''} at once, queue {args.max_queue}, {m.threads} threads, context "
          f"{m.session.max_seq} tokens, {m.kv} KV cache, "
          f"{f'prefix cache {cache.budget / 2**20:,.0f} MB' if cache else 'no prefix cache'}"
          f"{', API key required' if api_key else ''}"
          f"{', speculative decoding (' + args.speculate + ')' if args.speculate else ''}"
          f"{', next step while a token is handed out' if m.session.detached else ''}", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level in ("info", "debug"), timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    try:
        server.run()  # Ctrl-C / SIGTERM: stop accepting, end the requests in flight, close the engine
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: for a server that is the normal stop
        pass
    if not server.started:
        raise CflowError(f"could not listen on {args.host}:{args.port} (see the message above)")
    return 0
