"""The HTTP layer: a FastAPI app speaking OpenAI's API in front of one `Engine`.

    POST /v1/completions, POST /v1/chat/completions     (stream: true -> server-sent events, then data: [DONE])
    GET  /v1/models, /v1/models/{id}, /health, /metrics

Handlers validate, tokenize and check the context, then hand a `Job` to the engine (n jobs for n choices,
queued together) and relay their events; they never touch the model's native step. Errors are OpenAI's JSON
(`{"error": {message, type, param, code}}`): 400 naming the field, 401 without the --api-key, 404 for another
model, 429 with Retry-After when the queue is full, 503 when the engine is not running.
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
from ..runtime.choice import REPETITION_WINDOW
from .engine import Engine, EngineStopped, QueueFull
from .job import Finish, Job, Piece, SamplingParams, drain
from .logprobs import TokenStrings, chat_logprobs, completion_logprobs
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
from .shaping import ShapeError, constraint_factory
from .shaping import shape_param as _shape_param
from .template import chat_prompt
from .tools import ToolCallParser, tool_format

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


def _answer(obj) -> dict:
    """An answer's JSON object; llama-server's `timings` only where there are some."""
    d = obj.model_dump() if hasattr(obj, "model_dump") else obj
    if "timings" in d and d["timings"] is None:
        del d["timings"]
    return d


def sse(obj) -> str:
    """One server-sent event. Chat deltas carry only the keys they set ({"content": "..."}, {} at the end)."""
    d = _answer(obj)
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


# --- errors as OpenAI's JSON ----------------------------------------------------------------------------------
async def _api_error(request: Request, e: ApiError):
    return e.response()


async def _http_error(request: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind), e.status_code)


async def _bug(request: Request, e: Exception):
    return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)


# --- request validation ---------------------------------------------------------------------------------------
def check_api_key(request: Request, key: bytes | None) -> None:
    """401 unless the request carries 'Authorization: Bearer KEY' (anyone passes without a key)."""
    if key is None:
        return
    got = request.headers.get("authorization", "")
    scheme, _, token = got.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
        raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key given "
                       "to cflow serve --api-key", "invalid_request_error", None, "invalid_api_key")


async def read_json_object(request: Request) -> dict:
    """The body as a JSON object: 413 past MAX_BODY bytes, 400 if it is not JSON or not an object."""
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
    return data


def validate_request(cls, data: dict, model_id: str):
    """`data` as a `cls` request: 400 naming the field that is wrong, 404 when it asks for another model."""
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        message, param = describe_validation_error(e)
        raise ApiError(400, message, param=param) from None
    if req.model is not None and req.model != model_id:
        raise ApiError(404, f"The model '{req.model}' does not exist: this server serves '{model_id}'.",
                       param="model", code="model_not_found")
    return req


def check_ids(ids: list[int], param: str, vocab: int) -> list[int]:
    if not ids:
        raise ApiError(400, "The prompt encodes to no tokens.", param=param)
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        raise ApiError(400, f"Token id {bad} is out of range 0..{vocab - 1}.", param=param)
    return ids


def sampling_params(req, n_prompt: int, context: int, default_max: int | None, param: str,
                    vocab: int) -> SamplingParams:
    """The request's sampling; max_tokens defaults to min(default_max, the room left in the context)."""
    bias = req.bias
    bad = next((i for i in bias if i >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"logit_bias names token {bad}, out of range 0..{vocab - 1}.", param="logit_bias")
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
                          stops=req.stops, min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
                          frequency_penalty=req.frequency_penalty or 0.0,
                          repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                          repetition_window=REPETITION_WINDOW if req.repeat_last_n is None else req.repeat_last_n,
                          logit_bias=tuple(sorted(bias.items())), logprobs=req.logprob_count)


