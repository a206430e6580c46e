"""Chat templates: a conversation rendered with the model's own Jinja template, sandboxed as transformers does.

    t = ChatTemplate(header["chat_template"], name="model.vflow")
    t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True) -> prompt text
    t.end_of_turn_ids(tokenizer) -> ids that end an assistant turn (found by rendering one)
    ChatTemplate.default() -> cflow's chat format for a model whose file carries no template

A model without a template chats in one documented default format everywhere (`m.chat`, `cflow run --chat`,
`cflow serve`), ChatML:

    <|im_start|>system\nYou are ...<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n

encoded with the model's tokenizer (markers it does not know become ordinary text); the answer ends at an
end-of-text token or at the text `<|im_end|>` or `<|im_start|>` (the default's `stops`, never shown).

The template comes from tokenizer_config.json / chat_template.jinja or the GGUF metadata (the frontends put
it in GraphMeta.chat_template, the compiler in the file header) as {"template", "bos_token", "eos_token"}.
Rendering is transformers' apply_chat_template: jinja2's ImmutableSandboxedEnvironment (no attribute writes,
no unsafe calls), trim_blocks and lstrip_blocks, the loop-controls extension, `raise_exception(msg)`,
`strftime_now(fmt)`, a `tojson` filter that keeps non-ASCII text, and the variables messages,
add_generation_prompt, bos_token, eos_token (and any extra keyword, e.g. tools). A template that raises, fails,
runs longer than RENDER_SECONDS or renders more than MAX_OUTPUT characters is one CflowError naming the
template; the time limit also stops loops that produce nothing (a trace hook on the template's own code).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence

from ..errors import CflowError

RENDER_SECONDS = 2.0
MAX_OUTPUT = 4 << 20  # characters of a rendered prompt (and of any string or list a template builds)
MAX_POWER_BITS = 4096


class ChatTemplateError(CflowError):
    """A chat template failed to compile or render (names the template)."""


class _Stop(Exception):
    pass


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt)


def _environment():
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise CflowError("chat templates need the 'jinja2' package: pip install jinja2") from None

    class Env(ImmutableSandboxedEnvironment):
        """transformers' sandbox, plus bounds on what a hostile template can build or how long it can run."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise _Stop(f"{left} ** {right} is too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_OUTPUT:
                        raise _Stop(f"a sequence of {len(seq) * n} items is too large")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
                if len(left) + len(right) > MAX_OUTPUT:
                    raise _Stop(f"a sequence of more than {MAX_OUTPUT} items is too large")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
            _tick()
            out = super().call(__context, __obj, *args, **kwargs)
            if isinstance(out, (str, list, tuple)) and len(out) > MAX_OUTPUT:
                raise _Stop(f"a call built {len(out)} items")
            return out

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_deadline = [float("inf")]


def _tick() -> None:
    if time.monotonic() > _deadline[0]:
        raise _Stop(f"did not finish within {RENDER_SECONDS:g} s (a loop?)")


def _guarded(fn):
    """Run fn with a deadline checked on every line of the template's compiled code and every call it makes."""
    old = sys.gettrace()
    _deadline[0] = time.monotonic() + RENDER_SECONDS

    def local(frame, event, arg):
        _tick()
        return local

    def glob(frame, event, arg):
        _tick()
        return local if frame.f_code.co_filename == "<template>" else None

    sys.settrace(glob)
    try:
        return fn()
    finally:
        sys.settrace(old)
        _deadline[0] = float("inf")


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise CflowError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise CflowError(f"messages[{i}] must be a dict with a string 'role' (and 'content'), not {m!r:.60}")
        out.append(dict(m))
    return out


DEFAULT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_STOPS = ("<|im_end|>", "<|im_start|>")


class ChatTemplate:
    """One model's chat template, compiled once. `stops`: text that ends an assistant turn besides the
    end-of-turn tokens (the default format's markers, which a model's tokenizer may not know as tokens)."""

    def __init__(self, spec, name: str = "chat template", stops: Sequence[str] = ()):
        if isinstance(spec, str):
            spec = {"template": spec}
        if not isinstance(spec, Mapping) or not isinstance(spec.get("template"), str) or not spec["template"]:
            raise CflowError(f"{name}: the chat template must be {{'template': text, 'bos_token', 'eos_token'}}")
        self.name = name
        self.stops = tuple(stops)
        self.is_default = False
        self.source = spec["template"]
        self.bos_token = spec.get("bos_token") if isinstance(spec.get("bos_token"), str) else None
        self.eos_token = spec.get("eos_token") if isinstance(spec.get("eos_token"), str) else None
        import jinja2

        try:
            self._tpl = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template of {name}: syntax error at line {e.lineno}: {e.message}") from None

    @classmethod
    def default(cls) -> ChatTemplate:
        """cflow's chat format for a model whose file carries no template (ChatML; see the module docstring)."""
        t = cls(DEFAULT_TEMPLATE, name="cflow's default chat format (ChatML)", stops=DEFAULT_STOPS)
        t.is_default = True
        return t

    def render(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text of `messages` (and an open assistant turn if add_generation_prompt)."""
        import jinja2

        msgs = _check_messages(messages)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs,
                     "messages": msgs, "add_generation_prompt": add_generation_prompt}

        def run() -> str:
            parts, n = [], 0
            for piece in self._tpl.generate(**variables):
                n += len(piece)
                if n > MAX_OUTPUT:
                    raise _Stop(f"rendered more than {MAX_OUTPUT} characters")
                parts.append(piece)
            return "".join(parts)

        try:
            return _guarded(run)
        except _Stop as e:
            raise ChatTemplateError(f"chat template of {self.name}: {e}") from None
        except jinja2.TemplateError as e:  # raise_exception(...) and undefined / security errors
            kind = "raised" if type(e) is jinja2.TemplateError else f"failed ({type(e).__name__})"
            raise ChatTemplateError(f"chat template of {self.name} {kind}: {e}") from None
        except RecursionError:
            raise ChatTemplateError(f"chat template of {self.name}: recursion too deep (a loop?)") from None
        except MemoryError:
            raise ChatTemplateError(f"chat template of {self.name}: ran out of memory") from None
        except Exception as e:  # noqa: BLE001 -- a template is code: any error in it is the template's
            raise ChatTemplateError(f"chat template of {self.name} failed ({type(e).__name__}): {e}") from None

    def end_of_turn_ids(self, tokenizer) -> set[int]:
        """Token ids that close an assistant turn in this template (e.g. <|im_end|>, <|eot_id|>, <end_of_turn>):
        render a conversation ending in a known assistant reply and take the special token right after it."""
        marker = "\u2063cflow-reply\u2063"
        try:
            text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                               add_generation_prompt=False)
        except CflowError:
            return set()
        at = text.rfind(marker)
        if at < 0:
            return set()
        rest = text[at + len(marker):].lstrip(" ")
        if not rest:
            return set()
        ids = tokenizer.encode(rest, add_special=False)
        return {ids[0]} if ids and ids[0] in special_ids(tokenizer) else set()


def special_ids(tokenizer) -> set[int]:
    """Ids of the special added tokens of a runtime Tokenizer (its `tokenizers` object)."""
    tk = getattr(tokenizer, "tk", tokenizer)
    try:
        return {int(i) for i, t in tk.get_added_tokens_decoder().items() if t.special}
    except AttributeError:
        return set()
