"""Train the five pipeline-native presets on the same tokens and compare them (docs/architectures.md).

    nice -n 19 python -m benchmarks.architectures              # train what is missing, write table + plot
    nice -n 19 python -m benchmarks.architectures --bundle --long arch4_async_experts
        # ... and train arch2_4_combined 3x longer, ship it as cflow/data/default, and train arch4 as long
    python -m benchmarks.architectures --report-only           # rebuild table/plot/samples from finished runs

Every preset trains at one size (`small`) with the same tokenizer, data, step count, batch, sequence
length, learning-rate schedule and seed; a second seed of arch2_4_combined measures seed noise. Runs
live in --runs (default runs/architectures/PRESET-sSEED); a finished run is skipped and an
interrupted one resumes, so the command can be rerun at will. It rewrites only the marked regions
of docs/architectures.md (table, seed-noise line, samples) and docs/architectures_loss.png.

Data: /work/shared/data/tinystories_val.txt (TinyStories, Eldan & Li 2023, CDLA-Sharing-1.0); the
notice travels with every checkpoint (NOTICE) and the bundled model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

from cflow.models.presets import ARCHS
from cflow.models.train import TrainConfig

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_DATA = "/work/shared/data/tinystories_val.txt"
NOISE_PRESET = "arch2_4_combined"
PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "One day, a little dog"]


def parse_args(argv=None):
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--runs", default=str(ROOT / "runs" / "architectures"), help="run directories")
    p.add_argument("--size", default="small")
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--ckpt-every", type=int, default=45)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-seeds", type=int, nargs="*", default=[1],
                   help=f"extra seeds of {NOISE_PRESET} to measure seed noise (default: 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    p.add_argument("--only", nargs="*", help="train only these presets (the report uses every finished run)")
    p.add_argument("--report-only", action="store_true", help="do not train; rebuild the report from finished runs")
    p.add_argument("--doc", default=str(ROOT / "docs" / "architectures.md"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "architectures_loss.png"))
    p.add_argument("--bundle", action="store_true",
                   help=f"train {NOISE_PRESET} for --bundle-steps (run BUNDLE_RUN) "
                        "and ship it as cflow/data/default (f16)")
    p.add_argument("--bundle-steps", type=int, default=540,
                   help="steps of the bundled model's run and of the --long runs (default 540)")
    p.add_argument("--long", nargs="*", default=[], metavar="PRESET",
                   help="also train these presets for --bundle-steps (PRESET-long), to compare with the bundled run")
    return p.parse_args(argv)


BUNDLE_RUN = f"{NOISE_PRESET}-bundle"


def run_dir(args, preset: str, seed: int) -> Path:
    return Path(args.runs) / f"{preset}-s{seed}"


def train_config(args, preset: str, seed: int) -> TrainConfig:
    return TrainConfig(preset=preset, size=args.size, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                       warmup=args.warmup, eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=seed,
                       threads=args.threads, vocab_size=args.vocab)


def jobs(args):
    out = [(p, args.seed) for p in ARCHS]
    out += [(NOISE_PRESET, s) for s in args.noise_seeds if s != args.seed]
    return out


# --- training -------------------------------------------------------------------------------
def train_all(args) -> None:
    from cflow.models.bpe import load_tokenizer
    from cflow.models.train import STATE, is_complete, prepare_data, train

    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    tok_path = runs / "tokenizer.json"
    cfg0 = train_config(args, "arch1", args.seed)
    if tok_path.is_file():
        tok, train_ids, val_ids = prepare_data(args.data, load_tokenizer(tok_path), cfg0)
    else:
        tok, train_ids, val_ids = prepare_data(args.data, None, cfg0)
        tok.save(str(tok_path))
    print(f"data: {len(train_ids):,} training / {len(val_ids):,} validation tokens, vocabulary {tok.get_vocab_size()}; "
          f"{args.steps} steps x {args.batch} x {args.seq} = {args.steps * args.batch * args.seq:,} tokens per run "
          f"({args.steps * args.batch * args.seq / len(train_ids):.1f} epochs)", flush=True)
    for preset, seed in jobs(args):
        if args.only and preset not in args.only:
            continue
        out = run_dir(args, preset, seed)
        if is_complete(out, args.steps):
            print(f"{out.name}: done, skipped", flush=True)
            continue
        resume = (out / STATE).is_file()
        print(f"{out.name}: {'resuming' if resume else 'training'}", flush=True)
        train(train_config(args, preset, seed), train_ids, val_ids, tok.to_str(), out, resume=resume)
    longs = ([NOISE_PRESET] if args.bundle else []) + [p for p in args.long if p != NOISE_PRESET or not args.bundle]
    for preset in longs:
        out = long_dir(args, preset)
        cfg = dataclasses.replace(train_config(args, preset, args.seed), steps=args.bundle_steps,
                                  eval_every=max(args.eval_every, args.bundle_steps // 12))
        if is_complete(out, cfg.steps):
            print(f"{out.name}: done, skipped", flush=True)
        else:
            resume = (out / STATE).is_file()
            print(f"{out.name}: {'resuming' if resume else 'training'} ({cfg.steps} steps)", flush=True)
            train(cfg, train_ids, val_ids, tok.to_str(), out, resume=resume)


def long_dir(args, preset: str) -> Path:
    """Runs at --bundle-steps: the bundled model for arch2_4_combined, PRESET-long for the others."""
    return Path(args.runs) / (BUNDLE_RUN if preset == NOISE_PRESET else f"{preset}-long")


def long_rows(args) -> list[dict]:
    from cflow.models.checkpoint import read_config
    from cflow.models.train import is_complete, read_history

    rows = []
    for preset in ARCHS:
        out = long_dir(args, preset)
        if not is_complete(out, args.bundle_steps):
            continue
        h, c = read_history(out), read_config(out)
        best = min(h["val"], key=lambda v: v["loss"])
        rows.append(dict(preset=preset, seed=args.seed, dir=out, history=h,
                         ppl=h["final"]["ppl"], acc=h["final"]["acc"],
                         best_ppl=best["ppl"], best_step=best["step"], params=c.n_params(),
                         active=c.n_params(active=True), minutes=h["elapsed"] / 60,
                         tokens=h["step"] * args.batch * args.seq, steps=h["step"], config=c))
    return rows


def long_table(args) -> str:
    rows = long_rows(args)
    if not rows:
        return "(no longer runs: add --bundle and --long PRESET ...)"
    lines = [f"Longer runs ({args.bundle_steps} steps, {rows[0]['tokens']:,} tokens = "
             f"{rows[0]['tokens'] / rows[0]['history']['train_tokens']:.1f} epochs, otherwise the same settings):", "",
             "| preset | val ppl | top-1 acc | best val ppl (step) | train time |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['ppl']:.2f} | {100 * r['acc']:.1f}% "
                     f"| {r['best_ppl']:.2f} ({r['best_step']}) | {r['minutes']:.1f} min |")
    return "\n".join(lines)


def bundle_row(args) -> dict | None:
    """The run shipped as the default model: BUNDLE_RUN, if finished."""
    from cflow.models.checkpoint import read_config
    from cflow.models.train import is_complete, read_history

    out = long_dir(args, NOISE_PRESET)
    if not is_complete(out, args.bundle_steps):
        return None
    h, c = read_history(out), read_config(out)
    return dict(preset=NOISE_PRESET, seed=args.seed, dir=out, history=h, ppl=h["final"]["ppl"], acc=h["final"]["acc"],
                params=c.n_params(), active=c.n_params(active=True), minutes=h["elapsed"] / 60,
                tokens=h["step"] * args.batch * args.seq, steps=h["step"], config=c)


# --- report ---------------------------------------------------------------------------------
def collect(args) -> list[dict]:
    from cflow.ir.build import build_graph
    from cflow.models.checkpoint import read_config
    from cflow.models.train import is_complete, read_history
    from cflow.passes.analysis import analyze

    rows = []
    for preset, seed in jobs(args):
        out = run_dir(args, preset, seed)
        if not is_complete(out, args.steps):
            continue
        h = read_history(out)
        c = read_config(out)
        a = analyze(build_graph(c), "q4")
        best = min(h["val"], key=lambda v: v["loss"])
        rows.append(dict(preset=preset, seed=seed, dir=out, history=h, ppl=h["final"]["ppl"], loss=h["final"]["loss"],
                         acc=h["final"]["acc"], best_ppl=best["ppl"], best_step=best["step"], params=c.n_params(),
                         active=c.n_params(active=True), seq_mb=a.sequential_bytes / 1e6,
                         crit_mb=a.critical_bytes / 1e6, reduction=a.reduction, minutes=h["elapsed"] / 60,
                         tokens=h["step"] * args.batch * args.seq, config=c))
    return rows


def table(rows: list[dict]) -> str:
    main = [r for r in rows if r["seed"] == rows[0]["seed"]] if rows else []
    best = min((r["ppl"] for r in main), default=float("nan"))
    lines = [
        "| preset | val ppl | Δ to best | top-1 acc | best val ppl (step) | params | active params "
        "| q4 MB/token seq. → crit. | critical-path reduction | train time |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in main:
        lines.append(
            f"| {r['preset']} | {r['ppl']:.2f} | {r['ppl'] - best:+.2f} | {100 * r['acc']:.1f}% "
            f"| {r['best_ppl']:.2f} ({r['best_step']}) | {r['params'] / 1e6:.2f}M | {r['active'] / 1e6:.2f}M "
            f"| {r['seq_mb']:.2f} → {r['crit_mb']:.2f} | {r['reduction']:.2f}x | {r['minutes']:.1f} min |")
    return "\n".join(lines)


def noise_line(rows: list[dict]) -> str:
    same = [r for r in rows if r["preset"] == NOISE_PRESET]
    if len(same) < 2:
        return "(seed-noise run not finished)"
    ppls = ", ".join(f"seed {r['seed']}: {r['ppl']:.2f} ({100 * r['acc']:.1f}%)" for r in same)
    spread = max(r["ppl"] for r in same) - min(r["ppl"] for r in same)
    acc_spread = 100 * (max(r["acc"] for r in same) - min(r["acc"] for r in same))
    return (f"Seed noise, {NOISE_PRESET} with different seeds (initialisation and batch order), everything else equal: "
            f"{ppls}; spread {spread:.2f} perplexity, {acc_spread:.1f} points of top-1 accuracy.")


def setup_line(args, rows: list[dict]) -> str:
    if not rows:
        return ""
    r, h = rows[0], rows[0]["history"]
    c = r["config"]
    return (f"Size `{args.size}`: vocabulary {c.vocab_size} (byte-level BPE), d_model {c.d_model}, "
            f"{c.n_layers} layers, {c.n_heads} heads (head_dim {c.head_dim}), dense FFN {c.ffn_dim}, "
            f"{c.n_experts} experts of width {c.expert_dim}, top-{c.top_k}. "
            f"Data: {h['train_tokens']:,} training / {h['val_tokens']:,} validation tokens "
            f"(validation = 10% of the stories). Each run: {args.steps} steps x {args.batch} sequences x {args.seq} "
            f"tokens = {r['tokens']:,} tokens ({r['tokens'] / h['train_tokens']:.1f} epochs), AdamW (lr {args.lr:g}, "
            f"warmup {args.warmup}, cosine to 10%, weight decay 0.1, clip 1.0, MoE balance loss 0.01), "
            f"seed {args.seed}, {args.threads} torch thread(s), niced on a shared 2-core machine.")


def plot(rows: list[dict], longs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cflow.util import atomic_path

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax1, ax2), (ax3, ax4) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    order = list(ARCHS)
    base = next((r for r in rows if r["preset"] == "arch1" and r["seed"] == rows[0]["seed"]), None)
    base_val = {v["step"]: v["loss"] for v in base["history"]["val"]} if base else {}
    for r in rows:
        h, col = r["history"], colors[order.index(r["preset"]) % len(colors)]
        style = "-" if r["seed"] == rows[0]["seed"] else ":"
        label = r["preset"] + ("" if style == "-" else f" (seed {r['seed']})")
        steps = [s for s, _ in h["train"]]
        ema, sm = None, []
        for _, v in h["train"]:
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            sm.append(ema)
        ax1.plot(steps, sm, style, color=col, label=label, lw=1.2)
        vs = [v for v in h["val"] if v["step"] > 0]
        ax2.plot([v["step"] for v in vs], [v["loss"] for v in vs], style, marker=".", color=col, label=label, lw=1.2)
        ds = [v for v in vs if v["step"] in base_val]
        ax3.plot([v["step"] for v in ds], [v["loss"] - base_val[v["step"]] for v in ds], style, marker=".",
                 color=col, label=label, lw=1.2)
    for r in longs:
        h, col = r["history"], colors[order.index(r["preset"]) % len(colors)]
        vs = [v for v in h["val"] if v["step"] > 0]
        ax4.plot([v["step"] for v in vs], [v["loss"] for v in vs], "-", marker=".", color=col,
                 label=f"{r['preset']} validation", lw=1.2)
        tr = h["train"]
        ax4.plot([s for s, _ in tr[::5]], [sum(v for _, v in tr[max(0, i - 9):i + 1]) / len(tr[max(0, i - 9):i + 1])
                                          for i in range(0, len(tr), 5)], "--", color=col, lw=0.8,
                 label=f"{r['preset']} training (mean of 10)")
    lo = min((v["loss"] for r in rows for v in r["history"]["val"]), default=2)
    ax1.set(title="training loss (EMA 0.9)", xlabel="step", ylabel="cross-entropy (nats/token)",
            ylim=(lo - 0.3, lo + 2.5))
    ax2.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats/token)", ylim=(lo - 0.1, lo + 2.0))
    ax3.set(title="validation loss minus arch1's (seed 0)", xlabel="step", ylabel="Δ nats/token (lower is better)")
    ax3.axhline(0, color="grey", lw=0.6)
    ax4.set(title=f"longer runs ({longs[0]['steps']} steps)" if longs else "longer runs (none)", xlabel="step",
            ylabel="cross-entropy (nats/token)")
    if longs:
        llo = min(v["loss"] for r in longs for v in r["history"]["val"])
        ax4.set_ylim(llo - 1.2, llo + 1.5)
    for ax in (ax1, ax2, ax3, ax4):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:  # keeps the .png name, so savefig picks the format from it
        fig.savefig(tmp, dpi=100)
    plt.close(fig)


def samples(r: dict | None, prompts=PROMPTS) -> str:
    import torch

    from cflow.models.bpe import load_tokenizer
    from cflow.models.checkpoint import load_checkpoint
    from cflow.models.train import generate_text

    if r is None:
        return "(no finished arch2_4_combined run)"
    torch.set_num_threads(1)
    model, tok = load_checkpoint(r["dir"]), load_tokenizer(r["dir"])
    out = [f"From `{r['dir'].name}` ({r['history']['step']} steps; the torch reference `PipelineNativeLM`, "
           "KV cache, f32 weights, up to 90 new tokens, stopping at `<|endoftext|>`):", ""]
    for i, prompt in enumerate(prompts):
        for mode, kw in (("greedy", dict(temperature=0.0)),
                         ("sampled T=0.8 top-k 40", dict(temperature=0.8, top_k=40, seed=i))):
            text = generate_text(model, tok, prompt, max_new_tokens=90, **kw)
            quoted = "\n".join(f"> {line}" if line.strip() else ">" for line in text.strip().split("\n"))
            out += [f"*{mode}* — prompt “{prompt}”:", "", quoted, ""]
    return "\n".join(out).rstrip()


SKELETON = """# Comparing the five pipeline-native architectures

