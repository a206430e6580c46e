"""cflow serve over real HTTP, driven by the official `openai` client: parity with m.generate, streaming,
chat, cancellation, a full queue, bad requests, the API key, models, health and metrics."""

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from cflow.serve.template import DEFAULT_CHAT_STOPS, default_chat_prompt  # noqa: E402

from ._server import client, make_app, serving  # noqa: E402

STORY = "Once upon a time"


def post(url, path, body: bytes | dict, headers=None):
    """(status, headers, parsed JSON) of a raw POST: for what the openai client will not send."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json",
                                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def get(url, path):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.status, r.read().decode()


def metric(app, name, labels=None):
    return app.state.engine.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- parity with m.generate ---------------------------------------------------------------------------------
def test_completion_equals_generate(text_server, ref_text):
    url, _ = text_server
    c = client(url)
    r = c.completions.create(model="story", prompt=STORY, max_tokens=40, temperature=0.8, top_p=0.9, seed=123)
    want = ref_text.generate(STORY, 40, temperature=0.8, top_p=0.9, seed=123)
    assert r.choices[0].text == want and r.object == "text_completion" and r.model == "story"
    n_prompt = len(ref_text.tokenizer.encode(STORY))
    assert r.usage.prompt_tokens == n_prompt and r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 40 else "stop")
    check_timings(r.model_extra["timings"], n_prompt, r.usage.completion_tokens)  # llama-server's addition


def test_streamed_completion_equals_generate(text_server, ref_text):
    url, _ = text_server
    stream = client(url).completions.create(model="story", prompt=STORY, max_tokens=48, temperature=1.0, seed=7,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == ref_text.generate(STORY, 48, temperature=1.0, seed=7)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")


def test_top_k_extension(text_server, ref_text):
    url, _ = text_server
    r = client(url).completions.create(model="story", prompt=STORY, max_tokens=20, temperature=1.2, seed=3,
                                       extra_body={"top_k": 5})
    assert r.choices[0].text == ref_text.generate(STORY, 20, temperature=1.2, top_k=5, seed=3)


def _chat_reference(ref, messages, n, **kw):
    text = ref.generate(default_chat_prompt([(m["role"], m["content"]) for m in messages]), n, **kw)
    cut = min([i for s in DEFAULT_CHAT_STOPS if (i := text.find(s)) >= 0], default=len(text))
    return text[:cut]


def test_chat_streaming_and_not(text_server, ref_text):
    url, _ = text_server
    c = client(url)
    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about a cat."}]
    want = _chat_reference(ref_text, messages, 32, temperature=0.7, seed=11)
    r = c.chat.completions.create(model="story", messages=messages, max_tokens=32, temperature=0.7, seed=11)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.usage.prompt_tokens > 10
    chunks = list(c.chat.completions.create(model="story", messages=messages, max_tokens=32, temperature=0.7,
                                            seed=11, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # content parts ([{"type": "text", ...}]) are the same message
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story."}]}]
    r = c.chat.completions.create(model="story", messages=parts, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == _chat_reference(ref_text, [{"role": "user", "content": "Tell me a story."}],
                                                           16, temperature=0)


def test_chat_with_the_models_own_template(chat_path):
    """A model whose file carries a chat template: the server's answer is m.chat's (same seed), ending at the
    template's end-of-turn token; a template that raises for the messages is a 400 naming `messages`."""
    import cflow
    from cflow.serve.template import chat_prompt

    messages = [{"role": "user", "content": "Tell me a story about a dog."}]
    with cflow.load(chat_path, threads=1) as ref:
        assert ref.chat_template is not None
        assert chat_prompt(ref, [("user", "hi")]).stop_ids == {0}  # <|endoftext|> ends a turn
        want = ref.chat(messages, max_new_tokens=40, temperature=0.9, seed=5)
        n_prompt = len(ref.tokenizer.encode(ref.chat_prompt(messages)))
    app = make_app(chat_path, model_id="chat")
    with serving(app) as url:
        c = client(url)
        r = c.chat.completions.create(model="chat", messages=messages, max_tokens=40, temperature=0.9, seed=5)
        assert r.choices[0].message.content == want and r.usage.prompt_tokens == n_prompt
        chunks = list(c.chat.completions.create(model="chat", messages=messages, max_tokens=40, temperature=0.9,
                                                seed=5, stream=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="chat", messages=[{"role": "assistant", "content": "Hi"}])
        assert e.value.param == "messages" and "start with a user turn" in e.value.message


def test_stop_strings(text_server, ref_text):
    url, _ = text_server
    full = ref_text.generate(STORY, 40, temperature=0)
    words = full.split()
    stop = " " + words[len(words) // 2]  # a word from the middle of the greedy text
    want = full[: full.index(stop)]
    c = client(url)
    r = c.completions.create(model="story", prompt=STORY, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model="story", prompt=STORY, max_tokens=40, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want


def test_token_id_model_two_slots(tiny_server, ref_tiny):
    """No tokenizer: prompts are ids, answers ' ID ID ...'. Two concurrent streams on two slots, each equal to
    its own m.generate."""
    url, app = tiny_server
    assert type(app.state.engine.backend).__name__ == "BatchedSlots" and app.state.engine.backend.slots == 2
    c = client(url)
    r = c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12, temperature=0.9, seed=1)
    assert r.choices[0].text == "".join(f" {t}" for t in ref_tiny.generate([5, 6, 7], 12, temperature=0.9, seed=1))
    r = c.completions.create(model="tiny", prompt="5 6 7", max_tokens=12, temperature=0)
    assert r.choices[0].text == "".join(f" {t}" for t in ref_tiny.generate([5, 6, 7], 12, temperature=0))
    out = {}
    together = threading.Barrier(3)

    def one(seed):
        together.wait(10)
        s = c.completions.create(model="tiny", prompt=[1, 2, 3, 4], max_tokens=120, temperature=1.0, seed=seed,
                                 stream=True)
        out[seed] = "".join(ch.choices[0].text for ch in s)

    ts = [threading.Thread(target=one, args=(seed,)) for seed in (21, 22, 23)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    for seed in (21, 22, 23):
        assert out[seed] == "".join(f" {t}" for t in ref_tiny.generate([1, 2, 3, 4], 120, temperature=1.0, seed=seed))
    steps = metric(app, "cflow_decode_batch_size_count")
    assert steps - metric(app, "cflow_decode_batch_size_bucket", {"le": "1.0"}) > 0  # some steps advanced two
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.param == "messages" and "no tokenizer" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[1, 99999])
    assert e.value.param == "prompt" and "99999" in e.value.message


def test_two_slots_with_experts_on_disk(tiny_path, ref_tiny):
    """No batched decode with the disk expert tier: two slots are two loaded models taking turns (StreamSlots),
    each answer still m.generate's."""
    app = make_app(tiny_path, slots=2, model_id="tiny", experts="disk")
    assert type(app.state.engine.backend).__name__ == "StreamSlots" and app.state.engine.backend.slots == 2
    with serving(app) as url:
        c = client(url)
        out = {}

        def one(seed):
            s = c.completions.create(model="tiny", prompt=[4, 3, 2], max_tokens=40, temperature=1.0, seed=seed,
                                     stream=True)
            out[seed] = "".join(ch.choices[0].text for ch in s)

        ts = [threading.Thread(target=one, args=(seed,)) for seed in (1, 2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for seed in (1, 2):
            assert out[seed] == "".join(f" {t}" for t in ref_tiny.generate([4, 3, 2], 40, temperature=1.0, seed=seed))


# --- the raw server-sent events (what any SSE client sees, not the openai client's parse) --------------------
def open_stream(url, path, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A POST whose answer is read as it comes (http.client undoes the chunked transfer encoding only)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def raw_events(url, path, body: dict) -> list[str]:
    """The `data:` payloads of a whole event stream, checking the framing: every event is one `data: ...` line
    followed by a blank line, and the stream ends with `data: [DONE]` and nothing after it."""
    conn, r = open_stream(url, path, body)
    try:
        assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
        raw = r.read().decode()
    finally:
        conn.close()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e.removeprefix("data: ") for e in events[:-1]]


def check_timings(t: dict, prompt_tokens: int, completion_tokens: int) -> None:
    """llama-server's timings of one choice: the counts are the request's, the times positive and consistent."""
    assert set(t) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert t["cache_n"] + t["prompt_n"] == prompt_tokens and t["predicted_n"] == completion_tokens
    assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], rel=1e-2)
    if completion_tokens > 2:
        assert t["predicted_ms"] > 0 and t["predicted_per_second"] == pytest.approx(
            1e3 / t["predicted_per_token_ms"], rel=1e-2)


def test_raw_sse_completion_chunks_end_with_done(text_server, ref_text):
    url, _ = text_server
    body = {"model": "story", "prompt": STORY, "max_tokens": 24, "temperature": 0.8, "seed": 9, "stream": True,
            "stream_options": {"include_usage": True}}
    *chunks, done = raw_events(url, "/v1/completions", body)
    assert done == "[DONE]"
    chunks = [json.loads(c) for c in chunks]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == "story" and isinstance(c["created"], int)
    *text_chunks, last, usage = chunks
    for c in text_chunks:  # one choice per chunk, text only, no finish_reason yet, usage null until the end
        assert [set(ch) for ch in c["choices"]] == [{"index", "text", "logprobs", "finish_reason"}]
        assert c["choices"][0]["index"] == 0 and c["choices"][0]["text"] and c["choices"][0]["finish_reason"] is None
        assert c["usage"] is None
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert all("timings" not in c for c in text_chunks + [usage])
    check_timings(last["timings"], len(ref_text.tokenizer.encode(STORY)), usage["usage"]["completion_tokens"])
    text = "".join(c["choices"][0]["text"] for c in text_chunks)
    assert text == ref_text.generate(STORY, 24, temperature=0.8, seed=9)
    n_prompt = len(ref_text.tokenizer.encode(STORY))
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == n_prompt
    assert usage["usage"]["total_tokens"] == n_prompt + usage["usage"]["completion_tokens"] > n_prompt
    # without include_usage the finishing chunk comes right before [DONE]
    *chunks, done = raw_events(url, "/v1/completions", {**body, "stream_options": None})
    assert done == "[DONE]" and json.loads(chunks[-1])["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(json.loads(c)["choices"] for c in chunks)


def test_raw_sse_chat_chunks_end_with_done(text_server, ref_text):
    url, _ = text_server
    messages = [{"role": "user", "content": "Tell me about a dog."}]
    body = {"model": "story", "messages": messages, "max_tokens": 24, "temperature": 0.7, "seed": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    *chunks, done = raw_events(url, "/v1/chat/completions", body)
    assert done == "[DONE]"
    chunks = [json.loads(c) for c in chunks]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "story" for c in chunks)
    first, *middle, last, usage = chunks
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    for c in middle:  # a delta carries only the keys it sets
        assert list(c["choices"][0]["delta"]) == ["content"] and c["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert all("timings" not in c for c in [first, *middle, usage])
    check_timings(last["timings"], usage["usage"]["prompt_tokens"], usage["usage"]["completion_tokens"])
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == _chat_reference(
        ref_text, messages, 24, temperature=0.7, seed=4)


def test_raw_sse_error_event_then_done(tiny_path):
    """A sequence that fails during generation: an error event in OpenAI's error shape, then [DONE]."""
    from cflow.serve.app import create_app
    from cflow.serve.backends import load_backend
    from cflow.serve.engine import Engine

    class Failing:  # the second step raises (as a model fault would); the first token got through
        def __init__(self, inner):
            self.inner, self.slots, self.steps = inner, inner.slots, 0
            self.model, self.start, self.prefill, self.stop, self.close = (
                inner.model, inner.start, inner.prefill, inner.stop, inner.close)

        def advance(self, slots):
            self.steps += 1
            return [RuntimeError("the model broke")] * len(slots) if self.steps == 2 else self.inner.advance(slots)

    be = Failing(load_backend(tiny_path, threads=1, slots=1))
    app = create_app(Engine(be, max_queue=4), be.model, "tiny", owns_engine=True)
    with serving(app) as url:
        *chunks, err, done = raw_events(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2], "max_tokens": 9,
                                                                 "temperature": 0, "stream": True})
        assert done == "[DONE]" and len(chunks) == 1 and json.loads(chunks[0])["choices"][0]["text"]
        e = json.loads(err)["error"]
        assert set(e) == {"message", "type", "param", "code"} and e["type"] == "server_error"
        assert "the model broke" in e["message"]


# --- cancellation and a full queue --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(tiny_path):
    """One slot, one place in the queue, 20 ms per token."""
    app = make_app(tiny_path, slots=1, max_queue=1, delay=0.02, model_id="tiny")
    with serving(app) as url:
        yield url, app


def test_cancel_mid_stream_frees_the_slot(slow_server):
    url, app = slow_server
    engine = app.state.engine
    before = metric(app, "cflow_generation_tokens_total")
    stream = client(url).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=100, temperature=0,
                                            stream=True)
    got = 0
    for ch in stream:
        got += bool(ch.choices and ch.choices[0].text)
        if got == 3:
            break
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: metric(app, "cflow_requests_total", {"outcome": "cancelled"}) >= 1)
    wait_for(lambda: engine.stats().active == 0)
    assert metric(app, "cflow_generation_tokens_total") - before < 30  # not the 100 asked for
    # a non-streaming client that hangs up is cancelled too
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100, "temperature": 0}).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: engine.stats().active == 1)
    wait_for(lambda: metric(app, "cflow_requests_total", {"outcome": "cancelled"}) >= 2)
    wait_for(lambda: engine.stats().active == 0)
    r = client(url).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3  # the model stays usable


