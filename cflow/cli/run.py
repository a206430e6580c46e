"""cflow run FILE --prompt TEXT: generate, printing tokens as they come, then prompt and decode speed."""

HELP = "generate text (or token ids) from a compiled .vflow/.cflow file"


def add_args(p):
    p.add_argument("file", help="compiled model (.vflow or .cflow)")
    p.add_argument("--prompt", "-p", default="Once upon a time",
                   help="text, or space-separated ids if the model has no tokenizer (default \"Once upon a time\")")
    p.add_argument("-n", "--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0 = all (default 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens with this total probability; 1 = all (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh random seed each run)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: usable cores)")
    p.add_argument("--verify", action="store_true",
                   help="verify every checksum before running (default: no full-read check)")
    p.add_argument("--no-stop", action="store_true",
                   help="do not stop at end-of-text tokens (default: stop at the model's end-of-text tokens)")
    p.add_argument("--experts-on-disk", action="store_true",
                   help="keep the experts on disk: read the chosen ones with O_DIRECT inside the expert-delay "
                   "window (default: all weights mapped in RAM)")
    p.add_argument("--expert-cache-mb", type=float, default=None, metavar="MB",
                   help="with --experts-on-disk: RAM for recently used experts (default: an eighth of the experts)")
    p.add_argument("--weights-on-disk", action="store_true",
                   help="stream the big non-expert matrices from the file every token, stage by stage (for a model "
                   "larger than RAM; implies --experts-on-disk) (default: mapped in RAM)")
    p.add_argument("--read-ahead", type=int, default=2, metavar="STAGES",
                   help="with --weights-on-disk: stages read ahead of the one computing (default 2)")
    p.add_argument("--expert-io", choices=("async", "sync"), default="async",
                   help="with --experts-on-disk: start reads when the router chooses (async) or read when "
                   "needed, blocking (sync) (default async)")


def run(args) -> int:
    import sys
    import time

    import cflow

    from ..errors import CflowError

    if (args.expert_cache_mb is not None or args.expert_io != "async") and not (args.experts_on_disk or
                                                                                args.weights_on_disk):
        raise CflowError("--expert-cache-mb and --expert-io need --experts-on-disk")
    if args.read_ahead != 2 and not args.weights_on_disk:
        raise CflowError("--read-ahead needs --weights-on-disk")
    if args.read_ahead < 0:
        raise CflowError(f"--read-ahead must be >= 0, not {args.read_ahead}")
    m = cflow.load(args.file, threads=args.threads, verify=args.verify,
                   experts="disk" if args.experts_on_disk else "ram", expert_cache_mb=args.expert_cache_mb,
                   expert_io=args.expert_io, weights="disk" if args.weights_on_disk else "ram",
                   read_ahead=args.read_ahead)
    if m.session.streamer is not None:
        st = m.session.streamer
        print(f"weights on disk: {st.bytes_per_token / 1e6:.1f} MB streamed per token in "
              f"{st.requests_per_token} reads, {st.depth} stages read ahead, "
              f"{'O_DIRECT' if st.direct else 'buffered'}", file=sys.stderr)
    if m.session.tier is not None:
        s = m.session
        win = sorted(s.window_stages.values())
        de = m.config.expert_delay
        cache_mb = s.tier.slot_bytes * len(s.tier.slots) / 2**20
        overlap = (f"de={de}: reads overlap {win[0]}..{win[-1]} stages of compute" if de and win[-1] else
                   f"de={de}: no overlap window, every miss waits for its read")
        print(f"experts on disk: {len(s.tier.slots)} cached experts ({cache_mb:.1f} MiB), "
              f"{'O_DIRECT' if s.tier.direct else 'buffered'} reads, {args.expert_io}; {overlap}", file=sys.stderr)
    try:
        text = isinstance(args.prompt, str) and m.tokenizer is not None
        ids = m._ids(args.prompt)
        sys.stdout.write(args.prompt if text else " ".join(map(str, ids)))
        sys.stdout.flush()
        t0 = time.perf_counter()
        n_new = 0
        t_first = None
        for piece in m.stream(args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                              args.seed, stop=not args.no_stop):
            if t_first is None:
                t_first = time.perf_counter()
            n_new += 1
            sys.stdout.write(piece if text else f" {piece}")
            sys.stdout.flush()
        t1 = time.perf_counter()
        sys.stdout.write("\n")
        prompt_s = (t_first or t1) - t0
        decode_s = t1 - (t_first or t1)
        print(f"prompt: {len(ids)} tokens, {len(ids) / prompt_s:.1f} tok/s | decode: {n_new} tokens, "
              f"{(n_new - 1) / decode_s if n_new > 1 and decode_s > 0 else 0:.1f} tok/s | {m.threads} threads, "
              f"{m.bytes_per_token / 1e6:.1f} MB/token", file=sys.stderr)
        st = m.expert_stats
        if st is not None:
            steps = max(1, len(ids) + n_new - 1)
            print(f"experts: hit rate {100 * st.hit_rate:.1f}%, {st.bytes_read / steps / 1e6:.2f} MB read from disk "
                  f"per token, {st.wait_seconds:.2f} s waiting for reads", file=sys.stderr)
    finally:
        m.close()
    return 0
