"""cflow run FILE --prompt TEXT: generate, printing tokens as they come, then prompt and decode speed.

--prompt - or -f - reads the prompt from standard input, -f FILE from a file; --chat is an interactive loop with the
model's chat template (read a line, stream the answer, keep the conversation's KV cache).
"""

HELP = "generate text (or token ids) from a compiled .vflow/.cflow file"

DEFAULT_NEW_TOKENS = 128


def add_args(p):
    from . import KV_CHOICES, MAX_THREADS, add_activations_argument, number, size_mb, whole

    p.add_argument("file", help="compiled model (.vflow or .cflow), or a directory holding exactly one")
    p.add_argument("--prompt", "-p", default="Once upon a time",
                   help="text, or space-separated token ids if the model has no tokenizer (a preset has none) "
                   "(default \"Once upon a time\")")
    p.add_argument("-f", "--prompt-file", metavar="FILE", default=None,
                   help="read the prompt from FILE; - reads standard input (default: --prompt)")
    p.add_argument("--chat", action="store_true",
                   help="interactive chat with the model's chat template: each line read from standard input is a "
                   "user turn, the answer streams back; the KV cache keeps the conversation (/reset starts over, "
                   "/exit or end of input stops) (default: one prompt)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message opening the conversation (default: none)")
    p.add_argument("-n", "--max-new-tokens", type=whole(1), default=None, metavar="N",
                   help=f"most tokens to generate; more than the context holds after the prompt is an error "
                   f"(default {DEFAULT_NEW_TOKENS}, or what fits the context)")
    p.add_argument("--temperature", type=number(0), default=0.0,
                   help="sampling temperature; 0 = greedy (default 0.0)")
    p.add_argument("--top-k", type=whole(0), default=0,
                   help="sample from the k likeliest tokens; 0 = all (default 0)")
    p.add_argument("--top-p", type=number(0, 1, lo_open=True), default=1.0,
                   help="sample from the smallest set of tokens with this total probability; 1 = all (default 1.0)")
    p.add_argument("--seed", type=whole(0), default=None,
                   help="sampling seed (default: a fresh random seed each run)")
    p.add_argument("--threads", type=whole(1, MAX_THREADS), default=None,
                   help="worker threads (default: usable cores)")
    p.add_argument("--ctx", "--max-seq", dest="max_seq", type=whole(1), default=None, metavar="TOKENS",
                   help="context to allocate (KV cache), at most the model's; more is an error naming both "
                   "(default: the model's max_seq_len)")
    p.add_argument("--kv", choices=KV_CHOICES, default="auto",
                   help="KV cache element type: f16 halves its memory and what attention reads per token at long "
                   "contexts; bf16 as many bytes with f32's range (bf16 dot products in attention); auto is f16 "
                   "for q4/q8 weights (measured equal in perplexity), f32 for f16/f32 "
                   "weights (default auto; the type in use is printed with the speeds)")
    add_activations_argument(p)
    p.add_argument("--verify", action="store_true",
                   help="verify every checksum before running (default: no full-read check)")
    p.add_argument("--no-stop", action="store_true",
                   help="do not stop at end-of-text tokens (default: stop at the model's end-of-text tokens)")
    p.add_argument("--experts-on-disk", action="store_true",
                   help="keep the experts on disk: read the chosen ones with O_DIRECT inside the expert-delay "
                   "window (default: all weights mapped in RAM)")
    p.add_argument("--expert-cache-mb", type=number(0, lo_open=True), default=None, metavar="MB",
                   help="with --experts-on-disk: RAM for recently used experts (default: a quarter of the experts)")
    p.add_argument("--max-ram", type=size_mb, default=None, metavar="SIZE",
                   help="memory for the whole process (8G, 512M; binary units): the weights stay mapped if they "
                   "fit, else the experts go to disk with a cache of what is left, else the big matrices are "
                   "streamed too (default: no budget)")
    p.add_argument("--no-expert-guess", action="store_true",
                   help="with --experts-on-disk: do not start the next layer's expert reads on a guess of its route "
                   "(default: guess, from this layer's router input; the real router still decides)")
    p.add_argument("--weights-on-disk", action="store_true",
                   help="stream the big non-expert matrices from the file every token, stage by stage (for a model "
                   "larger than RAM; implies --experts-on-disk) (default: mapped in RAM)")
    p.add_argument("--read-ahead", type=whole(0), default=2, metavar="STAGES",
                   help="with --weights-on-disk: stages read ahead of the one computing (default 2)")
    p.add_argument("--expert-io", choices=("async", "sync"), default="async",
                   help="with --experts-on-disk: start reads when the router chooses (async) or read when "
                   "needed, blocking (sync) (default async)")
    p.add_argument("--speculate", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: drafts from prompt lookup (ngram) or from --draft, checked in one "
                   "pass; the same tokens as without, faster when drafts stand (default: off)")
    p.add_argument("--draft", default=None, metavar="FILE",
                   help="a smaller compiled model with the same tokenizer, for --speculate draft (default: none)")


