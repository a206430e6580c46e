"""The OpenAI wire format: request models (validated strictly, pydantic) and response models.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions` bodies. Types are strict (a string
is not a number, `true` is not an integer); unknown fields are ignored, as OpenAI's own clients add new
ones over time. Fields cflow cannot honour (echo, suffix, best_of > 1) are refused with a 400 naming the field
instead of being silently ignored. `top_k`, `min_p`, `repetition_penalty` (vLLM's names) and `repeat_last_n`
(llama.cpp's) are accepted as extensions, and so are the structured-output fields of the peers: `grammar` and
`json_schema` (llama-server), `guided_grammar` and `guided_json` (vLLM), besides OpenAI's `response_format`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 16  # choices per request (each one a sequence of its own in the queue and a slot)
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's chat limit (its completions allow 5, vLLM more)
Penalty = Annotated[float, Field(ge=-2, le=2)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class _Sampling(_Strict):
    """What both endpoints share: the model, sampling, stopping, streaming and the output's shape."""

    model: str | None = None  # the one model this server serves when left out (as llama-server)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server's GBNF grammar
    guided_grammar: str | None = None  # vLLM's name for the same
    guided_json: dict[str, Any] | str | None = None  # vLLM's JSON schema field
    json_schema: dict[str, Any] | None = None  # llama-server's JSON schema field

    @model_validator(mode="after")
    def _one_shape(self):
        given = [k for k in ("grammar", "guided_grammar", "guided_json", "json_schema") if getattr(self, k)]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"give one of response_format, grammar, guided_grammar, guided_json, json_schema; "
                             f"got {', '.join(given)}")
        return self

    @property
    def output_shape(self) -> tuple[str, Any] | None:
        """What the output must match: ("json_object", None), ("json_schema", (schema, strict)),
        ("gbnf", text), or None (free text)."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return "json_object", None
        if rf is not None and rf.type == "json_schema":
            return "json_schema", (rf.json_schema.schema_, rf.json_schema.strict is not False)
        if self.grammar or self.guided_grammar:
            return "gbnf", self.grammar or self.guided_grammar
        if self.guided_json is not None or self.json_schema is not None:
            schema = self.guided_json if self.guided_json is not None else self.json_schema
            return "json_schema", (schema, True)
        return None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None:
            if len(v) > MAX_STOP:
                raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(v)}")
            if any(not s for s in v):
                raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for k in v or ():
            if not (k.isascii() and k.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (\"50256\"), not {k!r:.30}")
        return v

    @property
    def bias(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, one token-id list, or a list holding exactly one of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str | list):
                if len(v) != 1:
                    raise ValueError(f"cflow takes one prompt per request, got {len(v)}")
                v = v[0]
        if not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo is not supported by cflow")
        return v

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token in the logprobs (the chosen token is always given); None: no logprobs."""
        return self.logprobs

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("best_of must be 1")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported by cflow")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def template_dict(self) -> dict:
        """The message as chat templates read it (role, content text, tool_calls, tool_call_id, name)."""
        d = {"role": self.role, "content": self.text}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        for k in ("tool_call_id", "name"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("at least one message is needed")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def logprob_count(self) -> int | None:
        """Alternatives per token in the logprobs; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tool_choice(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        c = self.tool_choice
        if c not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice asks for a call, but no tools are given")
        if isinstance(c, NamedToolChoice) and c.function.name not in names:
            raise ValueError(f"tool_choice names function {c.function.name!r}, which is not in tools")
        if self.tool_mode in ("required", "named") and self.output_shape is not None:
            raise ValueError("tool_choice required or a named function already fixes the output: no "
                             "response_format or grammar with it")
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto, required, or named (tool_choice names a function)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @model_validator(mode="after")
    def _max(self):
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


# --- errors -------------------------------------------------------------------------------------------
_FIELDS = set()
for _m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat,
           JsonSchemaFormat, ToolSpec, FunctionSpec, NamedToolChoice, FunctionName, ToolCallIn, CalledFunction):
    _FIELDS |= set(_m.model_fields) | {f.alias for f in _m.model_fields.values() if f.alias}


def error_param(loc) -> str | None:
    """pydantic's error location -> OpenAI's `param` ('messages[0].content'); union-member tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELDS:
            out += f".{part}" if out else part
    return out or None


def describe_validation_error(e: ValidationError) -> tuple[str, str | None]:
    """The first error of a failed validation as (message, param)."""
    err = e.errors(include_url=False)[0]
    param = error_param(err.get("loc", ()))
    msg = err.get("msg", "invalid value")
    kind = err.get("type", "")
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if kind.startswith("value_error"):
        msg = msg.removeprefix("Value error, ")
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r:.40})"
    return f"Invalid value for '{param}': {msg}{shown}.", param


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- responses ----------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """llama-server's `timings` (its addition to OpenAI's answers, read by llama.cpp's tools), from the engine's
    clock: the prompt from admission to the first token (the part of the prompt not taken from the prefix cache,
    read, and the first token drawn), the answer from its first token to its last; predicted_per_token_ms is the
    time between two tokens (the intervals, not the tokens, counted)."""

    cache_n: int  # prompt tokens taken from the prefix cache
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's (or chunk's) logprobs: one entry per token."""

    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's (or chunk's) logprobs, the legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    timings: Timings | None = None  # llama-server's: on the last chunk of a choice, on a one-choice answer


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[dict] | None = None  # {"id", "type": "function", "function": {"name", "arguments"}}


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    timings: Timings | None = None  # llama-server's: on the last chunk of a choice, on a one-choice answer


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None  # each with its "index" among the choice's calls


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    timings: Timings | None = None  # llama-server's: on the last chunk of a choice, on a one-choice answer


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "cflow"
    max_model_len: int | None = None  # the context, in tokens (vLLM's name)
    context_length: int | None = None  # the same, by the name llama-server's clients read
    quantization: str | None = None  # the weights' type: q4, q8, f16, f32, or stored (a GGUF's own types)
    kv_cache: str | None = None  # the KV cache's element type


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
