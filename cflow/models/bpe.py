"""Byte-level BPE tokenizers (Hugging Face `tokenizers`) for the pipeline-native models.

`train_bpe` learns a GPT-2-style byte-level BPE with one special token, `<|endoftext|>` (id 0),
placed between stories. The result saves as a standard tokenizer.json that `cflowc` stores in
compiled files and `tokenizers.Tokenizer.from_file` loads anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .data import EOT

MIN_VOCAB = 257  # the 256 byte symbols + <|endoftext|>


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Train a byte-level BPE on `texts` (an iterable of documents). Every byte is in the base
    alphabet, so any text round-trips; <|endoftext|> is special token 0. The vocabulary may end
    up smaller than `vocab_size` on tiny inputs (no merge left to learn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} too small: a byte-level BPE needs >= {MIN_VOCAB}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def load_tokenizer(source: str | os.PathLike):
    """A tokenizer from a tokenizer.json path, a directory holding one, or the JSON text itself."""
    from tokenizers import Tokenizer

    if isinstance(source, str) and source.lstrip().startswith("{"):
        return Tokenizer.from_str(source)
    p = Path(source)
    if p.is_dir():
        p = p / "tokenizer.json"
    return Tokenizer.from_file(str(p))


def eot_id(tokenizer) -> int:
    i = tokenizer.token_to_id(EOT)
    if i is None:
        raise ValueError(f"tokenizer has no {EOT} token")
    return i
