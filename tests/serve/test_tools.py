"""Tool calls (serve/tools.py): the formats parsed from streamed text, the messages given to templates, and the
grammar's schema of one call."""

import json

import pytest

from cflow.runtime.chat import ChatTemplate
from cflow.serve import tools as T

WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def _stream(parser, text, step):
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = parser.push(text[i: i + step])
        content, calls = content + c, calls + k
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_calls_between_text(step):
    text = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "weather", "arguments": {"city": "Ro<me"}}\n</tool_call>')
    content, calls = _stream(T.ToolCallParser(T.HERMES), text, step)
    assert content == "Let me look.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"}),
                                                                 ("weather", {"city": "Ro<me"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("step", [1, 5])
def test_hermes_text_that_only_looks_like_a_call_stays_text(step):
    for text in ("a <tool_call> b </tool_call> c", "x < y <tool_ca", "<tool_call>\n{\"name\": 3}\n</tool_call>"):
        content, calls = _stream(T.ToolCallParser(T.HERMES), text, step)
        assert (content, calls) == (text, [])


def test_hermes_unclosed_call_at_the_end_is_a_call_if_it_parses():
    content, calls = _stream(T.ToolCallParser(), '<tool_call>\n{"name": "f", "arguments": {}}', 4)
    assert content == "" and [c.name for c in calls] == ["f"]


@pytest.mark.parametrize("fmt, text, names", [
    (T.LLAMA3, '{"name": "weather", "parameters": {"city": "Oslo"}}', ["weather"]),
    (T.LLAMA3, '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}', ["a", "b"]),
    (T.MISTRAL, '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": [1]}}]', ["a", "b"]),
    (T.LLAMA3, "The weather is fine.", None),
    (T.MISTRAL, "[not json", None),
])
def test_whole_reply_formats(fmt, text, names):
    content, calls = _stream(T.ToolCallParser(fmt), text, 2)
    if names is None:
        assert (content, calls) == (text, [])
    else:
        assert content == "" and [c.name for c in calls] == names


def test_format_is_read_from_the_template():
    assert T.tool_format(ChatTemplate.default()) == T.HERMES
    assert T.tool_format(ChatTemplate("{{ '<|python_tag|>' }}")) == T.LLAMA3
    assert T.tool_format(ChatTemplate("{{ '[TOOL_CALLS]' }}")) == T.MISTRAL


def test_templates_without_tools_get_them_in_a_system_message():
    t = ChatTemplate.default()
    assert not T.renders_tools(t)
    msgs = T.template_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                               [WEATHER], t)
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "weather"' in msgs[0]["content"]
    msgs = T.template_messages([{"role": "user", "content": "hi"}], [WEATHER], t)
    assert msgs[0]["role"] == "system" and len(msgs) == 2
    rich = ChatTemplate("{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}"
                        "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    assert T.renders_tools(rich)
    msgs = T.template_messages([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], [WEATHER], rich)
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, for tojson
    assert rich.render(msgs, tools=[WEATHER]) == 'weather{"city": "Oslo"}'


def test_call_schema_and_grammar():
    other = {"type": "function", "function": {"name": "now"}}
    one = T.call_schema([WEATHER, other], "weather")
    assert one["properties"]["name"] == {"const": "weather"} and one["required"] == ["name", "arguments"]
    both = T.call_schema([WEATHER, other])
    assert [o["properties"]["name"]["const"] for o in both["anyOf"]] == ["weather", "now"]
    g = T.call_grammar(T.HERMES, one)
    assert g.startswith('start: "<tool_call>" "\\n" call "\\n" "</tool_call>"') and "%json" in g


@pytest.mark.parametrize("step", [1, 7])
def test_a_reply_of_bare_json_is_a_call_of_a_known_function(step):
    text = ' {"name": "weather", "arguments": {"city": "Paris"}}'
    content, calls = _stream(T.ToolCallParser(T.HERMES, ["weather"]), text, step)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("weather", '{"city": "Paris"}')]
    for names in (["clock"], ["weather"]):  # an unknown function, or JSON that is no call: content, whole
        other = text if names == ["clock"] else ' {"city": "Paris"}'
        assert _stream(T.ToolCallParser(T.HERMES, names), other, step) == (other, [])


def test_markers_that_are_added_tokens_are_token_references():
    from tokenizers import Tokenizer, models

    tk = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tk.add_tokens(["<tool_call>", "</tool_call>"])

    class Tok:  # cflow's Tokenizer keeps the `tokenizers` object as .tk
        pass

    tok = Tok()
    tok.tk = tk
    g = T.call_grammar(T.HERMES, {"type": "object"}, tok)
    assert g.startswith('start: <[2]> "\\n" call "\\n" <[3]>')
    assert T.call_grammar(T.HERMES, {"type": "object"}).startswith('start: "<tool_call>"')
