"""Structured output constraints (cflow.runtime.grammar): every text a random chooser can draw under one parses and
is valid; bad schemas and grammars are CflowErrors naming the problem."""

import ast
import json
import re
import sys

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from cflow.errors import CflowError  # noqa: E402
from cflow.models.bundled import default_model_dir  # noqa: E402
from cflow.runtime import grammar  # noqa: E402
from cflow.runtime.tokenizer import Tokenizer  # noqa: E402

CAP = 600  # tokens: the chooser leans on closing tokens, so walks end long before this

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                        "required": ["city"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "n": {"enum": [1, 2, None, "many"]}, "kind": {"const": "shirt"}},
             "required": ["color", "n", "kind"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
              "maxItems": 4},
    "array-of-objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    "required-optional": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 8}, "b": {"type": "integer"}, "c": {"type": "boolean"},
        "d": {"type": "null"}}, "required": ["b", "d"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "i": {"type": "integer", "minimum": -5, "maximum": 250}, "x": {"type": "number", "exclusiveMinimum": 0,
                                                                     "maximum": 1.5}},
        "required": ["i", "x"], "additionalProperties": False},
    "strings": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}, "word": {"type": "string", "minLength": 3,
                                                                                "maxLength": 6},
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
        "required": ["code", "word", "day", "id"], "additionalProperties": False},
    "anyof-ref": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"},
                                                                       "y": {"type": "integer"}},
                                      "required": ["x", "y"], "additionalProperties": False}},
                  "type": "object", "properties": {
                      "at": {"$ref": "#/$defs/point"},
                      "label": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer"}]}},
                  "required": ["at", "label"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def tok():
    """The bundled model's tokenizer (byte-level BPE, 2,048 tokens; id 0 <|endoftext|> is its end of text)."""
    return Tokenizer((default_model_dir() / "tokenizer.json").read_text(encoding="utf-8"), eos_ids=[0],
                     specials={"bos": 0, "eos": 0})


@pytest.fixture(scope="module")
def closers(tok):
    """Token classes a walk leans on, in order: end of text, then tokens holding `"`, `]`, `}`, `)`."""
    n = tok.vocab_size
    text = [tok.tk.decode([i]) for i in range(n)]
    out = [np.isin(np.arange(n), sorted(tok.eos_ids))]
    out += [np.array([c in t for t in text]) for c in '"]})']
    return out


def random_text(c, tok, closers, seed: int) -> str:
    """Draw uniformly among the allowed tokens (more and more often among the closing ones) until the grammar is
    finished or end of text is drawn; the text drawn."""
    rng = np.random.default_rng(seed)
    ids = []
    for step in range(CAP):
        allowed = c.allowed()
        assert allowed.dtype == bool and allowed.shape == (tok.vocab_size,)
        cand = np.flatnonzero(allowed)
        assert cand.size, "nothing allowed"
        if rng.random() < min(0.9, 0.2 + step / 50):
            cand = next((k for k in (cand[cls[cand]] for cls in closers) if k.size and rng.random() < 0.6), cand)
        t = int(rng.choice(cand))
        c.accept(t)
        if t in tok.eos_ids:
            break
        ids.append(t)
        if c.finished:
            break
    else:
        pytest.fail(f"no end within {CAP} tokens: {tok.decode(ids)[:200]!r}")
    return tok.decode(ids)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_choices_give_valid_json(name, tok, closers):
    schema = SCHEMAS[name]
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for seed in range(4):
        text = random_text(grammar.json_schema(tok, schema), tok, closers, seed)
        validator.validate(json.loads(text))  # json.loads is strict: no raw control characters in strings


def test_json_object_gives_an_object(tok, closers):
    for seed in range(4):
        assert isinstance(json.loads(random_text(grammar.json_object(tok), tok, closers, seed)), dict)


def test_schema_as_json_text(tok, closers):
    text = random_text(grammar.json_schema(tok, json.dumps(SCHEMAS["enum"])), tok, closers, 0)
    assert json.loads(text)["kind"] == "shirt"


GBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [1-9] [0-9]{0,2} | "(" expr ")"\n'
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[1-9][0-9]{0,2}/\n'


@pytest.mark.parametrize("syntax,text", [("gbnf", GBNF), ("lark", LARK)])
def test_grammar_texts_are_in_the_language(syntax, text, tok, closers):
    for seed in range(4):
        out = random_text(grammar.grammar(tok, text, syntax=syntax), tok, closers, seed)
        assert re.fullmatch(r"[0-9+\-()]+", out), out
        ast.parse(out, mode="eval")  # balanced, no dangling operator


def test_regex(tok, closers):
    out = random_text(grammar.grammar(tok, r"(yes|no), [0-9]{3}", syntax="regex"), tok, closers, 0)
    assert re.fullmatch(r"(yes|no), [0-9]{3}", out), out


def test_finished_allows_only_end_of_text(tok):
    c = grammar.json_schema(tok, {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"],
                                  "additionalProperties": False})
    for t in tok.encode('{"a": 1}', add_special=False):
        assert not c.finished
        c.accept(t)
    assert c.finished
    assert np.flatnonzero(c.allowed()).tolist() == [0]
    c.accept(0)


def test_stop_ids_end_the_text_where_the_grammar_may_end(tok):
    c = grammar.grammar(tok, 'root ::= "a"+', stop_ids=[5, 0])
    assert not c.allowed()[[0, 5]].any()
    c.accept(tok.encode("a", add_special=False)[0])
    assert c.allowed()[[0, 5]].all() and not c.finished
    c.accept(5)
    assert c.finished


def test_refused_token_raises_and_leaves_the_state(tok):
    c = grammar.json_object(tok)
    bad = tok.encode("x", add_special=False)[0]
    assert not c.allowed()[bad]
    with pytest.raises(CflowError, match=f"token {bad} is not allowed"):
        c.accept(bad)
    assert c.try_accept(bad) is False
    brace = tok.encode("{", add_special=False)[0]
    assert c.try_accept(brace) is True  # still at the start: the refused tokens left no trace
    assert not c.allowed()[brace]


def engine_mask(c) -> list[int]:
    """The engine's own mask of the constraint's state (computed on a copy, so the state is left alone)."""
    m = c._m.deep_copy()
    bits = np.zeros((c.n + 31) // 32, np.int32)
    m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), count=c.n, bitorder="little")).tolist()


