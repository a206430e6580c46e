"""Train a pipeline-native preset on text (torch, CPU): AdamW, warmup + cosine decay, periodic
validation, atomic checkpoints and exact resume.

A run directory (`--out`) is a cflow checkpoint directory (config.json, model.safetensors,
tokenizer.json: what `cflowc DIR` compiles) plus the training state:

    train_state.pt    optimizer, step, data-sampler and torch RNG states (what --resume needs)
    history.json      train loss per step, validation evaluations, wall-clock time, final metrics
    train_args.json   the TrainConfig of the run
    NOTICE            the CDLA-Sharing-1.0 notice of the training data

Every save writes a complete new directory beside the old one and swaps it in (rename), so an
interrupted run leaves the last complete checkpoint. A resumed run continues bit-for-bit: the same
weights come out as from an uninterrupted run (same thread count).

MoE training adds the usual Switch-Transformer load-balancing loss (coefficient `aux_loss`,
computed from router outputs captured with forward hooks); reported losses are cross-entropy only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import CflowError
from ..util import atomic_path, recover_atomic
from .checkpoint import TOKENIZER, write_checkpoint
from .data import DATA_NOTICE, EOT, batches, encode_stories, eval_windows, load_split

STATE = "train_state.pt"
HISTORY = "history.json"
ARGS = "train_args.json"
NOTICE = "NOTICE"


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a training run (saved with it; a resume must agree on the shape fields)."""

    preset: str = "arch2_4_combined"
    size: str = "small"
    steps: int = 300
    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    aux_loss: float = 0.01
    eval_every: int = 50
    eval_tokens: int | None = None  # None: the whole validation split
    ckpt_every: int = 100
    seed: int = 0
    threads: int | None = None
    vocab_size: int = 2048  # tokenizer trained from the data when none is given
    val_fraction: float = 0.1
    split_seed: int = 0

    # Fields a resumed run must share with the saved one (the rest may change, e.g. steps).
    SHAPE_FIELDS = ("preset", "size", "batch", "seq", "seed")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --- data -----------------------------------------------------------------------------------
def prepare_data(data: str | os.PathLike, tokenizer=None, cfg: TrainConfig | None = None):
    """Text file -> (tokenizer, train ids, validation ids). Without a tokenizer, a byte-level BPE of
    cfg.vocab_size is trained on the training split only."""
    from .bpe import load_tokenizer, train_bpe

    cfg = cfg or TrainConfig()
    p = Path(data)
    if not p.is_file():
        raise CflowError(f"{p}: no such data file")
    train_s, val_s = load_split(p, cfg.val_fraction, cfg.split_seed)
    if tokenizer is None:
        tok = train_bpe(train_s, cfg.vocab_size)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tok = load_tokenizer(tokenizer)
    else:
        tok = tokenizer
    if tok.token_to_id(EOT) is None:
        raise CflowError(f"tokenizer has no {EOT} token")
    return tok, encode_stories(tok, train_s), encode_stories(tok, val_s)


# --- model ----------------------------------------------------------------------------------
def build_model(cfg: TrainConfig, vocab_size: int):
    """The preset at cfg.size with its vocabulary set to the tokenizer's, initialised from cfg.seed."""
    import torch

    from .presets import get_preset
    from .reference import PipelineNativeLM

    c = get_preset(cfg.preset, cfg.size)
    c = c.evolve(vocab_size=vocab_size, max_seq_len=max(c.max_seq_len, cfg.seq))
    torch.manual_seed(cfg.seed)
    return PipelineNativeLM(c)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over cfg.warmup steps, then cosine from lr to lr * min_lr_ratio at cfg.steps.
    `step` counts from 0 (the update about to happen)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    t = min(max(step - cfg.warmup, 0) / span, 1.0)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + (cfg.lr - lo) * 0.5 * (1 + math.cos(math.pi * t))


def _optimizer(model, cfg: TrainConfig):
    import torch

    decay, no_decay = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)  # no weight decay on norms and biases
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
    )


class RouterTap:
    """Captures router logits of every MoE execution (arch5 runs a block twice) for the balance loss."""

    def __init__(self, model):
        self.logits: list = []
        self.top_k = model.config.top_k
        self.handles = [
            blk.moe.router.register_forward_hook(lambda m, i, o: self.logits.append(o) if m.training else None)
            for blk in model.blocks if blk.moe is not None
        ]

    def loss(self):
        """Switch-Transformer load balance, averaged over MoE executions: E * sum_e f_e * P_e (1 when
        perfectly balanced), f_e = share of top-k slots routed to e, P_e = mean router probability."""
        import torch

        out = []
        for lg in self.logits:
            probs = torch.softmax(lg.reshape(-1, lg.shape[-1]).float(), dim=-1)
            n_e = probs.shape[-1]
            idx = torch.topk(probs, self.top_k, dim=-1).indices
            f = torch.zeros(n_e).index_add_(0, idx.flatten(), torch.ones(idx.numel())) / idx.numel()
            out.append(n_e * (f * probs.mean(0)).sum())
        self.logits.clear()
        return torch.stack(out).mean() if out else None

    def close(self):
        for h in self.handles:
            h.remove()