# --- the endpoints --------------------------------------------------------------------------------------------
class Routes:
    """The endpoints of one app: one engine, and the model its slots run (tokenizer, context, chat template)."""

    def __init__(self, engine: Engine, model, model_id: str, api_key: str | None, metrics, instance: str | None):
        self.engine, self.model, self.model_id = engine, model, model_id
        self.key = api_key.encode() if api_key else None
        self.metrics, self.instance = metrics, instance
        self.created = int(time.time())
        self.context = int(model.session.max_seq)
        self.vocab = int(model.config.vocab_size)
        self._strings: TokenStrings | None = None

    @property
    def strings(self) -> TokenStrings:
        """How logprobs show each token (built on the first request that asks for them)."""
        if self._strings is None:
            self._strings = TokenStrings(self.model.tokenizer)
        return self._strings

    def register(self, app: FastAPI) -> None:
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{name:path}")(self.one_model)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)

    # --- helpers of the handlers --------------------------------------------------------------------------
    async def parse(self, request: Request, cls):
        return validate_request(cls, await read_json_object(request), self.model_id)

    def encode(self, text: str, param: str) -> list[int]:
        if self.model.tokenizer is None:
            from ..runtime.tokenizer import parse_id_prompt

            try:
                return check_ids(parse_id_prompt(text, self.vocab), param, self.vocab)
            except CflowError as e:
                raise ApiError(400, f"{e}.", param=param) from None
        return check_ids(self.model.tokenizer.encode(text), param, self.vocab)

    def submit(self, ids: list[int], params: SamplingParams, n: int = 1, shape=None) -> list[Job]:
        """One job per choice, queued together or not at all. Choice i of a request with seed s samples with seed
        s + i (choice 0 is the request's tokens with n = 1, m.generate's with that seed). shape: (make, eos_id),
        a function making each choice's grammar constraint and the token that ends a finished one."""
        most = self.engine.max_queue + self.engine.backend.slots
        if n > most:
            raise ApiError(400, f"n={n} choices are more than this server holds at once ({most}: its slots and "
                           "--max-queue).", param="n")
        make, eos_id = shape or (None, None)
        jobs = [Job(ids, params if params.seed is None else dataclasses.replace(params, seed=params.seed + i),
                    self.model.tokenizer, constraint=make() if make else None, eos_id=eos_id) for i in range(n)]
        try:
            self.engine.submit(*jobs)
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error", None, "queue_full",
                           headers={"Retry-After": str(e.retry_after)}) from None
        except EngineStopped as e:
            raise ApiError(503, str(e), "server_error", None, "engine_stopped") from None
        return jobs

    async def collect(self, jobs: list[Job], request: Request) -> list[tuple[str, list, Finish]]:
        """Each job's (text, logprob records, Finish); a client that leaves cancels them."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for job in jobs:
                self.engine.cancel(job)

        watcher = asyncio.create_task(watch())
        parts: list[list[str]] = [[] for _ in jobs]
        records: list[list] = [[] for _ in jobs]
        fins: list[Finish] = [None] * len(jobs)
        try:
            async with contextlib.aclosing(_merged(jobs)) as batches:
                async for batch in batches:
                    for i, ev in batch:
                        if isinstance(ev, Piece):
                            parts[i].append(ev.text)
                            records[i] += ev.logprobs
                        else:
                            fins[i] = ev
        finally:
            watcher.cancel()
            for job in jobs:
                self.engine.cancel(job)
        failed = next((f for f in fins if f.reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", "server_error")
        return [("".join(p), r, f) for p, r, f in zip(parts, records, fins)]

    def shape(self, req, stop_ids, template=None):
        """(make, eos_id) for a request whose output must match a schema, a grammar or a tool call; else None."""
        try:
            make = constraint_factory(req, self.model.tokenizer, stop_ids, template)
        except ShapeError as e:
            raise ApiError(400, str(e), param=e.param) from None
        if make is None:
            return None
        if not stop_ids:
            raise ApiError(400, "Structured output needs an end-of-text token, and this model has none.",
                           param=_shape_param(req))
        return make, min(stop_ids)

    def card(self) -> ModelCard:
        return ModelCard(id=self.model_id, created=self.created, max_model_len=self.context,
                         context_length=self.context, quantization=str(self.model.session.header["quant"]),
                         kv_cache=self.model.kv)

    # --- handlers -----------------------------------------------------------------------------------------
    async def health(self):
        st = self.engine.stats()
        body = {"status": "ok" if st.alive else "error", "model": self.model_id, "waiting": st.waiting,
                "active": st.active, "slots": st.slots}
        if self.instance:
            body["instance"] = self.instance
        return JSONResponse(body, 200 if st.alive else 503)

    async def prometheus(self):
        if self.metrics is None:
            raise ApiError(404, "metrics are off", "not_found_error")
        from .metrics import CONTENT_TYPE

        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: Request):
        check_api_key(request, self.key)
        return JSONResponse(ModelList(data=[self.card()]).model_dump())

    async def one_model(self, name: str, request: Request):
        check_api_key(request, self.key)
        if name != self.model_id:
            raise ApiError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(self.card().model_dump())

    async def completions(self, request: Request):
        check_api_key(request, self.key)
        req = await self.parse(request, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, str):
            ids = self.encode(prompt, "prompt")
        else:
            ids = check_ids(list(prompt), "prompt", self.vocab)
        params = sampling_params(req, len(ids), self.context, DEFAULT_COMPLETION_TOKENS, "prompt", self.vocab)
        shape = self.shape(req, frozenset(self.model.eos_ids))
        jobs = self.submit(ids, params, req.n or 1, shape)
        rid, now, model_id = new_id("cmpl"), int(time.time()), self.model_id
        strings = self.strings if params.logprobs is not None else None
        if req.stream:
            return EventStream(_completion_events(jobs, self.engine, rid, now, model_id, req.include_usage, strings))
        done = await self.collect(jobs, request)
        choices = [CompletionChoice(index=i, text=text, finish_reason=fin.reason,
                                    logprobs=completion_logprobs(recs, strings, 0)[0] if strings else None)
                   for i, (text, recs, fin) in enumerate(done)]
        return JSONResponse(_answer(CompletionResponse(id=rid, created=now, model=model_id, choices=choices,
                                                       usage=_usage([fin for _, _, fin in done]),
                                                       timings=_timings(done))))

    async def chat_completions(self, request: Request):
        check_api_key(request, self.key)
        req = await self.parse(request, ChatCompletionRequest)
        if self.model.tokenizer is None:
            raise ApiError(400, "This model has no tokenizer, so it cannot read chat messages: use /v1/completions "
                           "with token ids.", param="messages", code="no_tokenizer")
        tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        try:
            chat = chat_prompt(self.model, [m.template_dict() for m in req.messages], tools or None)
        except CflowError as e:  # the model's template refused these messages (e.g. roles out of order)
            raise ApiError(400, f"The chat template cannot render these messages: {e}", param="messages") from None
        if isinstance(chat.prompt, str):
            ids = self.encode(chat.prompt, "messages")
        else:
            ids = check_ids(chat.prompt, "messages", self.vocab)
        params = sampling_params(req, len(ids), self.context, None, "messages", self.vocab)
        if chat.stops or chat.stop_ids:
            params = dataclasses.replace(params, stops=tuple(dict.fromkeys(params.stops + chat.stops)),
                                         stop_ids=chat.stop_ids)
        template = self.model.chat_template
        # a finished grammar ends the turn with the template's end-of-turn token if it has one (min: the first)
        ends = chat.stop_ids or frozenset(self.model.eos_ids)
        shape = self.shape(req, ends | frozenset(self.model.eos_ids), template)
        if shape is not None:
            shape = (shape[0], min(ends))
        jobs = self.submit(ids, params, req.n or 1, shape)
        # parse the replies for calls of these tools: (format, function names), None to leave the text alone
        calls = (tool_format(template), [t["function"]["name"] for t in tools]) if req.tool_mode != "none" else None
        rid, now, model_id = new_id("chatcmpl"), int(time.time()), self.model_id
        strings = self.strings if params.logprobs is not None else None
        if req.stream:
            return EventStream(_chat_events(jobs, self.engine, rid, now, model_id, req.include_usage, strings,
                                            calls))
        done = await self.collect(jobs, request)
        choices = [_chat_choice(i, text, recs, fin, strings, calls) for i, (text, recs, fin) in enumerate(done)]
        return JSONResponse(_answer(ChatCompletionResponse(id=rid, created=now, model=model_id, choices=choices,
                                                           usage=_usage([fin for _, _, fin in done]),
                                                           timings=_timings(done))))


def _chat_choice(i: int, text: str, recs: list, fin: Finish, strings, calls: tuple | None) -> ChatChoice:
    """One choice of a chat answer; with tools, the calls parsed out of the text (finish_reason tool_calls)."""
    lp = chat_logprobs(recs, strings) if strings else None
    if calls is None:
        return ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=fin.reason, logprobs=lp)
    parser = ToolCallParser(*calls)
    content, found = parser.push(text)
    rest, more = parser.finish()
    content, found = content + rest, found + more
    reason = "tool_calls" if found and fin.reason == "stop" else fin.reason
    msg = AssistantMessage(content=content or (None if found else ""),
                           tool_calls=[c.openai() for c in found] or None)
    return ChatChoice(index=i, message=msg, finish_reason=reason, logprobs=lp)


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
    routes = Routes(engine, model, model_id, api_key, metrics, instance)
    if instance:
        app.add_middleware(_InstanceHeader, instance=instance)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _bug)
    routes.register(app)
    return app


def _usage(fins: list[Finish]) -> Usage:
    """The prompt counted once, the completions of every choice summed (as OpenAI counts n choices)."""
    completion = sum(f.completion_tokens for f in fins)
    return Usage(prompt_tokens=fins[0].prompt_tokens, completion_tokens=completion,
                 total_tokens=fins[0].prompt_tokens + completion)


def _timings(done: list) -> dict | None:
    """llama-server's timings of a one-choice answer (with n > 1 each streamed choice has its own)."""
    return done[0][2].timings if len(done) == 1 else None


