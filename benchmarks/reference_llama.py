"""A float reference model for the quantisers: a small Llama trained here on TinyStories, saved as a Hugging Face
checkpoint directory (config.json, model.safetensors, tokenizer.json) and as an f32 GGUF for llama.cpp.

    python -m benchmarks.reference_llama --out /work/models/tinyllama-ts [--steps 400] [--threads 2]

Why: no real f16/bf16/f32 language model ships in a registry package (docs/quantization.md), and every real GGUF
that does is already quantised, so requantising it favours whichever quantiser shares its grid. A model trained
from scratch in float has no grid; this one is small enough to train on 2 cores in about half an hour and has the
shapes the K-quants need (every width a multiple of 256): d_model 256, 6 layers, 4 query / 2 KV heads of 64, a
SiLU-gated FFN of 768, vocabulary 2,048 (the bundled model's byte-level BPE), untied head, context 256.

Training: transformers' LlamaForCausalLM, AdamW (lr 2e-3, betas 0.9/0.95, weight decay 0.1), 30 warmup steps then
cosine to a tenth, 16 x 256-token windows a step, gradient clipping at 1; stories from --data (default: the
TinyStories slice the other training runs use) without the part benchmarks/data/tinystories_excerpt.txt holds,
which stays held out for the quantisation benchmark. Deterministic for a seed and thread count. Prints the
validation loss at the end (and writes it to DIR/history.json).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT

DEFAULT_DATA = "/work/shared/data/tinystories_val.txt"
EXCERPT = Path(ROOT) / "benchmarks" / "data" / "tinystories_excerpt.txt"
BUNDLED = Path(ROOT) / "cflow" / "data" / "default"
GEOMETRY = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=256,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")


def training_text(path: str) -> str:
    """--data without the held-out excerpt (which the slice ends with) and everything after it."""
    text = Path(path).read_text(encoding="utf-8")
    held = EXCERPT.read_text(encoding="utf-8")
    cut = text.find(held[:200])
    return text[:cut] if cut > 0 else text


def train(out: Path, data: str, steps: int, threads: int, seed: int = 0) -> dict:
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from cflow.models.train import TrainConfig, _optimizer, lr_at
    from cflow.util import atomic_path

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    ids = np.array(tok.encode(training_text(data)).ids, np.int64)
    n_val = len(ids) // 20
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    model = LlamaForCausalLM(LlamaConfig(**GEOMETRY, bos_token_id=None, eos_token_id=0, pad_token_id=None)).float()
    cfg = TrainConfig(steps=steps, batch=16, seq=256, lr=2e-3, warmup=30, weight_decay=0.1, seed=seed)
    opt = _optimizer(model, cfg)  # cflow train's AdamW: decay on matrices only, betas 0.9 / 0.95
    rng = np.random.default_rng(seed)
    batch, seq = cfg.batch, cfg.seq

    history, t0 = [], time.time()
    model.train()
    for s in range(steps):
        starts = rng.integers(0, len(train_ids) - seq - 1, batch)
        x = torch.from_numpy(np.stack([train_ids[i : i + seq] for i in starts]))
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg)  # cflow train's schedule: linear warmup, cosine to a tenth
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(float(loss))
        if s % 25 == 0 or s == steps - 1:
            print(f"step {s:4d}  loss {float(loss):.3f}  {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    model.eval()
    with torch.no_grad():
        w = [val_ids[i : i + seq] for i in range(0, len(val_ids) - seq, seq)]
        losses = [float(model(input_ids=torch.from_numpy(np.stack(w[i : i + 8])),
                              labels=torch.from_numpy(np.stack(w[i : i + 8]))).loss) for i in range(0, len(w), 8)]
    val = float(np.mean(losses))
    info = {"steps": steps, "threads": threads, "seed": seed, "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)), "val_loss": val, "val_ppl": math.exp(val),
            "seconds": time.time() - t0, "loss": history}
    with atomic_path(out, directory=True) as tmp:  # the old directory replaced only by a complete new one
        model.save_pretrained(tmp, safe_serialization=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (BUNDLED / name).exists():
                shutil.copy(BUNDLED / name, tmp / name)
        shutil.copy(EXCERPT.parent / "NOTICE", tmp / "NOTICE")
        (tmp / "history.json").write_text(json.dumps(info), encoding="utf-8")
    return info


def export_f32_gguf(out: Path) -> Path:
    """The checkpoint as an f32 GGUF (cflow's exporter: llama arch, its RoPE row order), for llama_model_quantize."""
    from cflow.frontend.load import load_graph
    from cflow.runtime.format.gguf import export_gguf

    g = load_graph(str(out))
    path = out / "model-f32.gguf"
    export_gguf(g, path, tokenizer_json=str(out / "tokenizer.json"))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reference_llama", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write (replaced if present)")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"training text (default {DEFAULT_DATA})")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed (default 0)")
    args = p.parse_args(argv)
    out = Path(args.out)
    info = train(out, args.data, args.steps, args.threads, args.seed)
    gguf_path = export_f32_gguf(out)
    print(f"{out}: validation loss {info['val_loss']:.3f} (perplexity {info['val_ppl']:.2f}) after {args.steps} "
          f"steps, {info['seconds']:.0f} s; f32 GGUF {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