# --- evaluation -----------------------------------------------------------------------------
def evaluate(model, windows) -> dict:
    """Mean next-token cross-entropy, perplexity and top-1 accuracy over validation windows."""
    import torch
    import torch.nn.functional as F

    was = model.training
    model.eval()
    tot_loss, tot_hit, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in windows:
            logits = model(x)
            tot_loss += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            tot_hit += int((logits.argmax(-1) == y).sum())
            n += y.numel()
    model.train(was)
    loss = tot_loss / n
    return {"loss": loss, "ppl": math.exp(loss), "acc": tot_hit / n, "tokens": n}


# --- run directory --------------------------------------------------------------------------
def _save_run(out: Path, model, opt, step: int, gen, history: dict, cfg: TrainConfig, tokenizer_json: str) -> None:
    """The whole run directory at once: checkpoint + training state replace the previous save together
    (a crash mid-swap is undone by recover_atomic at the next start)."""
    import torch

    with atomic_path(out, directory=True) as staging:
        write_checkpoint(model, staging, tokenizer_json=tokenizer_json)
        state = {"step": step, "optimizer": opt.state_dict(), "data_rng": gen.get_state(),
                 "torch_rng": torch.random.get_rng_state()}
        torch.save(state, staging / STATE)
        (staging / HISTORY).write_text(json.dumps(history) + "\n")
        (staging / ARGS).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        (staging / NOTICE).write_text(DATA_NOTICE)


def read_history(out: str | os.PathLike) -> dict | None:
    p = Path(out) / HISTORY
    return json.loads(p.read_text()) if p.is_file() else None


def is_complete(out: str | os.PathLike, steps: int | None = None) -> bool:
    """True when OUT holds a finished run (of `steps` steps, if given)."""
    h = read_history(out)
    return bool(h and h.get("final") and (steps is None or h["step"] >= steps))


