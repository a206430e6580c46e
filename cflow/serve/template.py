"""Chat messages -> prompt: the model's own chat template when it has one, else a documented default.

The model's template comes from `CompiledModel.chat_prompt(messages)` when the API offers it (the chat
template work of issue 12); it may return text or token ids. Until then, and for models without a template,
the default is ChatML-like:

    <|im_start|>system\\nYou are ...<|im_end|>\\n
    <|im_start|>user\\nHello<|im_end|>\\n
    <|im_start|>assistant\\n

encoded with the model's plain tokenizer (markers the tokenizer does not know become ordinary text), and
the answer ends at the model's end-of-text tokens or at the text `<|im_end|>` (a stop string of every chat
request, never shown).
"""

from __future__ import annotations

from collections.abc import Sequence

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_CHAT_STOPS = (IM_END, IM_START)


def default_chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """ChatML-like text for [(role, content), ...], ending with an open assistant turn."""
    parts = [f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages]
    return "".join(parts) + f"{IM_START}assistant\n"


def chat_prompt(model, messages: Sequence[tuple[str, str]]) -> tuple[str | list[int], tuple[str, ...]]:
    """(prompt, extra stop strings) for `messages` on `model`: its own template if it has one."""
    own = getattr(model, "chat_prompt", None)
    if callable(own):
        out = own([{"role": r, "content": c} for r, c in messages])
        return (out if isinstance(out, str) else [int(i) for i in out]), ()
    return default_chat_prompt(messages), DEFAULT_CHAT_STOPS
