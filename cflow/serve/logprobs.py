"""Logprob records (runtime.choice.TokenLogprob) in OpenAI's shapes, and each token as those shapes show it.

A token's string is its own text: the bytes it stands for, decoded as UTF-8. A token that is part of a character
(a byte-level or byte-fallback token holding some of its UTF-8 bytes) shows its bytes escaped, "\\xe2\\x80", and
`bytes` holds the bytes themselves, as OpenAI's API does; a special token shows its name ("<|endoftext|>"). The
tokens' bytes so concatenate to the generated text's bytes. A model without a tokenizer shows " ID", as its text.
"""

from __future__ import annotations

import json
import re

from .protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins (GPT-2's table): printable Latin-1 bytes stand for themselves, every
    other byte b for chr(256 + its rank among them)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _decoder_types(node) -> list[dict]:
    if not isinstance(node, dict):
        return []
    out = [node]
    for sub in node.get("decoders") or ():
        out += _decoder_types(sub)
    return out


class TokenStrings:
    """token id -> (string, UTF-8 bytes) as logprobs show it; computed once per id."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special: dict[int, str] = {}
        self._alphabet: dict[str, int] | None = None
        self._metaspace = False
        if tokenizer is not None:
            tk = tokenizer.tk
            self._special = {int(i): t.content for i, t in tk.get_added_tokens_decoder().items()}
            decoders = _decoder_types(json.loads(tk.to_str()).get("decoder"))
            kinds = {d.get("type") for d in decoders}
            if "ByteLevel" in kinds:
                self._alphabet = _byte_level_alphabet()
            self._metaspace = "Metaspace" in kinds or any(
                d.get("type") == "Replace" and d.get("content") == " " for d in decoders)

    def __call__(self, token: int) -> tuple[str, list[int]]:
        got = self._cache.get(token)
        if got is None:
            raw = self._bytes(token)
            got = self._cache[token] = (raw.decode("utf-8", "backslashreplace"), list(raw))
        return got

    def _bytes(self, token: int) -> bytes:
        if self.tok is None:
            return f" {token}".encode()
        if token in self._special:
            return self._special[token].encode()
        piece = self.tok.tk.id_to_token(token)
        if piece is None:
            return b""
        if self._alphabet is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self.tok.decode([token]).encode()


def chat_logprobs(records, strings: TokenStrings) -> ChatLogprobs:
    """`records` as a chat choice's logprobs: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def top(token: int, logprob: float) -> TopLogprob:
        text, raw = strings(token)
        return TopLogprob(token=text, logprob=logprob, bytes=raw)

    content = []
    for r in records:
        text, raw = strings(r.token)
        content.append(TokenLogprob(token=text, logprob=r.logprob, bytes=raw,
                                    top_logprobs=[top(i, lp) for i, lp in r.top]))
    return ChatLogprobs(content=content)


def completion_logprobs(records, strings: TokenStrings, offset: int) -> tuple[CompletionLogprobs, int]:
    """`records` as a completion choice's logprobs ({tokens, token_logprobs, top_logprobs, text_offset}) and the
    offset after them: the first token starts at character `offset` of the choice's text, each next one where
    the previous token's string ends. top_logprobs: the N best tokens and the chosen one (N + 1 when it is not
    among them), as OpenAI's legacy completions give them."""
    tokens, lps, tops, offsets = [], [], [], []
    for r in records:
        text = strings(r.token)[0]
        tokens.append(text)
        lps.append(r.logprob)
        d: dict[str, float] = {}
        for i, lp in r.top:
            d.setdefault(strings(i)[0], lp)
        d.setdefault(text, r.logprob)
        tops.append(d)
        offsets.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets), offset
