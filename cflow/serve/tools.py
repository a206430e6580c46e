"""Tools (function calling) in chat: the tools rendered into the prompt, the model's calls parsed out of its text.

Rendering: the OpenAI `tools` list goes to the chat template as the `tools` variable (as transformers'
apply_chat_template does), the messages' `tool_calls` with their `arguments` as objects (templates write them
with `tojson`) and `role: tool` messages with their content. A template that does not render tools (cflow's
ChatML default among them) gets them in a system message in the Hermes format that Qwen 2.5, Hermes and many
fine-tunes are trained on (`tools_system_prompt`).

Parsing: three formats, told apart by the template's own text (`tool_format`); in each, a reply that is only the
calls' JSON counts too (small models trained on these formats often leave the tags out):

    hermes    <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, one block per call, text around them
              is content (Qwen 2.5 / 3, Hermes, the default)
    llama3    the whole reply is {"name": ..., "parameters": {...}} (or "arguments"), optionally after
              <|python_tag|>; several calls separated by ';' (Llama 3.1 - 3.3)
    mistral   [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

`ToolCallParser` reads the reply as it streams: content is passed on as soon as it cannot be the start of a
call, each call is handed out when its block closes (hermes) or at the end (the others, whose reply is wholly a
call). A block that does not parse as a call stays content, as vLLM does: nothing the model wrote is lost.

With tool_choice "required" or a named function the reply is generated under a grammar (`call_grammar`): the
format's markers around a JSON object matching `{"name": the function, "arguments": its parameters}`, so the
call always parses and its arguments validate against the function's schema.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

HERMES, LLAMA3, MISTRAL = "hermes", "llama3", "mistral"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def tool_format(template) -> str:
    """Which call format the chat template's model writes (by the template's own markers)."""
    src = getattr(template, "source", "") or ""
    if TOOL_CALLS in src:
        return MISTRAL
    if PYTHON_TAG in src or ('"parameters"' in src and "ipython" in src):
        return LLAMA3
    return HERMES


def renders_tools(template) -> bool:
    """Whether the template writes the tools it is given into the prompt (probed with a made-up function)."""
    probe = "cflow_probe_fn_7c1d"
    tool = {"type": "function", "function": {"name": probe, "description": "", "parameters": {"type": "object"}}}
    try:
        return probe in template.render([{"role": "user", "content": "x"}], tools=[tool])
    except Exception:  # noqa: BLE001 -- a template that fails with tools does not render them
        return False


def tools_system_prompt(tools: Sequence[dict]) -> str:
    """The tools in the Hermes format, for a template that does not render them itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            f"call, return a json object with function name and arguments within {OPEN}{CLOSE} XML tags:\n{OPEN}\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def template_messages(messages: Sequence[dict], tools: Sequence[dict] | None, template) -> list[dict]:
    """OpenAI chat messages -> the dicts chat templates read: tool calls' arguments as objects, and, when the
    template does not render tools itself, the tools as (the start of) the system message."""
    out = []
    for m in messages:
        d = dict(m)
        if d.get("tool_calls"):
            calls = []
            for c in d["tool_calls"]:
                fn = dict(c.get("function") or {})
                try:
                    fn["arguments"] = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    pass  # not JSON: the template gets the text
                calls.append({**c, "function": fn})
            d["tool_calls"] = calls
        out.append(d)
    if tools and not renders_tools(template):
        text = tools_system_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call(obj) -> ToolCall | None:
    """A parsed JSON value -> a call, if it is one ({"name": str, "arguments" | "parameters": object})."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse_calls(text: str) -> list[ToolCall] | None:
    """A whole reply in the llama3 / mistral formats -> its calls, or None if it is not (only) calls."""
    t = text.strip()
    for tag in (PYTHON_TAG, TOOL_CALLS):
        t = t.removeprefix(tag).strip()
    if not t:
        return None
    dec, calls, at = json.JSONDecoder(), [], 0
    while at < len(t):
        try:
            obj, end = dec.raw_decode(t, at)
        except ValueError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        for o in objs:
            c = _call(o)
            if c is None:
                return None
            calls.append(c)
        at = end
        while at < len(t) and t[at] in " \t\r\n;,":
            at += 1
    return calls or None


class ToolCallParser:
    """Streams a reply apart into content and tool calls (see the module docstring). A reply that is wholly
    JSON (after <|python_tag|> or [TOOL_CALLS] in those formats) is held to its end and becomes calls if it
    parses as calls of the given functions (`names`; small models trained on Hermes often leave the tags out);
    else it is content."""

    def __init__(self, fmt: str = HERMES, names: Sequence[str] | None = None):
        self.fmt = fmt
        self.names = None if names is None else frozenset(names)
        self.pending = ""  # text not yet handed out: the undecided start, a possible marker start, an open block
        self.mode = "start"  # start (nothing decided) | text | whole (the reply may be only calls)
        self.inside = False  # hermes: within a <tool_call> block
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content that is safe to show, calls completed by this text)."""
        self.pending += text
        if self.mode == "start":
            head = self.pending.lstrip()
            starts = ("{", "[", PYTHON_TAG, TOOL_CALLS) if self.fmt != HERMES else ("{",)
            if not head or any(s.startswith(head) and s != head for s in starts):
                return "", []  # nothing yet, or the start of a marker
            self.mode = "whole" if head.startswith(starts) else "text"
        if self.mode == "whole":
            return "", []  # parsed at the end
        if self.fmt != HERMES:
            out, self.pending = self.pending, ""
            return out, []
        return self._blocks()

    def _blocks(self) -> tuple[str, list[ToolCall]]:
        """Hermes text: content around <tool_call> blocks, each block a call when it closes."""
        content, calls = "", []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    return content, calls
                block, self.pending, self.inside = self.pending[:end], self.pending[end + len(CLOSE):], False
                found = self._known(parse_calls(block))
                if found is None:  # not a call after all: it was text
                    content += OPEN + block + CLOSE
                else:
                    calls += found
                    self.calls += found
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                content += self.pending[:start]
                self.pending, self.inside = self.pending[start + len(OPEN):], True
                continue
            keep = next((k for k in range(min(len(OPEN) - 1, len(self.pending)), 0, -1)
                         if self.pending.endswith(OPEN[:k])), 0)
            cut = len(self.pending) - keep
            content, self.pending = content + self.pending[:cut], self.pending[cut:]
            return content, calls

    def _known(self, calls: list[ToolCall] | None) -> list[ToolCall] | None:
        if calls is None or (self.names is not None and any(c.name not in self.names for c in calls)):
            return None
        return calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply: (content, calls)."""
        rest, self.pending = self.pending, ""
        if self.mode in ("whole", "start") or self.inside:
            found = self._known(parse_calls(rest))
            if found is not None:  # a whole reply of calls, or an unclosed block cut at its closing tag
                self.calls += found
                return "", found
            return (OPEN + rest if self.inside else rest), []
        return rest, []


def call_schema(tools: Sequence[dict], name: str | None = None) -> dict:
    """The JSON schema of one call: {"name": <a function>, "arguments": <its parameters>}; only `name` if given."""
    options = []
    for t in tools:
        fn = t["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str, tokenizer) -> str:
    """A marker in a Lark grammar: a token reference when the tokenizer has it as one added token (the engine
    lexes quoted text byte by byte, which an added token such as Qwen's <tool_call> does not match), else text."""
    tk = getattr(tokenizer, "tk", None)
    tid = tk.token_to_id(text) if tk is not None else None
    if tid is not None and tid in tk.get_added_tokens_decoder():
        return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(fmt: str, schema: dict, tokenizer=None) -> str:
    """A Lark grammar (llguidance's syntax, with %json for the call object) for exactly one call in `fmt`, its JSON
    in the one-line layout of every JSON answer (runtime/grammar.py JSON_LAYOUT)."""
    from ..runtime.grammar import JSON_LAYOUT

    obj = f"%json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
    if fmt == MISTRAL:
        return f'start: {_literal(TOOL_CALLS, tokenizer)} " "? "[" call "]"\ncall: {obj}\n'
    if fmt == LLAMA3:
        return f"start: call\ncall: {obj}\n"
    return f'start: {_literal(OPEN, tokenizer)} "\\n" call "\\n" {_literal(CLOSE, tokenizer)}\ncall: {obj}\n'
