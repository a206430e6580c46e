"""What a generation request is checked against before anything runs: the prompt as token ids, the sampling
options, and that the prompt and the new tokens fit the context. Each fault is one CflowError naming the
argument (RuntimeFault for what the context cannot hold)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..errors import CflowError, RuntimeFault


def whole(v) -> bool:
    """An integer (NumPy's too), and not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def prompt_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Text (encoded by `tokenizer`, or read as ids "1 2 3" without one) or a sequence of token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            from .tokenizer import parse_id_prompt

            ids = parse_id_prompt(prompt, vocab_size)
            if not ids:
                raise CflowError("empty prompt")
            return ids
        ids = tokenizer.encode(prompt)
        if not ids:
            raise CflowError("the prompt encodes to no tokens")
        return ids
    try:
        arr = np.asarray(prompt)
    except (TypeError, ValueError):
        arr = np.asarray([None])
    if arr.size == 0:
        raise CflowError("empty prompt")
    if arr.dtype.kind not in "iu":
        raise CflowError(f"a prompt is text or a list of token ids (integers), not {short(prompt)}")
    ids = [int(i) for i in arr.reshape(-1)]
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise CflowError(f"token id {bad} out of range 0..{vocab_size - 1}")
    return ids


def check_sampling(max_new_tokens, temperature, top_k, top_p, seed) -> None:
    if not whole(max_new_tokens) or max_new_tokens < 0:
        raise CflowError(f"max_new_tokens must be a whole number >= 0, not {short(max_new_tokens)}")
    if not real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise CflowError(f"temperature must be a finite number >= 0 (0 = greedy), not {short(temperature)}")
    if not whole(top_k) or top_k < 0:
        raise CflowError(f"top_k must be a whole number >= 0 (0 = all tokens), not {short(top_k)}")
    if not real(top_p) or not 0 < top_p <= 1:
        raise CflowError(f"top_p must be a number in (0, 1], not {short(top_p)}")
    if seed is not None and (not whole(seed) or not 0 <= seed < 2**128):
        raise CflowError(f"seed must be a whole number >= 0 (or None: a fresh seed), not {short(seed)}")


def check_fits(n: int, max_new_tokens: int, ctx: int) -> None:
    """A prompt of n tokens and max_new_tokens new ones fit a context of ctx positions (the last new token is
    sampled, never fed)."""
    if n > ctx:
        raise RuntimeFault(f"the prompt is {n} tokens long; this model's context is {ctx} tokens")
    if n + max_new_tokens - 1 > ctx:
        raise RuntimeFault(f"the prompt ({n} tokens) and max_new_tokens={max_new_tokens} need "
                           f"{n + max_new_tokens - 1} positions; this model's context is {ctx} tokens: "
                           f"at most {ctx - n + 1} new tokens fit")


def check_speculate(speculate, tmax: int, draft) -> None:
    if speculate not in (None, "ngram", "draft"):
        raise CflowError(f"speculate must be None, 'ngram' or 'draft', not {short(speculate)}")
    if speculate is None:
        return
    if tmax < 2:
        raise CflowError("speculative decoding checks drafts with the multi-token body: load with "
                         "prefill_block >= 2 and the weights in RAM")
    if speculate == "draft" and draft is None:
        raise CflowError("speculate='draft' needs a draft model: load(path, draft='small.vflow')")


def check_draft(vocab: int, tokenizer, draft_vocab: int, draft_tokenizer, draft_path) -> None:
    """A draft model must share the tokenizer: the same vocabulary size, and the same ids for a probe text."""
    if draft_vocab != vocab:
        raise CflowError(f"draft model {draft_path}: vocabulary of {draft_vocab} tokens, this model has {vocab}: "
                         "a draft must share the tokenizer")
    if tokenizer is not None and draft_tokenizer is not None:
        probe = "The quick brown fox, 12 + 30 = 42;\n\tdef f(x): return x  # ünïcode"
        if tokenizer.encode(probe) != draft_tokenizer.encode(probe):
            raise CflowError(f"draft model {draft_path}: its tokenizer encodes text differently from this model's: "
                             "a draft must share the tokenizer")
