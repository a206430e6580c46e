"""cflow train PRESET --data FILE: train a pipeline-native preset on text (torch, CPU) into a checkpoint
directory that `cflowc DIR` compiles (config.json + model.safetensors + tokenizer.json)."""

HELP = "train a pipeline-native preset on a text file (CPU)"


# TrainConfig's defaults, written out so that building the parser (`cflow --help`) does not import
# cflow.models (numpy, networkx); tests/test_cli.py checks they agree with cflow.models.train.TrainConfig.
DEFAULTS = {"size": "small", "steps": 300, "batch": 16, "seq": 256, "lr": 2e-3, "warmup": 30, "weight_decay": 0.1,
            "aux_loss": 0.01, "eval_every": 50, "ckpt_every": 100, "seed": 0, "vocab_size": 2048}


def add_args(p):
    from . import MAX_THREADS, number, whole

    d = DEFAULTS
    p.add_argument("preset", help="preset name: arch1, arch2_4_combined, arch3, arch4_async_experts, arch5_shared")
    p.add_argument("--data", required=True, help="training text (stories separated by blank lines / <|endoftext|>)")
    p.add_argument("--size", default=d["size"], help=f"preset size (default {d['size']})")
    p.add_argument("--steps", type=whole(1), default=d["steps"], help=f"optimizer steps (default {d['steps']})")
    p.add_argument("--batch", type=whole(1), default=d["batch"], help=f"sequences per step (default {d['batch']})")
    p.add_argument("--seq", type=whole(2, 2**20), default=d["seq"], help=f"tokens per sequence (default {d['seq']})")
    p.add_argument("--lr", type=number(0, 10, lo_open=True), default=d["lr"],
                   help=f"peak learning rate (default {d['lr']})")
    p.add_argument("--warmup", type=whole(0), default=d["warmup"], help=f"linear warmup steps (default {d['warmup']})")
    p.add_argument("--weight-decay", type=number(0), default=d["weight_decay"],
                   help=f"AdamW weight decay (default {d['weight_decay']})")
    p.add_argument("--aux-loss", type=number(0), default=d["aux_loss"],
                   help=f"MoE load-balance loss weight (default {d['aux_loss']})")
    p.add_argument("--eval-every", type=whole(1), default=d["eval_every"],
                   help=f"validate every N steps (default {d['eval_every']})")
    p.add_argument("--ckpt-every", type=whole(1), default=d["ckpt_every"],
                   help=f"checkpoint every N steps (default {d['ckpt_every']})")
    p.add_argument("--seed", type=whole(0), default=d["seed"],
                   help=f"initialisation and data-order seed (default {d['seed']})")
    p.add_argument("--threads", type=whole(1, MAX_THREADS), default=None,
                   help="torch threads (default: torch's choice)")
    p.add_argument("--tokenizer", help="tokenizer.json to use (default: train a byte-level BPE on the training split)")
    p.add_argument("--vocab", type=whole(260, 2**20), default=d["vocab_size"],
                   help=f"vocabulary of a trained tokenizer (default {d['vocab_size']})")
    p.add_argument("--out", help="run / checkpoint directory (default runs/PRESET-SIZE)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (default: start a new run)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing run in --out (default: refuse to overwrite one)")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="progress display (default auto: a bar on a terminal, else a line every 10 s)")


def run(args) -> int:
    import os
    from pathlib import Path

    from ..errors import CflowError
    from ..models.checkpoint import TOKENIZER
    from ..models.presets import get_preset
    from ..models.train import TrainConfig, prepare_data, train

    get_preset(args.preset, args.size)  # a clear error for an unknown preset / size
    if not Path(args.data).is_file():
        raise CflowError(f"--data {args.data}: no such file")
    if not os.access(args.data, os.R_OK):
        raise CflowError(f"--data {args.data}: not readable")
    cfg = TrainConfig(
        preset=args.preset, size=args.size, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
        warmup=min(args.warmup, args.steps), weight_decay=args.weight_decay, aux_loss=args.aux_loss,
        eval_every=args.eval_every, ckpt_every=args.ckpt_every, seed=args.seed, threads=args.threads,
        vocab_size=args.vocab,
    )
    out = Path(args.out or f"runs/{args.preset}-{args.size}")
    from ..util import check_output_dir

    check_output_dir(out, "--out")  # before the data is read: the directory can be created and written
    from ..models.train import STATE

    if (out / STATE).is_file() and not (args.resume or args.force):
        raise CflowError(f"--out {out} already holds a training run: pass --resume to continue it or --force to "
                         "replace it")
    tokenizer = args.tokenizer
    if tokenizer is None and args.resume and (out / TOKENIZER).is_file():
        tokenizer = out / TOKENIZER  # a resumed run keeps its tokenizer
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise CflowError(f"{tokenizer}: no such tokenizer file")
    tok, train_ids, val_ids = prepare_data(args.data, tokenizer, cfg)
    print(f"data: {len(train_ids):,} training and {len(val_ids):,} validation tokens, "
          f"vocabulary {tok.get_vocab_size()}", flush=True)
    train(cfg, train_ids, val_ids, tok.to_str(), out, resume=args.resume, force=args.force, progress=args.progress)
    return 0