def _error_event(fin: Finish) -> str:
    return sse(error_body(f"generation failed: {fin.error}", "server_error"))


async def _merged(jobs: list[Job]) -> AsyncIterator[list[tuple[int, Piece | Finish]]]:
    """The events of a request's jobs as they come, each with its job's index, in lists of those that arrived
    together (one write to the client for a list); ends after every Finish."""
    if len(jobs) == 1:
        async for batch in jobs[0].batches():
            yield [(0, ev) for ev in batch]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, job: Job):
        async for ev in job.events():
            queue.put_nowait((i, ev))

    tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(jobs)]
    try:
        left = len(jobs)
        while left:
            batch = await drain(queue)
            left -= sum(isinstance(ev, Finish) for _, ev in batch)
            yield batch
    finally:
        for t in tasks:
            t.cancel()


async def _writes(jobs: list[Job], events) -> AsyncIterator[str]:
    """What a stream writes for its jobs' events: the chunks `events(i, ev)` makes of each event of choice i, one
    write for the events that arrived together; an error event ends it (the events after it are not shown)."""
    async with contextlib.aclosing(_merged(jobs)) as batches:
        async for batch in batches:
            out = []
            for i, ev in batch:
                if isinstance(ev, Finish) and ev.reason == "error":
                    yield "".join(out) + _error_event(ev)
                    return
                out += events(i, ev)
            if out:
                yield "".join(out)


