"""cflow demo: compile the bundled TinyStories model with cflowc and tell a story, printing each command."""

HELP = "compile the bundled default model and generate a story (prints the commands it runs)"


def add_args(p):
    p.add_argument("--prompt", default="Once upon a time", help="story opening")
    p.add_argument("-n", "--max-new-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None, help="where to write the compiled file (default: a cache directory)")


def run(args) -> int:
    import os
    import shlex
    import sys
    from pathlib import Path

    from ..cli import cflow_main, cflowc_main
    from ..models.bundled import default_model_dir

    src = default_model_dir()
    out = Path(args.out) if args.out else Path(os.environ.get("CFLOW_CACHE_DIR", Path.home() / ".cache" / "cflow")) / "demo.vflow"
    out.parent.mkdir(parents=True, exist_ok=True)
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
