"""The OpenAI wire format: request models (validated strictly, pydantic) and response models.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions` bodies. Types are strict (a string
is not a number, `true` is not an integer); unknown fields are ignored, as OpenAI's own clients add new
ones over time. Fields cflow cannot honour (tools, echo, suffix, ...) are refused with a 400 naming the field
instead of being silently ignored. `top_k`, `min_p`, `repetition_penalty` (vLLM's names) and `repeat_last_n`
(llama.cpp's) are accepted as extensions.
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


class _Sampling(_Strict):
    """What both endpoints share: the model, sampling, stopping and streaming."""

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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

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

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tools (function calling) are not supported by cflow")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none"):
            raise ValueError("tools (function calling) are not supported by cflow")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format {\"type\": \"text\"} is supported by cflow")
        return v

    @model_validator(mode="after")
    def _max(self):
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


# --- errors -------------------------------------------------------------------------------------------
_FIELDS = set()
for _m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart, StreamOptions):
    _FIELDS |= set(_m.model_fields)


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


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


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


class Delta(BaseModel):
    role: str | None = None
    content: str | None = None


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
