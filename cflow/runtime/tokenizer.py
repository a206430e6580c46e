"""Tokenizer carried inside a compiled file: Hugging Face `tokenizers` JSON; absent -> ids in, ids out.

Special tokens. Whether a prompt starts with BOS (and ends with EOS) is the model's, not the tokenizer JSON's: a
GGUF says it in tokenizer.ggml.add_bos_token (llama.cpp's default when absent: SentencePiece vocabularies and a few
BPE pre-tokenisers add it), a Hugging Face directory in tokenizer_config.json's add_bos_token or its tokenizer.json
post-processor. The frontends read it into graph.meta.special_tokens, the compiler stores it in the file header
("special_tokens": {"bos", "eos", "add_bos", "add_eos", "source"}), and Tokenizer.encode(text, add_special=True)
applies it: text is tokenised without the post-processor, then BOS is prepended unless the ids already start with it
(a chat template that writes the BOS text itself: never two BOS), EOS appended likewise.
"""

from __future__ import annotations

import json
import os

from ..errors import CflowError


def read_tokenizer_file(path: str | os.PathLike) -> str:
    """The text of a tokenizer.json given with --tokenizer / compile(tokenizer=...), checked to load.

    Checked with the `tokenizers` package when it is installed (else as a JSON object with a model),
    so a bad file fails at compile time, not when the compiled model is first run.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CflowError(f"--tokenizer {os.fspath(path)}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CflowError(f"--tokenizer {os.fspath(path)}: not a valid tokenizer.json: not UTF-8 ({e.reason})") from None
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        HFTokenizer = None
    try:
        if HFTokenizer is not None:
            HFTokenizer.from_str(text)
        elif not isinstance(d := json.loads(text), dict) or not isinstance(d.get("model"), dict):
            raise ValueError("no \"model\" object")
    except BaseException as e:  # noqa: BLE001 -- bare Exceptions for every kind of bad input, pyo3 panics
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CflowError(f"--tokenizer {os.fspath(path)}: not a valid tokenizer.json: {_first_line(e)}") from None
    return text


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


class Tokenizer:
    def __init__(self, json_text: str, eos_ids=(), specials: dict | None = None):
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise CflowError("this model carries a tokenizer: install the 'tokenizers' package") from None
        try:
            self.tk = HFTokenizer.from_str(json_text)
        except BaseException as e:  # noqa: BLE001 -- bare Exceptions, and pyo3 panics (BaseException) on odd input
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise CflowError(f"stored tokenizer is not valid tokenizer.json: {_first_line(e)}") from None
        self.eos_ids = {int(i) for i in eos_ids}
        for tok in ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>"):
            i = self.tk.token_to_id(tok)
            if i is not None and not eos_ids:
                self.eos_ids.add(i)
        sp = specials or {}
        self.bos_id: int | None = sp.get("bos")
        self.eos_id: int | None = sp.get("eos")
        self.add_bos: bool = bool(sp.get("add_bos")) and self.bos_id is not None
        self.add_eos: bool = bool(sp.get("add_eos")) and self.eos_id is not None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included."""
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; with add_special (the default, as for Hugging Face tokenizers and llama.cpp) the
        model's BOS in front and EOS behind where the model adds them, never doubled (module docstring)."""
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and (not ids or ids[0] != self.bos_id):
                ids = [self.bos_id] + ids
            if self.add_eos and (not ids or ids[-1] != self.eos_id):
                ids = ids + [self.eos_id]
        return ids

    def decode(self, ids) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=True)


class StreamDecoder:
    """Turn a growing id list into text pieces without splitting multi-byte characters."""

    def __init__(self, tok: Tokenizer, prefix=()):
        self.tok, self.ids, self.text = tok, list(prefix), tok.decode(prefix) if prefix else ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):  # incomplete UTF-8 sequence: wait for the next token
            return ""
        piece, self.text = full[len(self.text):], full
        return piece


def parse_id_prompt(prompt: str, vocab: int) -> list[int]:
    """A prompt for a model without tokenizer: space-separated token ids."""
    try:
        ids = [int(t) for t in prompt.split()]
    except ValueError:
        raise CflowError("this model has no tokenizer (presets have random weights and none; `cflowc --tokenizer "
                         "FILE` stores one): give the prompt as space-separated token ids, e.g. --prompt '1 2 3'") \
            from None
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise CflowError(f"token id {bad[0]} out of range 0..{vocab - 1}")
    return ids
