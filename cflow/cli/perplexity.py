"""cflow perplexity MODEL TEXT: llama-perplexity's protocol on a compiled file, a GGUF or a model directory.

    cflow perplexity model.vflow wiki.txt                      [1]8.1234,[2]8.0521,... Final estimate: PPL = ...
    cflow perplexity model.gguf wiki.txt --kl-divergence-base base.kld      # also write the base logits file
    cflow perplexity model.vflow --kl-divergence-base base.kld --kl-divergence   # KLD against it (llama.cpp's file)

The protocol and the file are runtime/perplexity.py's (the same as llama.cpp's, so a base file written by
llama-perplexity is read here and one written here is read there).
"""

HELP = "perplexity of a text (llama-perplexity's protocol), and KL divergence against a base-logits file"


def add_args(p):
    from ..layout import QUANTS
    from . import KV_CHOICES, MAX_THREADS, add_activations_argument, whole

    p.add_argument("model", help="compiled model (.vflow / .cflow), a .gguf or a model directory (compiled first)")
    p.add_argument("text", nargs="?", default=None,
                   help="text file to score ('-' reads standard input); with --kl-divergence the base file's "
                   "tokens are scored instead")
    p.add_argument("-c", "--ctx-size", type=whole(4), default=512, metavar="N",
                   help="tokens per chunk; the second half of each is scored (default 512, as llama-perplexity)")
    p.add_argument("--chunks", type=whole(1), default=None, metavar="N",
                   help="score at most N chunks (default: every whole chunk of the text)")
    p.add_argument("--kl-divergence-base", metavar="FILE", default=None,
                   help="llama.cpp's base-logits file: written from this run, or read with --kl-divergence "
                   "(default: none written or read)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="score against --kl-divergence-base FILE: mean KLD, percentiles, Δp, same top token "
                   "(default: perplexity only)")
    p.add_argument("--quant", default=None, choices=QUANTS,
                   help="with a .gguf or a directory: the weight type to compile at (default: cflowc's, stored for a "
                   ".gguf)")
    p.add_argument("--threads", type=whole(1, MAX_THREADS), default=None,
                   help="worker threads (default: usable cores)")
    p.add_argument("--kv", choices=KV_CHOICES, default="auto", help="KV cache element type (default auto)")
    add_activations_argument(p)
    p.add_argument("--json", action="store_true", help="print the final figures as one JSON object on stdout "
                   "(default: text only)")


def _progress(total: int):
    import sys

    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, unit="chunk", desc="scoring", file=sys.stderr, leave=False)


def open_model(spec: str, quant: str | None, threads, max_seq: int, kv: str, workdir: str, activations: str = "q8"):
    """A compiled file is loaded; a .gguf or a model directory is compiled into `workdir` first."""
    import os

    import cflow

    from ..layout.packed import FileLayout

    try:
        FileLayout.from_path(spec)
        compiled = os.path.isfile(spec)
    except ValueError:
        compiled = False
    if not compiled:
        from ..compiler import compile_file
        from ..frontend.load import load_graph
        from ..layout import DEFAULT_TILE
        from ..passes.quantize import STORED, default_quant, fit_tile

        g = load_graph(spec)
        path = os.path.join(workdir, "model.vflow")
        quant = quant or default_quant(g)
        compile_file(g, path, quant, fit_tile(g) if quant == STORED else DEFAULT_TILE, tokenizer=g.meta.tokenizer,
                     eos=g.meta.eos_token_ids)
        spec = path
    from ..errors import CflowError
    from ..runtime.format import FileReader

    with FileReader(spec) as r:
        ctx = r.header.get("config", {}).get("max_seq_len", max_seq)
    if isinstance(ctx, int) and max_seq > ctx:
        raise CflowError(f"-c {max_seq}: the model's context is {ctx} tokens (give -c {ctx} or less)")
    return cflow.load(spec, threads=threads, max_seq=max_seq, kv=kv, activations=activations)


def chunk_logits(session, ids):
    """Logits [len(ids), vocab] of one chunk run from an empty cache; the head runs only where a chunk is scored
    (positions first .. end: the rows before are zeros)."""
    import numpy as np

    from ..runtime.perplexity import first_scored

    n = len(ids)
    f = first_scored(n)
    session.reset()
    out = np.zeros((n, session.config.vocab_size), np.float32)
    session.prefill(ids[:f])
    out[f:] = session.prefill(ids[f:], all_logits=True)
    return out


