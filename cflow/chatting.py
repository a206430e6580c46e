"""The chat half of `CompiledModel`: a conversation rendered with the model's chat template (or cflow's
documented default, ChatML, when its file carries none: runtime/chat.py), answered with the KV cache of the
earlier turns kept.

    m.chat([{"role": "user", "content": "Hi"}])            -> the reply text
    m.stream_chat(messages)                                 -> the reply as text pieces
    m.chat_prompt(messages)                                 -> the prompt text the template makes
    m.chat_template                                         -> the ChatTemplate in use (.is_default, .stops)

`cflow run --chat` and `cflow serve`'s /v1/chat/completions use the same template, end-of-turn tokens and stop
strings, so a model chats the same way in all three.
"""

from __future__ import annotations

from collections.abc import Iterator

from .errors import CflowError


class ChatMethods:
    """Mixed into CompiledModel (which provides tokenizer, session, path, check_request, _stream)."""

    _chat = None  # the ChatTemplate, compiled on first use
    _eot: frozenset | None = None  # its end-of-turn token ids

    @property
    def chat_template(self):
        """The ChatTemplate chats use: the file's (tokenizer_config.json or GGUF metadata), else cflow's default
        (`ChatTemplate.default()`, is_default True)."""
        if self._chat is None:
            from .runtime.chat import ChatTemplate

            spec = self.session.header.get("chat_template")
            name = str(self.session.header.get("name") or self.path)
            self._chat = ChatTemplate(spec, name=name) if spec else ChatTemplate.default()
        return self._chat

    def _template(self):
        if self.tokenizer is None:
            raise CflowError(f"{self.path}: this model has no tokenizer, so it cannot read chat messages: use "
                             "generate() / stream() with token ids")
        return self.chat_template

    def chat_prompt(self, messages, add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The prompt text the chat template makes of `messages` ([{"role", "content"}, ...]), ending with an
        open assistant turn. Extra keywords (e.g. tools) go to the template."""
        return self._template().render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)

    def chat_stops(self) -> tuple[frozenset, tuple[str, ...]]:
        """(end-of-turn token ids, stop strings) that end an assistant turn in the chat template."""
        t = self._template()
        if self._eot is None:
            self._eot = frozenset(t.end_of_turn_ids(self.tokenizer))
        return self._eot, t.stops

    def stream_chat(self, messages, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None, stop: bool = True, speculate: str | None = None,
                    **template_kwargs) -> Iterator[str]:
        """Yield the assistant's reply to `messages` as text pieces; stops at the template's end-of-turn token,
        its stop strings (never shown) or an eos. The KV cache keeps the conversation: a follow-up call whose
        rendered prompt extends the previous one (plus the reply) feeds only the new tokens."""
        text = self.chat_prompt(messages, **template_kwargs)
        ids = self.tokenizer.encode(text)
        if not ids:
            raise CflowError("the chat prompt encodes to no tokens")
        n = min(max_new_tokens, self.session.max_seq - len(ids) + 1)
        self.check_request(ids, max(n, 0), temperature, top_k, top_p, seed)
        self._check_speculate(speculate)
        eot, stops = self.chat_stops()
        return self._stream(text, ids, n, temperature, top_k, top_p, seed, stop, reuse=True, stop_ids=eot,
                            stop_text=stops if stop else (), speculate=speculate)

    def chat(self, messages, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop: bool = True, speculate: str | None = None,
             **template_kwargs) -> str:
        """The assistant's reply to `messages` (see stream_chat)."""
        return "".join(self.stream_chat(messages, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                        speculate, **template_kwargs))