def run(args) -> int:
    import sys
    import time

    import cflow

    from ..errors import CflowError
    from . import compiled_file

    # Every option is checked before the model is loaded (ranges by the parser, combinations here).
    if (args.expert_cache_mb is not None or args.expert_io != "async" or args.no_expert_guess) and not (
            args.experts_on_disk or args.weights_on_disk or args.max_ram is not None):
        raise CflowError("--expert-cache-mb, --expert-io and --no-expert-guess need --experts-on-disk")
    if args.max_ram is not None and args.expert_cache_mb is not None:
        raise CflowError("--max-ram sizes the expert cache: give --max-ram or --expert-cache-mb, not both")
    if args.read_ahead != 2 and not args.weights_on_disk:
        raise CflowError("--read-ahead needs --weights-on-disk")
    if args.system is not None and not args.chat:
        raise CflowError("--system needs --chat")
    if args.draft is not None and args.speculate != "draft":
        raise CflowError("--draft is the draft model of --speculate draft: give both")
    if args.speculate == "draft" and args.draft is None:
        raise CflowError("--speculate draft needs a draft model: --draft FILE")
    if args.speculate and (args.experts_on_disk or args.weights_on_disk or args.max_ram is not None):
        raise CflowError("--speculate checks drafts with the multi-token body, which needs the weights in RAM")
    if args.chat and args.prompt_file == "-":
        raise CflowError("-f - and --chat both read standard input: give the prompt file a name")
    path = compiled_file(args.file)
    if args.prompt_file == "-":
        args.prompt = sys.stdin.read().removesuffix("\n")
    elif args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as fh:
                args.prompt = fh.read().removesuffix("\n")
        except (OSError, UnicodeDecodeError) as e:
            raise CflowError(f"-f {args.prompt_file}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    elif args.prompt == "-" and not args.chat:
        args.prompt = sys.stdin.read().removesuffix("\n")
    m = cflow.load(path, threads=args.threads, verify=args.verify, max_seq=args.max_seq,
                   experts="disk" if args.experts_on_disk else "ram", expert_cache_mb=args.expert_cache_mb,
                   expert_io=args.expert_io, weights="disk" if args.weights_on_disk else "ram",
                   read_ahead=args.read_ahead, kv=args.kv, activations=args.activations, max_ram_mb=args.max_ram,
                   expert_guess=not args.no_expert_guess,
                   draft=compiled_file(args.draft) if args.draft else None)
    try:
        if args.chat:
            return _chat(m, args)
        # The prompt and the sampling options are checked before anything is printed.
        ids = m.check_request(args.prompt, 0, args.temperature, args.top_k, args.top_p, args.seed)
        room = m.session.max_seq - len(ids) + 1  # new tokens that fit: the last one is sampled, never fed
        n = args.max_new_tokens
        if n is None:
            n = min(DEFAULT_NEW_TOKENS, room)
        elif n > room:
            raise CflowError(f"-n {n}: the prompt is {len(ids)} tokens and the context {m.session.max_seq}, so at "
                             f"most {room} new tokens fit (give -n {room} or a shorter prompt)")
        _describe_tiers(m, args)
        mended = m.session.folios
        if mended is not None and mended.dropped:
            print(f"note: {mended}", file=sys.stderr)
        text = m.tokenizer is not None
        sys.stdout.write(args.prompt if text else " ".join(map(str, ids)))
        sys.stdout.flush()
        t0 = time.perf_counter()
        n_new = 0
        t_first = None
        for piece in m.stream(ids if not text else args.prompt, n, args.temperature, args.top_k, args.top_p,
                              args.seed, stop=not args.no_stop, speculate=args.speculate):
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
              f"{m.bytes_per_token / 1e6:.1f} MB/token, {m.kv} KV cache"
              + (f", {m.session.activations} activations" if m.session.activations != "q8" else ""), file=sys.stderr)
        if args.speculate:
            _describe_speculation(m.speculation, args.speculate)
        st = m.expert_stats
        if st is not None:
            steps = max(1, len(ids) + n_new - 1)
            guessed = (f", {st.guessed} reads started on a guess of the next layer's route "
                       f"({st.guessed_used / st.guessed:.0%} then chosen)" if st.guessed else "")
            print(f"experts: hit rate {100 * st.hit_rate:.1f}%, {st.bytes_read / steps / 1e6:.2f} MB read from disk "
                  f"per token, {st.wait_seconds:.2f} s waiting for reads{guessed}", file=sys.stderr)
    finally:
        m.close()
    return 0