# --- progress -------------------------------------------------------------------------------
def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Progress:
    """A tqdm bar on a terminal, else one line every `every` seconds (and at evaluations)."""

    def __init__(self, mode: str, total: int, start: int, log: Callable[[str], None], every: float = 10.0):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.total, self.log, self.every = mode, total, log, every
        self.bar = None
        self.t_last = 0.0
        if mode == "bar":
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: fall back to progress lines
                self.mode = "lines"
            else:
                self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, lr: float, tok_s: float, eta: float, elapsed: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f} lr {lr:.2e} {tok_s:,.0f} tok/s")
        elif self.mode == "lines" and (time.monotonic() - self.t_last >= self.every or step == self.total):
            self.t_last = time.monotonic()
            self.log(f"step {step}/{self.total}  loss {loss:.3f}  lr {lr:.2e}  {tok_s:,.0f} tok/s  "
                     f"elapsed {_fmt_time(elapsed)}  eta {_fmt_time(eta)}")

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        elif self.mode != "none":
            self.log(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class RunResult:
    model: object  # the PipelineNativeLM, in eval mode
    history: dict
    out: Path


# --- the loop -------------------------------------------------------------------------------
def train(
    cfg: TrainConfig,
    train_ids,
    val_ids,
    tokenizer_json: str,
    out: str | os.PathLike,
    resume: bool = False,
    force: bool = False,
    progress: str = "auto",
    log: Callable[[str], None] | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Train cfg.preset at cfg.size on token streams and write the run directory `out`.

    resume: continue the run saved in `out` (exactly; cfg.steps may be raised). force: replace it.
    progress: "auto" (a bar on a terminal, else lines), "bar", "lines" or "none".
    stop_after: stop (and save) after this many steps of this call: for tests of resume.
    Returns the trained model and the history (also in out/history.json), whose "final" entry
    holds the validation loss, perplexity and top-1 accuracy of the last weights.
    """
    import torch
    import torch.nn.functional as F

    from .bpe import load_tokenizer
    from .checkpoint import load_checkpoint

    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_atomic(out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    vocab = load_tokenizer(tokenizer_json).get_vocab_size()
    train_t = torch.tensor(train_ids, dtype=torch.long)
    windows = eval_windows(val_ids, cfg.seq, max(cfg.batch, 8), cfg.eval_tokens)
    gen = torch.Generator().manual_seed(cfg.seed)

    have_run = (out / STATE).is_file()
    if have_run and resume:
        saved = TrainConfig.from_dict(json.loads((out / ARGS).read_text()))
        diff = [f for f in TrainConfig.SHAPE_FIELDS if getattr(saved, f) != getattr(cfg, f)]
        if diff:
            raise CflowError(f"{out}: cannot resume with a different {diff[0]} "
                             f"(saved {getattr(saved, diff[0])!r}, asked {getattr(cfg, diff[0])!r})")
        if (out / TOKENIZER).read_text() != tokenizer_json:
            raise CflowError(f"{out}: cannot resume with a different tokenizer")
        model = load_checkpoint(out).train()
        opt = _optimizer(model, cfg)
        state = torch.load(out / STATE, weights_only=False)
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["data_rng"])
        torch.random.set_rng_state(state["torch_rng"])
        step = state["step"]
        history = read_history(out)
        history.pop("final", None)
        if step >= cfg.steps:
            log(f"{out}: already trained {step} steps (asked {cfg.steps})")
    elif have_run and not force:
        raise CflowError(f"{out} already holds a training run: pass --resume to continue it or --force to replace it")
    else:
        model = build_model(cfg, vocab).train()
        opt = _optimizer(model, cfg)
        step = 0
        c = model.config
        history = {"preset": cfg.preset, "size": cfg.size, "step": 0, "train": [], "val": [], "elapsed": 0.0,
                   "params": c.n_params(), "active_params": c.n_params(active=True),
                   "train_tokens": len(train_ids), "val_tokens": windows and sum(y.numel() for _, y in windows)}
    if model.config.vocab_size != vocab:
        raise CflowError(f"model vocab_size {model.config.vocab_size} != tokenizer vocabulary {vocab}")

    tap = RouterTap(model) if cfg.aux_loss > 0 else None
    data = batches(train_t, cfg.batch, cfg.seq, gen)
    prog = _Progress(progress, cfg.steps, step, log)
    tok_per_step = cfg.batch * cfg.seq
    elapsed0, t0 = history["elapsed"], time.monotonic()
    first_step = step
    ema = None

    def elapsed() -> float:
        return elapsed0 + time.monotonic() - t0

    def do_eval():
        r = evaluate(model, windows)
        history["val"].append({"step": step, **r})
        prog.message(f"val step {step}: loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  top-1 {100 * r['acc']:.1f}%")

    saved = [step if have_run and resume else None]

    def save():
        history["step"], history["elapsed"] = step, elapsed()
        _save_run(out, model, opt, step, gen, history, cfg, tokenizer_json)
        saved[0] = step

    try:
        if step == 0 and not history["val"]:
            do_eval()
        while step < cfg.steps and (stop_after is None or step - first_step < stop_after):
            lr = lr_at(step, cfg)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = next(data)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            total = loss
            if tap is not None:
                aux = tap.loss()
                if aux is not None:
                    total = loss + cfg.aux_loss * aux
            opt.zero_grad(set_to_none=True)
            total.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            lv = float(loss.detach())
            if not math.isfinite(lv):
                raise CflowError(f"training diverged at step {step} (loss {lv}); lower --lr")
            history["train"].append([step, lv])
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            run_s = time.monotonic() - t0
            tok_s = (step - first_step) * tok_per_step / max(run_s, 1e-9)
            eta = (cfg.steps - step) * run_s / (step - first_step)
            prog.update(step, ema, lr, tok_s, eta, elapsed())
            if step % cfg.eval_every == 0 or step == cfg.steps:
                do_eval()
            if step % cfg.ckpt_every == 0 and step < cfg.steps:
                save()
        if step >= cfg.steps:
            if not history["val"] or history["val"][-1]["step"] != step:
                do_eval()
            history["final"] = dict(history["val"][-1])
        save()
    except KeyboardInterrupt:
        prog.close()
        log(f"interrupted at step {step}: " + (f"{out} holds step {saved[0]}; continue with --resume"
                                               if saved[0] is not None else "no checkpoint written yet"))
        raise
    finally:
        prog.close()
        if tap is not None:
            tap.close()
    if "final" in history:
        f = history["final"]
        log(f"done: {step} steps in {_fmt_time(history['elapsed'])}; validation loss {f['loss']:.4f}, "
            f"perplexity {f['ppl']:.2f}, top-1 {100 * f['acc']:.1f}% -> {out}")
    return RunResult(model.eval(), history, out)


# --- generation (reference check of a trained model) ----------------------------------------
def generate_text(model, tokenizer, prompt: str = "", max_new_tokens: int = 100, temperature: float = 0.0,
                  top_k: int | None = None, seed: int = 0, stop_at_eot: bool = True) -> str:
    """Continue `prompt` with the torch reference model (KV cache). temperature 0 = greedy.
    The prompt is preceded by <|endoftext|> (the model saw it before every story)."""
    import torch

    from .bpe import eot_id

    eot = eot_id(tokenizer)
    ids = [eot] + tokenizer.encode(prompt).ids
    g = torch.Generator().manual_seed(seed)
    cache: list = []
    new: list[int] = []
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(ids), cache)[-1]
        for _ in range(max_new_tokens):
            if temperature <= 0:
                nxt = int(logits.argmax())
            else:
                lg = logits / temperature
                if top_k:
                    kth = torch.topk(lg, min(top_k, lg.numel())).values[-1]
                    lg = lg.masked_fill(lg < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(lg, -1), 1, generator=g))
            if stop_at_eot and nxt == eot:
                break
            new.append(nxt)
            if len(ids) + len(new) >= model.config.max_seq_len:
                break
            logits = model(torch.tensor([nxt]), cache)[-1]
    return prompt + tokenizer.decode(new)