def run(args) -> int:
    import json
    import sys

    from ..errors import CflowError
    from ..runtime import perplexity as P

    if args.kl_divergence and not args.kl_divergence_base:
        raise CflowError("--kl-divergence needs --kl-divergence-base FILE (the base model's logits)")
    base = None
    if args.kl_divergence:
        base = P.BaseLogits.open(args.kl_divergence_base)  # checked before the model is loaded
        n_ctx = base.n_ctx
    else:
        n_ctx = args.ctx_size
        if args.text is None:
            raise CflowError("give a TEXT file to score (or '-' for standard input)")
        if args.kl_divergence_base:
            from ..util import check_output_path

            check_output_path(args.kl_divergence_base, "--kl-divergence-base")
    text = None
    if base is None:
        try:
            if args.text == "-":
                text = sys.stdin.read()
            else:
                with open(args.text, encoding="utf-8") as fh:
                    text = fh.read()
        except (OSError, UnicodeDecodeError) as e:
            raise CflowError(f"{args.text}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    import shutil
    import tempfile

    workdir = tempfile.mkdtemp(prefix="cflow-ppl-")
    m = None
    try:
        m = open_model(args.model, args.quant, args.threads, n_ctx, args.kv, workdir, args.activations)
        if m.session.max_seq < n_ctx:
            raise CflowError(f"-c {n_ctx}: the model's context is {m.session.max_seq} tokens")
        tok = m.tokenizer
        bos = tok.bos_id if tok is not None and tok.add_bos else None
        if tok is not None and tok.add_eos:
            raise CflowError("this model adds EOS to every prompt: llama-perplexity's protocol refuses such a model")
        vocab = m.config.vocab_size
        if base is not None:
            if base.n_vocab != vocab:
                raise CflowError(f"--kl-divergence-base {base.path}: a vocabulary of {base.n_vocab} tokens, the "
                                 f"model has {vocab}")
            tokens = base.tokens
            n_chunk = base.n_chunk if args.chunks is None else min(args.chunks, base.n_chunk)
        else:
            if tok is None:
                raise CflowError("this model has no tokenizer: perplexity needs text (compile with --tokenizer)")
            tokens = tok.encode(text)  # as llama-perplexity: one prompt, BOS in front where the model adds it
            P.check_text_length(len(tokens), n_ctx)
            n_chunk = len(tokens) // n_ctx if args.chunks is None else min(args.chunks, len(tokens) // n_ctx)
        print(f"perplexity: {len(tokens)} tokens, {n_chunk} chunks of {n_ctx}, "
              f"{'BOS ' + str(bos) + ' first in each chunk' if bos is not None else 'no BOS'}", file=sys.stderr)
        writer = (P.LogitsWriter(args.kl_divergence_base, n_ctx, vocab, n_chunk, tokens)
                  if args.kl_divergence_base and base is None else None)
        ppl = P.Perplexity()
        kld = P.KLDivergence() if base is not None else None
        bar = _progress(n_chunk)
        try:
            for i, (start, ids) in enumerate(P.chunk_inputs(tokens, n_ctx, n_chunk, bos)):
                logits = chunk_logits(m.session, ids)
                orig = [int(t) for t in tokens[start : start + n_ctx]]
                ppl.add(logits, orig)
                if writer is not None:
                    writer.add(logits)
                if kld is not None:
                    kld.add(logits, orig, base.data[i])
                if bar is not None:
                    bar.update(1)
                print(f"[{i + 1}]{ppl.ppl:.4f},", end="", flush=True)
        finally:
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
        print()
        print(f"Final estimate: PPL = {ppl.ppl:.4f} +/- {ppl.error:.5f}")
        if kld is not None:
            print(kld.report())
        if args.json:
            out = {"ppl": ppl.ppl, "ppl_err": ppl.error, "tokens": ppl.count, "chunks": n_chunk, "n_ctx": n_ctx,
                   "bos": bos}
            if kld is not None:
                out.update({f"kl_{k}": v for k, v in kld.summary().items()})
            print(json.dumps(out))
    finally:
        if m is not None:
            m.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0