def _chat(m, args) -> int:
    """The interactive loop: one user turn per input line, the reply streamed, the KV cache kept between turns."""
    import sys
    import time

    from ..errors import CflowError

    m._template()  # no template or no tokenizer: one error before the loop
    m.check_request([0], 0, args.temperature, args.top_k, args.top_p, args.seed)
    tty = sys.stdin.isatty()
    history = [{"role": "system", "content": args.system}] if args.system is not None else []
    n = args.max_new_tokens or DEFAULT_NEW_TOKENS
    while True:
        if tty:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system is not None else []
            continue
        if not line.strip():
            continue
        turn = history + [{"role": "user", "content": line}]
        t0, pieces, count = time.perf_counter(), [], 0
        try:
            for piece in m.stream_chat(turn, n, args.temperature, args.top_k, args.top_p, args.seed,
                                       stop=not args.no_stop, speculate=args.speculate):
                count += 1
                pieces.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except CflowError as e:  # a turn that does not fit, a template error: say so, keep the conversation
            sys.stdout.write("\n")
            print(f"error: {e}" + (" (/reset starts a new conversation)" if "context" in str(e) else ""),
                  file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history = turn + [{"role": "assistant", "content": "".join(pieces)}]
        dt = time.perf_counter() - t0
        print(f"[{m.reused_tokens} prompt tokens reused from the cache, {count} new tokens, "
              f"{count / dt if dt > 0 else 0:.1f} tok/s]", file=sys.stderr)
    return 0


def _describe_speculation(spec, kind: str) -> None:
    import sys

    if spec is None:
        return
    print(f"speculation ({kind}): {spec.passes} drafting passes, {spec.accepted} of {spec.proposed} drafted tokens "
          f"accepted ({100 * spec.acceptance:.0f}%), {spec.tokens_per_pass:.2f} tokens per "
          f"pass{', paused ' + str(spec.pauses) + ' times (drafts did not pay)' if spec.pauses else ''}",
          file=sys.stderr)


def _describe_tiers(m, args) -> None:
    import sys

    s = m.session
    if s.streamer is not None:
        st = s.streamer
        print(f"weights on disk: {st.bytes_per_token / 1e6:.1f} MB streamed per token in "
              f"{st.requests_per_token} reads, {st.depth} stages read ahead, "
              f"{'O_DIRECT' if st.direct else 'buffered'}", file=sys.stderr)
    if s.tier is not None:
        win = sorted(s.window_stages.values())
        de = m.config.expert_delay
        cache_mb = s.tier.slot_bytes * len(s.tier.slots) / 2**20
        overlap = (f"de={de}: reads overlap {win[0]}..{win[-1]} stages of compute" if de and win[-1] else
                   f"de={de}: no overlap window, every miss waits for its read")
        print(f"experts on disk: {len(s.tier.slots)} cached experts ({cache_mb:.1f} MiB), "
              f"{'O_DIRECT' if s.tier.direct else 'buffered'} reads, {args.expert_io}; {overlap}", file=sys.stderr)