@pytest.mark.parametrize("name", ["nested", "enum", "array-of-objects", "json_object", "gbnf"])
def test_forced_tokens_are_the_engines_mask(name, tok, closers):
    """Where forced() names a token (a run learnt from one engine call), the engine's mask allows it alone; elsewhere
    allowed() is the engine's mask. Walks alternate accept and try_accept."""
    for seed in range(3):
        c = (grammar.json_object(tok) if name == "json_object" else grammar.grammar(tok, GBNF) if name == "gbnf"
             else grammar.json_schema(tok, SCHEMAS[name]))
        rng, forced = np.random.default_rng(seed), 0
        for step in range(CAP):
            if c.finished:
                break
            want, f = engine_mask(c), c.forced()
            if f is not None:
                assert want == [f]
                forced += 1
                t = f
            else:
                cand = np.flatnonzero(c.allowed())
                assert cand.tolist() == want
                if rng.random() < min(0.9, 0.2 + step / 50):
                    cand = next((k for k in (cand[cls[cand]] for cls in closers) if k.size and rng.random() < .6),
                                cand)
                t = int(rng.choice(cand))
            if step % 2:
                c.accept(t)
            else:
                assert c.try_accept(t)
            if t in tok.eos_ids:
                break
        else:
            pytest.fail("no end")
        assert forced or name in ("gbnf", "json_object")


