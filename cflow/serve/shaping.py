"""What a request's output must look like -> one grammar constraint per choice (runtime/grammar.py).

    response_format json_object / json_schema, grammar, guided_grammar, guided_json, json_schema
    tool_choice "required" or a named function: one call in the template's format (serve/tools.py)

`constraint_factory` checks the request's schema or grammar once (a bad one is a 400 naming the field, before
anything is queued) and returns a function that makes a fresh constraint for each choice (n > 1: each choice its
own grammar state). The end-of-text tokens the grammar allows where the output may end are the request's stop
tokens (a chat's end-of-turn token, the model's end-of-text), so a finished JSON value ends the answer as `stop`.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CflowError
from . import tools as T


class ShapeError(CflowError):
    """The request's schema or grammar cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _maker(shape: tuple[str, object], tokenizer, stop_ids) -> Callable[[], object]:
    from ..runtime import grammar as G

    kind, what = shape
    if kind == "json_object":
        return lambda: G.json_object(tokenizer, stop_ids=stop_ids)
    if kind == "json_schema":
        schema, strict = what
        return lambda: G.json_schema(tokenizer, schema, strict=strict, stop_ids=stop_ids)
    syntax = "lark" if kind == "lark" else "gbnf"
    return lambda: G.grammar(tokenizer, what, syntax=syntax, stop_ids=stop_ids)


def constraint_factory(req, tokenizer, stop_ids, template=None) -> Callable[[], object] | None:
    """A function making one choice's constraint, or None for free text. ShapeError for a bad schema / grammar."""
    shape, param = req.output_shape, shape_param(req)
    mode = getattr(req, "tool_mode", "none")
    if mode in ("required", "named"):
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        name = req.tool_choice.function.name if mode == "named" else None
        shape, param = ("lark", T.call_grammar(T.tool_format(template), T.call_schema(tools, name), tokenizer)), "tools"
    if shape is None:
        return None
    if tokenizer is None:
        raise ShapeError("Structured output needs a model with a tokenizer.", param)
    make = _maker(shape, tokenizer, stop_ids)
    try:
        make()  # compiles (and caches) the grammar: a bad one fails here, as a 400
    except CflowError as e:
        raise ShapeError(f"Invalid {param}: {e}", param) from None
    return make


def shape_param(req) -> str:
    for k in ("grammar", "guided_grammar", "guided_json", "json_schema"):
        if getattr(req, k, None):
            return k
    return "response_format"