class TextEvents:
    """The server-sent event of a chunk that carries only text for choice i, as `sse` writes it, from a template
    made once per choice: `sse` of the chunk with a marker for the text, split where the marker's JSON string
    is. Building and dumping the pydantic chunk takes 15-20 us, the template a few: most chunks are text only."""

    MARK = "\x00cflow-text\x00"

    def __init__(self, make):
        self.make, self.parts = make, {}  # make(i, text): the chunk's event as sse() writes it

    def __call__(self, i: int, text: str) -> str:
        parts = self.parts.get(i)
        if parts is None:
            head, mark, tail = self.make(i, self.MARK).partition(json.dumps(self.MARK, ensure_ascii=False))
            if not mark:
                raise RuntimeError("TextEvents: the chunk does not hold its text as json.dumps writes it")
            parts = self.parts[i] = (head, tail)
        return parts[0] + json.dumps(text, ensure_ascii=False) + parts[1]


async def _completion_events(jobs: list[Job], engine: Engine, rid: str, created: int, model_id: str,
                             include_usage: bool, strings: TokenStrings | None) -> AsyncIterator[str]:
    def chunk(choices: list, usage: Usage | None = None, timings: dict | None = None):
        return sse(CompletionResponse(id=rid, created=created, model=model_id, usage=usage, choices=choices,
                                      timings=timings))

    text_event = TextEvents(lambda i, text: chunk([CompletionChoice(index=i, text=text)]))
    offsets, fins = [0] * len(jobs), {}

    def events(i: int, ev) -> list[str]:
        """The chunks of one event of choice i (an error is _writes')."""
        if isinstance(ev, Piece):
            if ev.logprobs and strings is not None:
                lp, offsets[i] = completion_logprobs(ev.logprobs, strings, offsets[i])
                return [chunk([CompletionChoice(index=i, text=ev.text, logprobs=lp)])]
            return [text_event(i, ev.text)] if ev.text else []
        fins[i] = ev
        if ev.reason == "cancelled":
            return []
        return [chunk([CompletionChoice(index=i, text="", finish_reason=ev.reason)], timings=ev.timings)]

    try:
        async with contextlib.aclosing(_writes(jobs, events)) as writes:
            async for text in writes:
                yield text
        if include_usage and len(fins) == len(jobs):
            yield chunk([], usage=_usage(list(fins.values())))
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
            engine.cancel(job)


