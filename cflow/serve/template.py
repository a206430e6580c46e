"""Chat messages -> prompt for the server: the same chat template, end-of-turn tokens and stop strings as
`m.chat` (cflow/chatting.py): the model's own template when its file has one, else cflow's documented default,
ChatML (runtime/chat.py `ChatTemplate.default()`), whose answer also ends at the text `<|im_end|>` or
`<|im_start|>` (stop strings of every such chat request, never shown). Tools go to the template as transformers
passes them, or into a system message when the template ignores them (serve/tools.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.chat import DEFAULT_STOPS as DEFAULT_CHAT_STOPS  # noqa: F401 -- re-exported for callers
from ..runtime.chat import ChatTemplate
from .tools import template_messages


@dataclass(frozen=True)
class ChatPrompt:
    prompt: str | list[int]          # text to encode, or ids
    stops: tuple[str, ...] = ()      # stop strings the chat adds
    stop_ids: frozenset = frozenset()  # token ids that end the assistant's turn


def default_chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """The default format's text for [(role, content), ...], ending with an open assistant turn."""
    return ChatTemplate.default().render([{"role": r, "content": c} for r, c in messages])


def chat_prompt(model, messages: Sequence[dict | tuple[str, str]], tools: Sequence[dict] | None = None) -> ChatPrompt:
    """The prompt for `messages` (dicts as templates read them, or (role, content) pairs) on `model`, with
    `tools` (OpenAI's tool list) rendered in; CflowError if its template fails on these messages."""
    msgs = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
    kwargs = {}
    if tools:
        msgs = template_messages(msgs, tools, model.chat_template)
        kwargs["tools"] = list(tools)
    text = model.chat_prompt(msgs, **kwargs)
    stop_ids, stops = model.chat_stops()
    return ChatPrompt(text, stops, stop_ids)
