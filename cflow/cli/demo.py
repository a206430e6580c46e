"""cflow demo: compile the bundled TinyStories model with cflowc and tell a story, printing each command."""

HELP = "compile the bundled default model and generate a story (prints the commands it runs)"


def add_args(p):
    from . import MAX_THREADS, number, whole

    p.add_argument("--prompt", default="Once upon a time", help="story opening (default \"Once upon a time\")")
    p.add_argument("-n", "--max-new-tokens", type=whole(1), default=160, help="tokens to generate (default 160)")
    p.add_argument("--temperature", type=number(0), default=0.0,
                   help="sampling temperature; 0 = greedy (default 0.0)")
    p.add_argument("--seed", type=whole(0), default=0, help="sampling seed (default 0)")
    p.add_argument("--threads", type=whole(1, MAX_THREADS), default=None, help="worker threads (default: usable cores)")
    p.add_argument("--out", default=None,
                   help="where to write the compiled file (default: demo.vflow in $CFLOW_CACHE_DIR or ~/.cache/cflow)")


def run(args) -> int:
    import os
    import shlex
    import sys
    from pathlib import Path

    from ..models.bundled import default_model_dir
    from . import cflow_main, cflowc_main

    src = default_model_dir()
    cache = Path(os.environ.get("CFLOW_CACHE_DIR", Path.home() / ".cache" / "cflow"))
    out = Path(args.out) if args.out else cache / "demo.vflow"
    from ..util import check_output_path

    check_output_path(out, "--out")  # before any work: the directory is created, the file must be writable
    compile_cmd = [str(src), "-o", str(out)]
    print("$ cflowc " + " ".join(shlex.quote(a) for a in compile_cmd), file=sys.stderr, flush=True)
    code = cflowc_main(compile_cmd)
    if code:
        return code
    run_cmd = ["run", str(out), "--prompt", args.prompt, "-n", str(args.max_new_tokens),
               "--temperature", str(args.temperature), "--seed", str(args.seed)]
    if args.threads:
        run_cmd += ["--threads", str(args.threads)]
    print("$ cflow " + " ".join(shlex.quote(a) for a in run_cmd), file=sys.stderr, flush=True)
    return cflow_main(run_cmd)