<!-- BEGIN setup -->
<!-- END setup -->

<!-- BEGIN table -->
<!-- END table -->

![loss curves](architectures_loss.png)

<!-- BEGIN noise -->
<!-- END noise -->

<!-- BEGIN long -->
<!-- END long -->

## The bundled model

<!-- BEGIN bundle -->
<!-- END bundle -->

## Samples

<!-- BEGIN samples-comparison -->
<!-- END samples-comparison -->

<!-- BEGIN samples -->
<!-- END samples -->
"""


def replace_region(doc: str, name: str, body: str) -> str:
    pat = re.compile(rf"(<!-- BEGIN {name} -->\n).*?(<!-- END {name} -->)", re.S)
    if not pat.search(doc):
        raise SystemExit(f"docs: marker <!-- BEGIN {name} --> missing")
    return pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), doc)


def bundle_line(args, b: dict | None) -> str:
    if b is None:
        return "(bundled run not trained: add --bundle)"
    h = b["history"]
    curve = ", ".join(f"{v['step']}: {v['ppl']:.1f}" for v in h["val"] if v["step"])
    return (f"`{BUNDLE_RUN}`: {b['steps']} steps ({b['tokens']:,} tokens, "
            f"{b['tokens'] / h['train_tokens']:.1f} epochs), same settings otherwise; {b['minutes']:.1f} min. "
            f"Validation perplexity {b['ppl']:.2f}, top-1 accuracy {100 * b['acc']:.1f}%. "
            f"Validation perplexity by step: {curve}.")


def report(args, rows: list[dict]) -> None:
    from cflow.util import atomic_write_text

    doc_path = Path(args.doc)
    doc = doc_path.read_text() if doc_path.is_file() else SKELETON
    doc = replace_region(doc, "setup", setup_line(args, rows))
    doc = replace_region(doc, "table", table(rows))
    doc = replace_region(doc, "noise", noise_line(rows))
    main_run = next((r for r in rows if r["preset"] == NOISE_PRESET and r["seed"] == args.seed), None)
    doc = replace_region(doc, "samples-comparison", samples(main_run, PROMPTS[:1]))
    b = bundle_row(args)
    doc = replace_region(doc, "samples", samples(b) if b else "(bundled run not trained: add --bundle)")
    doc = replace_region(doc, "bundle", bundle_line(args, b))
    doc = replace_region(doc, "long", long_table(args))
    atomic_write_text(doc_path, doc)
    plot(rows, long_rows(args), args.plot)
    results = [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items() if k not in ("history", "config")}
               for r in rows]
    atomic_write_text(Path(args.runs) / "results.json", json.dumps(results, indent=2) + "\n")
    print(table(rows))
    print(noise_line(rows))
    print(f"wrote {doc_path} and {args.plot}")


def bundle(args, rows: list[dict]) -> None:
    import torch

    from cflow.models.checkpoint import load_checkpoint, save_checkpoint, tokenizer_json
    from cflow.models.data import DATA_NOTICE
    from cflow.util import atomic_write_text

    r = bundle_row(args)
    if r is None:
        raise SystemExit(f"--bundle: run {BUNDLE_RUN} is not finished")
    dest = ROOT / "cflow" / "data" / "default"
    model = load_checkpoint(r["dir"])
    save_checkpoint(model, dest, tokenizer_json=tokenizer_json(r["dir"]), dtype=torch.float16)
    atomic_write_text(dest / "NOTICE", DATA_NOTICE)
    c = r["config"]
    atomic_write_text(dest / "README.md", f"""# Bundled default model

