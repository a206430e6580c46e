"""Chat messages -> prompt: the model's own chat template when it has one, else a documented default.

A model whose file carries a chat template (tokenizer_config.json or GGUF metadata) is rendered
with it (`CompiledModel.chat_prompt`, sandboxed Jinja) and its answer ends at the template's end-of-turn
tokens (`ChatTemplate.end_of_turn_ids`) or an end-of-text token, as `m.chat` does. A model without one gets
the ChatML-like default:

    <|im_start|>system\\nYou are ...<|im_end|>\\n
    <|im_start|>user\\nHello<|im_end|>\\n
    <|im_start|>assistant\\n

encoded with the model's plain tokenizer (markers the tokenizer does not know become ordinary text), and
the answer ends at an end-of-text token or at the text `<|im_end|>` or `<|im_start|>` (stop strings of every
such chat request, never shown).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_CHAT_STOPS = (IM_END, IM_START)


@dataclass(frozen=True)
class ChatPrompt:
    prompt: str | list[int]          # text to encode, or ids
    stops: tuple[str, ...] = ()      # stop strings the chat adds
    stop_ids: frozenset = frozenset()  # token ids that end the assistant's turn


def default_chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """ChatML-like text for [(role, content), ...], ending with an open assistant turn."""
    parts = [f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in messages]
    return "".join(parts) + f"{IM_START}assistant\n"


def chat_prompt(model, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
    """The prompt for `messages` on `model`: its own template if its file has one (CflowError if that template
    fails on these messages), else the default."""
    template = getattr(model, "chat_template", None)
    if template is not None and model.tokenizer is not None:
        text = model.chat_prompt([{"role": r, "content": c} for r, c in messages])
        eot = getattr(template, "end_of_turn_ids", None)
        return ChatPrompt(text, (), frozenset(eot(model.tokenizer)) if callable(eot) else frozenset())
    return ChatPrompt(default_chat_prompt(messages), DEFAULT_CHAT_STOPS)