def _read_text_events(r, n):
    """Read a streaming completion until n events with text came; returns their text."""
    got = []
    while len(got) < n:
        line = r.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: {"):
            t = json.loads(line[6:])["choices"][0]["text"]
            if t:
                got.append(t)
    return "".join(got)


LONG_PROMPT = [(7 * i) % 250 + 1 for i in range(90)]


def test_cancel_with_batched_slots_while_prefilling_and_decoding(tiny_path, ref_tiny):
    """--max-batch 2: a client that leaves while its long prompt is still being read (chunked prefill, 8 tokens a
    piece) frees its slot before the prompt is done, and the next request takes that slot while the other stream
    goes on; a client that leaves mid-stream frees its slot at the next token. The texts stay m.generate's."""
    app = make_app(tiny_path, slots=2, max_queue=4, delay=0.01, prefill_delay=0.05, prefill_block=8, model_id="tiny")
    engine = app.state.engine
    log = engine.backend.log
    assert type(engine.backend.inner).__name__ == "BatchedSlots"
    want_a = "".join(f" {t}" for t in ref_tiny.generate([1, 2, 3], 100, temperature=0))

    def cancelled():
        return metric(app, "cflow_requests_total", {"outcome": "cancelled"})

    with serving(app) as url:
        conn_a, ra = open_stream(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 100,
                                                          "temperature": 0, "stream": True})
        text_a = _read_text_events(ra, 2)  # a decodes in slot 0
        conn_b, rb = open_stream(url, "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 10,
                                                          "temperature": 0, "stream": True})
        assert rb.status == 200  # the headers come at once; the first token only after the 90-token prompt
        wait_for(lambda: ("prefill", 1, 82) in log)  # b's first piece is read in slot 1: 82 tokens to go
        conn_b.close()
        rb.close()
        wait_for(lambda: cancelled() >= 1)
        stop_b = log.index(("stop", 1))
        b_pieces = [e for e in log[:stop_b] if e[:2] == ("prefill", 1)]
        assert 1 <= len(b_pieces) < 11 and b_pieces[-1][2] > 0  # left before its prompt was read
        assert not any(e[0] == "advance" and 1 in e[1] for e in log[:stop_b])
        # the freed slot is refilled while a keeps streaming
        r = client(url).completions.create(model="tiny", prompt=[4, 5, 6], max_tokens=5, temperature=0)
        assert r.choices[0].text == "".join(f" {t}" for t in ref_tiny.generate([4, 5, 6], 5, temperature=0))
        assert ("start", 1, (4, 5, 6)) in log[stop_b:]
        assert engine.stats().active == 1  # a is still running
        text_a += _read_text_events(ra, 3)
        assert want_a.startswith(text_a)
        steps_before = sum(e[0] == "advance" for e in log)
        conn_a.close()  # a leaves mid-stream
        ra.close()
        wait_for(lambda: cancelled() >= 2)
        wait_for(lambda: engine.stats().active == 0)
        stop_a = len(log) - 1 - log[::-1].index(("stop", 0))
        assert sum(e[0] == "advance" for e in log[:stop_a]) - steps_before < 20  # not the ~90 tokens a had left
        r = client(url).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=7, temperature=0)
        assert r.choices[0].text == want_a[: len(r.choices[0].text)] and r.usage.completion_tokens == 7
        assert log[-1] == ("stop", 0)  # ... served from slot 0 again


