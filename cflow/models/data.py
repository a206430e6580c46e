"""Training data: TinyStories text -> stories -> train/validation split -> token streams -> batches.

The bundled data file (/work/shared/data/tinystories_val.txt, a slice of the TinyStories validation
split, Eldan & Li 2023, licensed CDLA-Sharing-1.0) separates *paragraphs* by blank lines, not
stories: the dataset's `<|endoftext|>` markers are gone. `split_stories` recovers story boundaries
with a heuristic (see there). Anything derived from that text (tokenizer, checkpoints) carries the
CDLA-Sharing-1.0 notice (`DATA_NOTICE`).

Only `batches` / `eval_windows` need torch; the text functions run without it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator, Sequence

EOT = "<|endoftext|>"  # end-of-text special token, placed between stories

DATA_NOTICE = """\
Trained on TinyStories text.

The training data is a slice of the validation split of the TinyStories dataset
(Ronen Eldan and Yuanzhi Li, "TinyStories: How Small Can Language Models Be and Still Speak
Coherent English?", 2023, arXiv:2305.07759, https://huggingface.co/datasets/roneneldan/TinyStories),
licensed under the Community Data License Agreement - Sharing, Version 1.0 (CDLA-Sharing-1.0,
https://cdla.dev/sharing-1-0/). The tokenizer and the model weights in this directory are derived
from that data; keep this notice with any copy or derived file.
"""

# A paragraph opens a new story when it starts like a TinyStories opening line ...
_STORY_START = re.compile(r"^(Once upon a time|Once there (was|were|lived)|Once, there (was|were|lived))\b")
# ... or when the paragraph before it closed a story.
_STORY_END = re.compile(r"^(the end\b|the moral of (the|this) story\b)", re.IGNORECASE)


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, stripped, empties dropped (newlines inside one are kept)."""
    return [p.strip() for p in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if p.strip()]


def split_stories(text: str) -> list[str]:
    """Text -> stories (paragraphs joined by a blank line).

    If the text carries `<|endoftext|>` markers they are the boundaries. Otherwise a story starts at
    a paragraph opening with "Once upon a time" / "Once there was|were|lived" (with or without a
    comma), or right after a paragraph that begins "The end" or "The moral of the story". On
    tinystories_val.txt this finds 805 stories (the README counts ~700). A missed boundary merges
    two stories, which is harmless for a train/validation split (both land on the same side); the
    opening paragraphs before the first boundary form one (partial) story.
    """
    if EOT in text:
        return [s.strip() for s in text.split(EOT) if s.strip()]
    stories: list[list[str]] = []
    prev_ended = True
    for p in split_paragraphs(text):
        if not stories or prev_ended or _STORY_START.match(p):
            stories.append([p])
        else:
            stories[-1].append(p)
        prev_ended = bool(_STORY_END.match(p))
    return ["\n\n".join(s) for s in stories]


def train_val_split(stories: Sequence[str], val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Shuffle story indices with a fixed seed; the first ceil(val_fraction * n) go to validation.
    Both lists keep the file order of their stories."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie in (0, 1)")
    n = len(stories)
    if n < 2:
        raise ValueError(f"need at least 2 stories to split, got {n}")
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_val = min(n - 1, max(1, round(val_fraction * n)))
    val = set(idx[:n_val])
    return [s for i, s in enumerate(stories) if i not in val], [s for i, s in enumerate(stories) if i in val]


def load_split(path, val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Read a text file and return its (train, validation) stories."""
    from pathlib import Path

    text = Path(path).read_text(encoding="utf-8")
    return train_val_split(split_stories(text), val_fraction, seed)


def encode_stories(tokenizer, stories: Iterable[str]) -> list[int]:
    """One token stream: EOT story EOT story ... EOT (every story is preceded and followed by EOT,
    so the model learns to start a story after EOT and to end one with it)."""
    eot = tokenizer.token_to_id(EOT)
    if eot is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    stories = list(stories)
    out = [eot]
    for enc in tokenizer.encode_batch(stories):
        out.extend(enc.ids)
        out.append(eot)
    return out


# --- batches (torch) ----------------------------------------------------------------------
def batches(ids, batch: int, seq: int, generator) -> Iterator:
    """Endless random windows of a token stream: yields (x, y) LongTensors [batch, seq], y = x shifted by
    one. Window starts are drawn with `generator` (a torch.Generator), so a saved generator state
    resumes the exact stream."""
    import torch

    data = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    n = data.numel() - seq - 1
    if n < 1:
        raise ValueError(f"token stream of {data.numel()} tokens is too short for --seq {seq}")
    offs = torch.arange(seq + 1)
    while True:
        starts = torch.randint(0, n + 1, (batch,), generator=generator)
        w = data[starts[:, None] + offs[None, :]]
        yield w[:, :-1], w[:, 1:]


def eval_windows(ids, seq: int, batch: int, max_tokens: int | None = None) -> list:
    """Deterministic non-overlapping windows covering the stream (the last partial window dropped):
    a list of (x, y) batches for validation."""
    import torch

    data = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, dtype=torch.long)
    n_win = (data.numel() - 1) // seq
    if max_tokens is not None:
        n_win = min(n_win, max(1, max_tokens // seq))
    if n_win < 1:
        raise ValueError(f"validation stream of {data.numel()} tokens is too short for --seq {seq}")
    x = data[: n_win * seq].view(n_win, seq)
    y = data[1 : n_win * seq + 1].view(n_win, seq)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n_win, batch)]