def test_a_forced_run_refuses_other_tokens(tok):
    c = grammar.json_schema(tok, SCHEMAS["enum"])
    brace = tok.encode("{", add_special=False)[0]
    assert c.forced() == brace
    c.accept(brace)
    quote = c.forced()
    assert quote is not None and tok.decode([quote]) == '"'  # the run goes on: {"color": ...
    assert c.try_accept(brace) is False and c.forced() == quote
    with pytest.raises(CflowError, match="not allowed"):
        c.accept(brace)


@pytest.mark.parametrize("schema,match", [
    ({"type": "strin"}, "json_schema: Invalid type: strin"),
    ({"$ref": "#/$defs/nope"}, "/\\$defs/nope"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "json_schema"),
    ([1, 2], "must be a JSON object, got list"),
    ("{not json", "json_schema: not JSON"),
])
def test_bad_schema_is_a_cflow_error(schema, match, tok):
    with pytest.raises(CflowError, match=match):
        grammar.json_schema(tok, schema)


def test_not_strict_leaves_out_what_the_engine_cannot_enforce(tok):
    c = grammar.json_schema(tok, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                            strict=False)
    assert c.allowed()[tok.encode("[", add_special=False)[0]]


@pytest.mark.parametrize("syntax,text,match", [
    ("gbnf", 'root ::= foo', "gbnf grammar: .*Rule 'foo' not found"),
    ("gbnf", 'root ::= ("a"', "gbnf grammar: .*Expected '\\)'"),
    ("lark", 'start: b', 'lark grammar: .*unknown name: "b"'),
    ("regex", "[a-", "regex grammar: .*unclosed character class"),
    ("gbnf", "  ", "gbnf grammar: empty"),
    ("ebnf", 'root ::= "a"', "grammar syntax must be one of gbnf, lark, regex"),
])
def test_bad_grammar_is_a_cflow_error(syntax, text, match, tok):
    with pytest.raises(CflowError, match=match):
        grammar.grammar(tok, text, syntax=syntax)


def test_engine_data_is_built_once_per_tokenizer(tok):
    assert grammar.engine_tokenizer(tok) is grammar.engine_tokenizer(tok)
    a, b = grammar.json_object(tok), grammar.json_object(tok)  # a copy of one compiled grammar each
    a.accept(tok.encode("{", add_special=False)[0])
    assert b.allowed()[tok.encode("{", add_special=False)[0]]  # b has its own state


def test_no_tokenizer_is_a_cflow_error():
    with pytest.raises(CflowError, match="needs a model with a tokenizer"):
        grammar.json_object(None)


def test_missing_engine_names_the_extra(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance -> ImportError
    with pytest.raises(CflowError, match=r"pip install 'cflow\[serve\]'"):
        grammar.engine_version()
    with pytest.raises(CflowError, match=r"needs the llguidance package"):
        grammar.json_object(tok)


BOUNDED = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
             "additionalProperties": False}},
    "required": ["name", "age", "pets", "home"], "additionalProperties": False}


def test_the_bundled_model_writes_valid_json_under_a_schema():
    """The real model's logits, masked, sampled (the loop the server's sampler runs): every output validates."""
    import cflow
    from cflow.runtime.sampling import Sampler

    m = cflow.compile(default_model_dir(), threads=2)
    try:
        s, ids = m.session, m.tokenizer.encode("Once upon a time")
        for seed in range(3):
            sampler, c, out = Sampler(0.8, seed=seed), grammar.json_schema(m.tokenizer, BOUNDED), []
            s.reset()
            logits = s.prefill(ids)
            while not c.finished and len(ids) + len(out) < s.max_seq:
                allowed = c.allowed()
                tok = sampler(np.where(allowed, logits[: allowed.size], -np.inf))
                c.accept(tok)
                if tok in m.eos_ids:
                    break
                out.append(tok)
                logits = s.step(tok)
            assert c.finished, m.tokenizer.decode(out)
            jsonschema.validate(json.loads(m.tokenizer.decode(out)), BOUNDED)
    finally:
        m.close()