def test_full_queue_answers_429_with_retry_after(slow_server):
    url, app = slow_server
    c = client(url)
    running = c.completions.create(model="tiny", prompt=[1, 2], max_tokens=100, temperature=0, stream=True)
    waiting = c.completions.create(model="tiny", prompt=[3, 4], max_tokens=5, temperature=0, stream=True)
    wait_for(lambda: app.state.engine.stats().active == 1 and app.state.engine.stats().waiting == 1)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny", prompt=[5, 6], max_tokens=5)
    assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.code == "queue_full"
    assert metric(app, "cflow_rejected_requests_total", {"reason": "queue_full"}) >= 1
    running.close()  # the slot frees, the waiting request runs to its end
    assert len("".join(ch.choices[0].text for ch in waiting).split()) == 5
    wait_for(lambda: app.state.engine.stats().active == 0)


def test_n_choices_are_queued_together_or_not_at_all(slow_server):
    """n jobs count against the queue at once: with one request running, n=2 does not fit one slot + one queue
    place (429, nothing queued); n above slots + --max-queue can never fit (400)."""
    url, app = slow_server
    c = client(url)
    running = c.completions.create(model="tiny", prompt=[1, 2], max_tokens=100, temperature=0, stream=True)
    wait_for(lambda: app.state.engine.stats().active == 1)
    with pytest.raises(openai.RateLimitError):
        c.completions.create(model="tiny", prompt=[5, 6], max_tokens=5, n=2)
    assert app.state.engine.stats().waiting == 0  # neither choice was queued
    running.close()
    wait_for(lambda: app.state.engine.stats().active == 0)
    r = c.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, temperature=0, n=2)  # one runs, one waits
    assert [ch.text for ch in r.choices] == [r.choices[0].text] * 2 and r.usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[5, 6], max_tokens=3, n=3)
    assert e.value.param == "n"