`{c.name}` (dense delay {c.dense_delay}, expert delay {c.expert_delay}): d_model {c.d_model}, {c.n_layers} layers, \
{c.n_heads} heads, dense FFN {c.ffn_dim},
{c.n_experts} experts of width {c.expert_dim} (top-{c.top_k}), vocabulary {c.vocab_size} (byte-level BPE, \
`<|endoftext|>` = 0 between
stories), {r['params'] / 1e6:.2f}M parameters, weights in float16. Trained by `benchmarks/architectures.py --bundle`
(run `{r['dir'].name}`: {r['steps']} steps of {args.batch} x {args.seq} tokens, seed {args.seed}); \
validation perplexity {r['ppl']:.2f},
top-1 accuracy {100 * r['acc']:.1f}% on held-out TinyStories stories. See docs/architectures.md.

Locate it with `cflow.models.bundled.default_model_dir()`; it is a cflow checkpoint directory
(`cflowc DIR -o model.vflow`, `cflow.models.checkpoint.load_checkpoint(DIR)`).

## Data licence

{DATA_NOTICE}""")
    dest.chmod(0o755)  # temp files and dirs are created private; package data must be world-readable
    for f in dest.iterdir():
        f.chmod(0o644)
    size = sum(f.stat().st_size for f in dest.iterdir())
    print(f"bundled {r['dir'].name} -> {dest} ({size / 1e6:.1f} MB)")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    if not args.report_only:
        train_all(args)
    rows = collect(args)
    if not rows:
        print("no finished runs", file=sys.stderr)
        return 1
    report(args, rows)
    if args.bundle:
        bundle(args, rows)
    print(f"total {(time.time() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
