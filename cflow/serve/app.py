"""The HTTP layer: a FastAPI app speaking OpenAI's API in front of one `Engine`.

    POST /v1/completions, POST /v1/chat/completions     (stream: true -> server-sent events, then data: [DONE])
    GET  /v1/models, /v1/models/{id}, /health, /metrics

Handlers validate, tokenize and check the context, then hand a `Job` to the engine and relay its events;
they never touch the model's native step. Errors are OpenAI's JSON (`{"error": {message, type, param,
code}}`): 400 naming the field, 401 without the --api-key, 404 for another model, 429 with Retry-After
when the queue is full, 503 when the engine is not running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import CflowError
from .engine import Engine, EngineStopped, QueueFull
from .job import Finish, Job, Piece, SamplingParams
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    describe_validation_error,
    error_body,
    new_id,
)
from .template import chat_prompt

MAX_BODY = 4 << 20  # bytes of a request body (a context's worth of text is far less)
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat: the rest of the context


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


class EventStream(StreamingResponse):
    """Server-sent events that always watch for the client leaving (whatever ASGI version the server speaks):
    a disconnect cancels the body iterator, whose `finally` cancels the job."""

    media_type = "text/event-stream"

    def __init__(self, content, **kw):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream():
                try:
                    await self.stream_response(send)
                except OSError:  # the connection broke under a write
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def sse(obj) -> str:
    """One server-sent event. Chat deltas carry only the keys they set ({"content": "..."}, {} at the end)."""
    d = obj.model_dump() if hasattr(obj, "model_dump") else obj
    for c in d.get("choices") or ():
        if "delta" in c:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
    return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"


class _InstanceHeader:
    """ASGI middleware: every response says which server answered (X-Cflow-Instance), e.g. a Ray replica."""

    def __init__(self, app, instance: str):
        self.app, self.value = app, instance.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [(b"x-cflow-instance", self.value)]
            await send(message)

        return await self.app(scope, receive, send_with_header)


def create_app(engine: Engine, model, model_id: str, api_key: str | None = None, metrics=None,
               instance: str | None = None, owns_engine: bool = False) -> FastAPI:
    """The app for `engine`, whose slots run `model` (a CompiledModel: tokenizer, context, chat template).
    owns_engine: close the engine (and its models) when the server shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        try:
            yield
        finally:
            if owns_engine:
                await asyncio.to_thread(engine.close)

    app = FastAPI(title="cflow", summary="OpenAI-compatible server of a compiled cflow model", docs_url="/docs",
                  redoc_url=None, lifespan=lifespan)
    app.state.engine, app.state.model, app.state.model_id = engine, model, model_id
    created = int(time.time())
    context = int(model.session.max_seq)
    vocab = int(model.config.vocab_size)
    key = api_key.encode() if api_key else None
    if instance:
        app.add_middleware(_InstanceHeader, instance=instance)

    # --- errors ---------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind), e.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    def authorize(request: Request) -> None:
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key given "
                           "to cflow serve --api-key", "invalid_request_error", None, "invalid_api_key")

    async def parse(request: Request, cls):
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > MAX_BODY:
            raise ApiError(413, f"The request body is {int(size)} bytes; at most {MAX_BODY} are accepted.")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_BODY:
                raise ApiError(413, f"The request body is more than {MAX_BODY} bytes.")
            chunks.append(chunk)
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" (line {e.lineno} column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
            raise ApiError(400, f"We could not parse the JSON body of your request{where}.") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"The request body must be a JSON object, not {type(data).__name__}.")
        try:
            req = cls.model_validate(data)
        except ValidationError as e:
            message, param = describe_validation_error(e)
            raise ApiError(400, message, param=param) from None
        if req.model != model_id:
            raise ApiError(404, f"The model '{req.model}' does not exist: this server serves '{model_id}'.",
                           param="model", code="model_not_found")
        return req

    # --- prompts --------------------------------------------------------------------------------------
    def check_ids(ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ApiError(400, "The prompt encodes to no tokens.", param=param)
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ApiError(400, f"Token id {bad} is out of range 0..{vocab - 1}.", param=param)
        return ids

    def encode(text: str, param: str) -> list[int]:
        if model.tokenizer is None:
            from ..runtime.tokenizer import parse_id_prompt

            try:
                return check_ids(parse_id_prompt(text, vocab), param)
            except CflowError as e:
                raise ApiError(400, f"{e}.", param=param) from None
        return check_ids(model.tokenizer.encode(text), param)

    def sampling(req, n_prompt: int, default_max: int | None, param: str) -> SamplingParams:
        if n_prompt >= context:
            raise ApiError(400, f"The prompt is {n_prompt} tokens long; this model's maximum context length is "
                           f"{context} tokens, which leaves no room for a completion.", param=param,
                           code="context_length_exceeded")
        room = context - n_prompt
        if req.max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif req.max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{n_prompt + req.max_tokens} tokens ({n_prompt} in the prompt, {req.max_tokens} for the "
                           "completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                           code="context_length_exceeded")
        else:
            max_tokens = req.max_tokens
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                              top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
                              stops=req.stops)

    def submit(ids: list[int], params: SamplingParams) -> Job:
        job = Job(ids, params, model.tokenizer)
        try:
            engine.submit(job)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise ApiError(503, str(e), "server_error", None, "engine_stopped") from None
        return job

    async def collect(job: Job, request: Request) -> tuple[str, Finish]:
        """All of a job's text; a client that leaves cancels it."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            engine.cancel(job)

        watcher = asyncio.create_task(watch())
        parts: list[str] = []
        try:
            async for ev in job.events():
                if isinstance(ev, Piece):
                    parts.append(ev.text)
                else:
                    fin = ev
        finally:
            watcher.cancel()
            engine.cancel(job)
        if fin.reason == "error":
            raise ApiError(500, f"generation failed: {fin.error}", "server_error")
        return "".join(parts), fin

    # --- endpoints ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        st = engine.stats()
        body = {"status": "ok" if st.alive else "error", "model": model_id, "waiting": st.waiting,
                "active": st.active, "slots": st.slots}
        if instance:
            body["instance"] = instance
        return JSONResponse(body, 200 if st.alive else 503)

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off", "not_found_error")
        from .metrics import CONTENT_TYPE

        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def card() -> ModelCard:
        return ModelCard(id=model_id, created=created, max_model_len=context)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return JSONResponse(ModelList(data=[card()]).model_dump())

    @app.get("/v1/models/{name:path}")
    async def one_model(name: str, request: Request):
        authorize(request)
        if name != model_id:
            raise ApiError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(card().model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = await parse(request, CompletionRequest)
        prompt = req.prompt
        ids = encode(prompt, "prompt") if isinstance(prompt, str) else check_ids(list(prompt), "prompt")
        job = submit(ids, sampling(req, len(ids), DEFAULT_COMPLETION_TOKENS, "prompt"))
        rid, now = new_id("cmpl"), int(time.time())
        if req.stream:
            return EventStream(_completion_events(job, engine, rid, now, model_id, req.include_usage))
        text, fin = await collect(job, request)
        return JSONResponse(CompletionResponse(id=rid, created=now, model=model_id, usage=_usage(fin), choices=[
            CompletionChoice(text=text, finish_reason=fin.reason)]).model_dump())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = await parse(request, ChatCompletionRequest)
        if model.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer, so it cannot read chat messages: use /v1/completions "
                           "with token ids.", param="messages", code="no_tokenizer")
        try:
            chat = chat_prompt(model, [(m.role, m.text) for m in req.messages])
        except CflowError as e:  # the model's template refused these messages (e.g. roles out of order)
            raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        ids = encode(chat.prompt, "messages") if isinstance(chat.prompt, str) else check_ids(chat.prompt, "messages")
        params = sampling(req, len(ids), None, "messages")
        if chat.stops or chat.stop_ids:
            params = dataclasses.replace(params, stops=tuple(dict.fromkeys(params.stops + chat.stops)),
                                         stop_ids=chat.stop_ids)
        job = submit(ids, params)
        rid, now = new_id("chatcmpl"), int(time.time())
        if req.stream:
            return EventStream(_chat_events(job, engine, rid, now, model_id, req.include_usage))
        text, fin = await collect(job, request)
        return JSONResponse(ChatCompletionResponse(id=rid, created=now, model=model_id, usage=_usage(fin), choices=[
            ChatChoice(message=AssistantMessage(content=text), finish_reason=fin.reason)]).model_dump())

    return app


def _usage(fin: Finish) -> Usage:
    return Usage(prompt_tokens=fin.prompt_tokens, completion_tokens=fin.completion_tokens,
                 total_tokens=fin.prompt_tokens + fin.completion_tokens)


def _error_event(fin: Finish) -> str:
    return sse(error_body(f"generation failed: {fin.error}", "server_error"))


async def _completion_events(job: Job, engine: Engine, rid: str, created: int, model_id: str,
                             include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, reason: str | None = None, usage: Usage | None = None, choices=True):
        return sse(CompletionResponse(id=rid, created=created, model=model_id, usage=usage, choices=[
            CompletionChoice(text=text, finish_reason=reason)] if choices else []))

    try:
        async for ev in job.events():
            if isinstance(ev, Piece):
                if ev.text:
                    yield chunk(ev.text)
            elif ev.reason == "error":
                yield _error_event(ev)
            elif ev.reason != "cancelled":
                yield chunk("", ev.reason)
                if include_usage:
                    yield chunk("", usage=_usage(ev), choices=False)
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(job)


async def _chat_events(job: Job, engine: Engine, rid: str, created: int, model_id: str,
                       include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: Delta | None, reason: str | None = None, usage: Usage | None = None):
        choices = [ChatChunkChoice(delta=delta, finish_reason=reason)] if delta is not None else []
        return sse(ChatCompletionChunk(id=rid, created=created, model=model_id, choices=choices, usage=usage))

    try:
        first = True
        async for ev in job.events():
            if first and not (isinstance(ev, Finish) and ev.reason == "error"):
                yield chunk(Delta(role="assistant", content=""))
                first = False
            if isinstance(ev, Piece):
                if ev.text:
                    yield chunk(Delta(content=ev.text))
            elif ev.reason == "error":
                yield _error_event(ev)
            elif ev.reason != "cancelled":
                yield chunk(Delta(), ev.reason)
                if include_usage:
                    yield chunk(None, usage=_usage(ev))
        yield "data: [DONE]\n\n"
    finally:
        engine.cancel(job)


def build_app(path: str, threads: int | None = None, max_batch: int = 1, max_queue: int = 64,
              api_key: str | None = None, model_id: str | None = None, instance: str | None = None,
              **load_kwargs) -> FastAPI:
    """Load `path` into an engine of `max_batch` slots and return the app that owns it (closed at shutdown).
    load_kwargs go to `cflow.load` (experts="disk", expert_cache_mb=..., weights="disk", ...)."""
    from pathlib import Path

    from .backends import load_backend
    from .metrics import ServeMetrics

    backend = load_backend(path, threads=threads, slots=max_batch, **load_kwargs)
    try:
        metrics = ServeMetrics()
        engine = Engine(backend, max_queue=max_queue, metrics=metrics)
    except BaseException:
        backend.close()
        raise
    return create_app(engine, backend.model, model_id or Path(path).stem, api_key=api_key, metrics=metrics,
                      instance=instance, owns_engine=True)