# --- bad requests -------------------------------------------------------------------------------------------
def test_malformed_json_and_wrong_types(tiny_server):
    url, _ = tiny_server
    st, _, body = post(url, "/v1/completions", b'{"model": "tiny", "prompt": [1, 2')
    assert st == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # a body too big: refused before it is read
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n{")
        assert s.recv(4096).startswith(b"HTTP/1.1 413 ")
    st, _, body = post(url, "/v1/chat/completions", b"[1, 2]")
    assert st == 400 and "JSON object" in body["error"]["message"]
    cases = [
        ("/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "temperature": 3}, "temperature"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "top_p": 0}, "top_p"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "seed": -1}, "seed"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "n": 0}, "n"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "stream": "yes"}, "stream"),
        ("/v1/completions", {"model": "tiny", "prompt": {"a": 1}}, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "tiny"}, "prompt"),
        ("/v1/completions", {"model": 5, "prompt": [1]}, "model"),  # left out is fine: the one model
        ("/v1/completions", {"model": "tiny", "prompt": [1], "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"model": "tiny", "prompt": [1], "echo": True}, "echo"),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]},
         "messages[0].content"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
         "messages[0].role"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                  "tool_choice": "sometimes"}, "tool_choice"),
    ]
    for path, req, param in cases:
        st, _, body = post(url, path, req)
        assert st == 400 and body["error"]["param"] == param, (req, body)
        assert param.split("[")[0] in body["error"]["message"]
    # through the official client too: a string where a number belongs
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=[1], max_tokens="many")
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client(url).completions.create(model="gpt-4", prompt=[1])
    assert e.value.code == "model_not_found"


