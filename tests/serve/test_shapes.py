"""Structured output and tools through the official `openai` client against a running `cflow serve` (the bundled
TinyStories model, whose stories are no JSON: every valid answer is the grammar's doing), streamed and not:
response_format json_object / json_schema, the peers' grammar fields, tool_choice auto / none / required / a
named function, tool calls parsed out of text, and the 400s."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from ._server import client, make_app, serving  # noqa: E402

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "bird"]}, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
             "additionalProperties": False}},
    "required": ["name", "age", "home"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}
USER = [{"role": "user", "content": "Tell me about Tom."}]


@pytest.fixture(scope="module")
def long_text_path(tmp_path_factory):
    """The bundled model with a context of 1024 (its own is 256: too short for a tools prompt; the text past 256
    is worse, the grammar does not care)."""
    import attrs

    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir

    g = load_graph(default_model_dir())
    g.meta.config = attrs.evolve(g.config, max_seq_len=1024)
    path = tmp_path_factory.mktemp("shapes") / "story1k.vflow"
    compile_file(g, path, tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    return str(path)


@pytest.fixture(scope="module")
def server(long_text_path):
    with serving(make_app(long_text_path, model_id="story", slots=2)) as url:
        yield client(url)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_answers_validate(server, stream):
    for seed in range(3):
        kw = dict(model="story", messages=USER, max_tokens=150, temperature=1.0, seed=seed,
                  response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                         "strict": True}})
        if stream:
            text = "".join(ch.choices[0].delta.content or "" for ch in server.chat.completions.create(
                stream=True, **kw) if ch.choices)
        else:
            r = server.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_the_peers_fields(server, long_text_path):
    import cflow

    with cflow.load(long_text_path, threads=1) as m:  # a bias toward closing: this model's objects run long
        close = m.tokenizer.encode("}", add_special=False)
    for seed in range(3):
        r = server.chat.completions.create(model="story", messages=USER, max_tokens=100, seed=seed,
                                           response_format={"type": "json_object"},
                                           logit_bias={str(close[0]): 6.0})
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = server.completions.create(model="story", prompt="Once upon a time", max_tokens=150, seed=2,
                                  extra_body={"guided_json": PERSON})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    gbnf = 'root ::= "The " animal " is " ("big" | "small") "."\nanimal ::= "cat" | "dog"'
    for field in ("grammar", "guided_grammar"):
        r = server.completions.create(model="story", prompt="Once upon a time", max_tokens=20, seed=3,
                                      extra_body={field: gbnf})
        assert r.choices[0].text in {f"The {a} is {s}." for a in ("cat", "dog") for s in ("big", "small")}


def test_n_choices_each_follow_the_schema(server):
    r = server.chat.completions.create(model="story", messages=USER, max_tokens=150, seed=5, n=2,
                                       response_format={"type": "json_schema", "json_schema": {"schema": PERSON}})
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), PERSON)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "clock"}}])
def test_forced_tool_calls_always_parse(server, stream, choice):
    kw = dict(model="story", messages=USER, tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=60, seed=4)
    if stream:
        calls, reason = {}, None
        for ch in server.chat.completions.create(stream=True, **kw):
            if not ch.choices:
                continue
            for d in ch.choices[0].delta.tool_calls or ():
                calls.setdefault(d.index, d)
            reason = ch.choices[0].finish_reason or reason
        calls = [calls[k].function for k in sorted(calls)]
    else:
        r = server.chat.completions.create(**kw)
        reason = r.choices[0].finish_reason
        calls = [c.function for c in r.choices[0].message.tool_calls]
    assert reason == "tool_calls" and len(calls) == 1
    tools = {"weather": WEATHER, "clock": CLOCK}
    if isinstance(choice, dict):
        assert calls[0].name == "clock"
    jsonschema.validate(json.loads(calls[0].arguments), tools[calls[0].name]["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_calls_the_model_writes_are_parsed_out_of_its_text(server, stream):
    # tool_choice auto: the model's own text is parsed; a grammar makes this story model write a call
    said = 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    gbnf = "root ::= " + json.dumps(said)
    kw = dict(model="story", messages=USER, tools=[WEATHER], max_tokens=60, seed=0, extra_body={"grammar": gbnf})
    if stream:
        content, calls, reason = "", [], None
        for ch in server.chat.completions.create(stream=True, **kw):
            if ch.choices:
                content += ch.choices[0].delta.content or ""
                calls += ch.choices[0].delta.tool_calls or []
                reason = ch.choices[0].finish_reason or reason
        assert [c.index for c in calls] == [0] and calls[0].id.startswith("call_")
        fn = calls[0].function
    else:
        r = server.chat.completions.create(**kw)
        content, reason = r.choices[0].message.content, r.choices[0].finish_reason
        fn = r.choices[0].message.tool_calls[0].function
    assert (content, reason, fn.name, json.loads(fn.arguments)) == ("Sure.\n", "tool_calls", "weather",
                                                                   {"city": "Oslo"})
    r = server.chat.completions.create(**{**kw, "tool_choice": "none"})  # none: the same text stays text
    assert r.choices[0].message.content == said and r.choices[0].message.tool_calls is None


def test_tool_calls_in_text_and_tool_messages_back(server):
    # auto: this model writes stories, not calls: the answer is content; the conversation with a call and its
    # result renders (the default template gets the tools in a system message)
    msgs = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = server.chat.completions.create(model="story", messages=msgs, tools=[WEATHER], max_tokens=8, seed=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = server.chat.completions.create(model="story", messages=USER, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, seed=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": 'root ::= "a"', "guided_json": {"type": "object"}}, None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, None),
])
def test_bad_shapes_are_400s(server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.chat.completions.create(model="story", messages=USER, max_tokens=4, extra_body=body)
    err = e.value.body
    if param is not None:
        assert err["param"].startswith(param), err
