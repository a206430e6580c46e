"""Prompts and batches of compiled files (a real model's GGUF compiled as stored, say): single-stream decode, a
batch's aggregate tok/s and a prompt's, per file and thread count, in interleaved rounds.

    python -m benchmarks.batch_files A.vflow B.vflow [--threads 1,2] [--batch 8] [--prompt 256] [--rounds 2]
        [--json [FILE]]

benchmarks/prefill.py measures the same three on random weights of a geometry against the machine's limits; this
runs them on the files users bring, whose GGUF block types have mat-mat kernels of their own (docs/performance.md,
"Prompts and batches"). Each number is the best of two repetitions inside its round (benchmarks.prefill's
cflow_single, cflow_batch and cflow_prompt, whose ids stay inside the file's vocabulary); the summary keeps each
file's best round.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.common.record import Run, add_json_argument
from benchmarks.prefill import cflow_batch, cflow_prompt, cflow_single
from cflow.codegen.target import cpu_model, isa_path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="compiled files (.vflow)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=8, help="sequences a batched step (default 8)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    ap.add_argument("--steps", type=int, default=8, help="batched steps a repetition (default 8)")
    ap.add_argument("--rounds", type=int, default=2)
    add_json_argument(ap, "write one record per file, thread count and measure")
    args = ap.parse_args(argv)
    for f in args.files:
        if not Path(f).is_file():
            ap.error(f"{f}: no such file")
    threads = [int(t) for t in args.threads.split(",")]
    run = Run("batch_files", argv)
    print(f"# {cpu_model()}, ISA path {isa_path()}; batch {args.batch}, prompt {args.prompt} tokens", flush=True)
    best: dict[tuple, dict] = {}
    for r in range(args.rounds):
        for f in args.files:
            for t in threads:
                single = cflow_single(f, t, 2 * args.steps, 2)
                batch = cflow_batch(f, t, args.batch, args.steps, 2)
                prompt = cflow_prompt(f, t, args.prompt, 64, 2)
                print(f"round {r + 1}  {Path(f).name:<28} {t} thread(s): single {single:6.1f}  batch {args.batch} "
                      f"{batch:6.1f} ({batch / single:4.2f}x)  prompt {prompt:6.1f} tok/s", flush=True)
                k = (f, t)
                b = best.setdefault(k, {"single": 0.0, "batch": 0.0, "prompt": 0.0})
                b.update(single=max(b["single"], single), batch=max(b["batch"], batch),
                         prompt=max(b["prompt"], prompt))
    records = []
    print("# best rounds:")
    for (f, t), b in best.items():
        print(f"{Path(f).name:<28} {t} thread(s): single {b['single']:6.1f}  batch {args.batch} {b['batch']:6.1f} "
              f"({b['batch'] / b['single']:4.2f}x)  prompt {b['prompt']:6.1f} tok/s")
        for what, v in b.items():
            records.append(run.record(engine="cflow", model=Path(f).name, threads=t, tok_s=v,
                                      variant={"single": "decode step", "batch": f"batch {args.batch}",
                                               "prompt": f"prompt {args.prompt}"}[what],
                                      batch=args.batch if what == "batch" else 1,
                                      prompt_tokens=args.prompt if what == "prompt" else 0))
    run.write(args.json, records)
    return records


if __name__ == "__main__":
    main()