def test_prompt_longer_than_the_context(tiny_server, ref_tiny):
    url, _ = tiny_server
    ctx = ref_tiny.session.max_seq
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=[1] * (ctx + 10), max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    assert str(ctx + 10) in e.value.message and str(ctx) in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model="tiny", prompt=[1] * 10, max_tokens=ctx)
    assert e.value.param == "max_tokens" and str(ctx) in e.value.message and str(ctx + 10) in e.value.message
    # the default max_tokens shrinks to what fits
    r = client(url).completions.create(model="tiny", prompt=[1] * (ctx - 3), temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


# --- api key, models, health, metrics ----------------------------------------------------------------------
def test_api_key(tiny_path):
    app = make_app(tiny_path, api_key="sekret", model_id="tiny")
    with serving(app) as url:
        with pytest.raises(openai.AuthenticationError) as e:
            client(url, api_key="wrong").completions.create(model="tiny", prompt=[1], max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        st, _, body = post(url, "/v1/completions", {"model": "tiny", "prompt": [1]})  # no header at all
        assert st == 401 and "error" in body
        r = client(url, api_key="sekret").completions.create(model="tiny", prompt=[1], max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert get(url, "/health")[0] == 200  # health checks need no key


def test_models_health_metrics(text_server):
    url, app = text_server
    c = client(url)
    models = c.models.list()
    assert [m.id for m in models.data] == ["story"]
    card = c.models.retrieve("story")
    assert card.id == "story" and card.context_length == card.max_model_len > 0
    assert card.quantization == "q4" and card.kv_cache == "f16"
    # a request without "model" is for the one model this server serves (as llama-server takes it)
    st, _, body = post(url, "/v1/completions", {"prompt": STORY, "max_tokens": 3, "temperature": 0})
    assert st == 200 and body["model"] == "story" and body["choices"][0]["text"]
    st, body = get(url, "/health")
    h = json.loads(body)
    assert st == 200 and h["status"] == "ok" and h["slots"] == 1 and h["model"] == "story"
    c.completions.create(model="story", prompt=STORY, max_tokens=5, temperature=0)
    st, text = get(url, "/metrics")
    for name in ("cflow_queue_length", "cflow_active_sequences", "cflow_generation_tokens_total",
                 "cflow_prompt_tokens_per_second", "cflow_decode_tokens_per_second",
                 "cflow_time_to_first_token_seconds_bucket", "cflow_inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert metric(app, "cflow_generation_tokens_total") >= 5
    assert metric(app, "cflow_decode_tokens_per_second") > 0
    st, _, body = post(url, "/v1/nope", {})
    assert st == 404 and body["error"]["type"] == "not_found_error"