async def _chat_events(jobs: list[Job], engine: Engine, rid: str, created: int, model_id: str,
                       include_usage: bool, strings: TokenStrings | None, calls: tuple | None = None
                       ) -> AsyncIterator[str]:
    """The chunks of a chat answer; with `calls` (a tool-call format), content and tool calls parsed apart as they
    stream: each call one delta with its index, id, name and arguments when its block closes. calls: (format,
    function names) as ToolCallParser takes them."""
    def chunk(choices: list, usage: Usage | None = None, timings: dict | None = None):
        return sse(ChatCompletionChunk(id=rid, created=created, model=model_id, choices=choices, usage=usage,
                                       timings=timings))

    parsers = [ToolCallParser(*calls) for _ in jobs] if calls is not None else None
    started, fins, made = set(), {}, [0] * len(jobs)

    def delta(i: int, text: str, found: list) -> Delta:
        deltas = [c.openai(made[i] + k) for k, c in enumerate(found)]
        made[i] += len(found)
        return Delta(content=text if text or not deltas else None, tool_calls=deltas or None)

    text_event = TextEvents(lambda i, text: chunk([ChatChunkChoice(index=i, delta=Delta(content=text))]))

    def events(i: int, ev) -> list[str]:
        """The chunks of one event of choice i."""
        out = []
        if i not in started:  # each choice opens with the assistant's role
            started.add(i)
            out.append(chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))]))
        if isinstance(ev, Piece):
            text, found = parsers[i].push(ev.text) if parsers else (ev.text, [])
            if found or (ev.logprobs and strings is not None):
                lp = chat_logprobs(ev.logprobs, strings) if strings is not None else None
                out.append(chunk([ChatChunkChoice(index=i, delta=delta(i, text, found), logprobs=lp)]))
            elif text:
                out.append(text_event(i, text))
            return out
        fins[i] = ev
        if ev.reason == "cancelled":
            return out
        reason = ev.reason
        if parsers:
            text, found = parsers[i].finish()
            if text or found:
                out.append(chunk([ChatChunkChoice(index=i, delta=delta(i, text, found))]))
            if parsers[i].calls and reason == "stop":
                reason = "tool_calls"
        out.append(chunk([ChatChunkChoice(index=i, delta=Delta(), finish_reason=reason)], timings=ev.timings))
        return out

    try:
        async with contextlib.aclosing(_writes(jobs, events)) as writes:
            async for text in writes:
                yield text
        if include_usage and len(fins) == len(jobs):
            yield chunk([], usage=_usage(list(fins.values())))
        yield "data: [DONE]\n\n"
    finally:
        for job in jobs:
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
