"""Grammar engines for structured output, compared on schema coverage and speed with cflow's own tokenizers.

    python -m benchmarks.grammar [--engines llguidance,xgrammar,outlines-core,cflow]
                                 [--models bundled,qwen2.5-coder-0.5b] [--samples 8] [--tokens 128] [--rounds 3]
                                 [--no-decode] [--cache DIR] [--json [FILE]]

Engines: llguidance, xgrammar and outlines-core from PyPI, each given the Hugging Face tokenizer JSON a compiled
file carries (cflow.runtime.tokenizer.Tokenizer), and `cflow` (cflow.runtime.grammar: the chosen engine behind
the constraint interface cflow's sampler calls, its Python overhead included).

Coverage (the bundled model's tokenizer): each case (JSON schemas with nested objects, enums, array bounds,
required and optional fields, string patterns and formats, number bounds, anyOf / oneOf, $ref / $defs, closed
objects; "any JSON object"; a llama.cpp GBNF and a Lark grammar) is compiled, then --samples random walks pick
uniformly among the allowed tokens (more and more often among the allowed tokens that close something: end of
text, `"`, `@`, `.`, `]`, `}`, `)`) until the engine ends it or end of text is picked. Every text must parse
(json.loads, strict) and validate (jsonschema, formats checked) or match the grammar's language. A case reads
`ok`, `invalid k/N` (the engine let through output outside the schema: a constraint ignored or approximated),
`refused` (the engine does not take the case: the reason is kept) or `cap` (a walk did not end within 600
tokens). Row `control-chars`: whether the engine lets a raw control character (invalid in a JSON string) into a
length-bounded string.

Speed (each --models tokenizer): the time to build the engine's tokenizer data (once per tokenizer), to compile
each speed case up to the first mask, and per token: the allowed-token mask as a numpy bool array plus the advance,
over random walks (the worst cases: unlikely tokens) and over the model's own sampled tokens (temperature 0.8,
--tokens tokens, --rounds rounds, interleaved) next to the same loop unconstrained. The ratio (mask + advance) /
decode time per token is the cost the constraint adds; `m.generate` tok/s (sampled) is printed beside it. cflow's
constraint also runs under `chooser`, the server's sampler (cflow.runtime.choice.Chooser: forced tokens taken
without a mask, draws from the unmasked row first, the mask only when the grammar refuses them or leaves few
tokens; its cost is its time per token less a plain sampler's on the same row, which can be negative: a draw
among a few allowed tokens is cheaper than one over the whole row), and `ahead` (the next mask computed on a
helper thread while the model steps).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import threading
import time

import numpy as np

from benchmarks.common.record import Run, add_json_argument
from benchmarks.common.timing import busy_fraction

CAP = 600  # tokens of one random walk
# JSON on one line with ", " and ": " for every engine that takes a layout (xgrammar's any_whitespace=False is
# this; outlines-core allows an optional space around each)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# name -> (kind, payload, speed case?). Kinds: json_schema, json_object, gbnf, lark.
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email"},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1,
             "maxItems": 3}},
    "required": ["name", "age", "address", "tags"], "additionalProperties": False}
CASES = {
    "nested": ("json_schema", {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"], "additionalProperties": False}}},
            "required": ["id", "items"], "additionalProperties": False}},
        "required": ["order"], "additionalProperties": False}, False),
    "enum": ("json_schema", {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, "XL", None, True]},
        "kind": {"const": "shirt"}}, "required": ["color", "size", "kind"], "additionalProperties": False}, False),
    "array-bounds": ("json_schema", {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
                   "maxItems": 4},
        "pairs": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2,
                                             "maxItems": 2}, "minItems": 1, "maxItems": 2},
        "unique": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "maxItems": 3}},
        "required": ["scores", "pairs", "unique"], "additionalProperties": False}, False),
    "required-optional": ("json_schema", {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 8}, "b": {"type": "integer"}, "c": {"type": "boolean"},
        "d": {"type": "null"}}, "required": ["b", "d"], "additionalProperties": False}, False),
    "string-pattern": ("json_schema", {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
        "word": {"type": "string", "minLength": 3, "maxLength": 6}},
        "required": ["code", "word"], "additionalProperties": False}, False),
    "string-format": ("json_schema", {"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email"}, "at": {"type": "string", "format": "date-time"}},
        "required": ["day", "id", "mail", "at"], "additionalProperties": False}, False),
    "number-bounds": ("json_schema", {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": -5, "maximum": 250},
        "x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
        "k": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}},
        "required": ["n", "x", "k"], "additionalProperties": False}, False),
    "anyof-oneof": ("json_schema", {"type": "object", "properties": {
        "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[a-z]{2,5}$"}]},
        "shape": {"oneOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}},
             "required": ["kind", "r"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"},
                                              "h": {"type": "integer"}},
             "required": ["kind", "w", "h"], "additionalProperties": False}]}},
        "required": ["id", "shape"], "additionalProperties": False}, False),
    "ref-defs": ("json_schema", {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"], "additionalProperties": False}, False),
    "recursive-ref": ("json_schema", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"}, False),
    "closed-object": ("json_schema", {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}}, "additionalProperties": False}, False),
    "extra-values": ("json_schema", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                                     "required": ["name"], "additionalProperties": {"type": "integer"}}, False),
    "person": ("json_schema", PERSON, True),
    "json_object": ("json_object", None, True),
    "gbnf": ("gbnf", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
                     'factor ::= [1-9] [0-9]{0,3} | "(" expr ")"\n', True),
    "lark": ("lark", 'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
                     'factor: NUMBER | "(" expr ")"\nNUMBER: /[1-9][0-9]{0,3}/\n', False),
}


class Refused(Exception):
    """The engine does not take this kind of case."""


def check_text(kind: str, payload, text: str) -> str | None:
    """None if `text` is in the case's language, else why not."""
    if kind in ("gbnf", "lark"):
        if not re.fullmatch(r"[0-9+\-*/()]+", text):
            return f"not an expression: {text[:60]!r}"
        try:
            ast.parse(text, mode="eval")
        except SyntaxError as e:
            return f"not an expression: {e.msg}: {text[:60]!r}"
        return None
    try:
        value = json.loads(text)  # strict: raw control characters in strings are not JSON
    except ValueError as e:
        return f"not JSON: {e}: {text[:80]!r}"
    if kind == "json_object":
        return None if isinstance(value, dict) else f"not an object: {text[:60]!r}"
    import jsonschema

    v = jsonschema.Draft202012Validator(payload, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    err = next(iter(v.iter_errors(value)), None)
    return None if err is None else f"{err.message[:100]} in {text[:80]!r}"


def byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): each of the 256 bytes as the printable character that stands for it
    in a token's text; inverted, a token's raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tok) -> list[bytes | None]:
    """Each token id's raw bytes (None for special tokens) of a byte-level BPE tokenizer."""
    dec = byte_level_decoder()
    vocab = tok.tk.get_vocab(with_added_tokens=True)
    special = {t.content for t in tok.tk.get_added_tokens_decoder().values() if t.special}
    out: list[bytes | None] = [None] * (max(vocab.values()) + 1)
    for s, i in vocab.items():
        if s not in special and all(c in dec for c in s):
            out[i] = bytes(dec[c] for c in s)
    return out


def bits_to_bool(bitmask: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little", count=n).view(bool)


class LLGuidance:
    name = "llguidance"

    def __init__(self):
        import llguidance

        self.version = llguidance.__version__

    def prepare(self, tok):
        import llguidance

        return llguidance.LLTokenizer(tok.tk.to_str(), eos_token=sorted(tok.eos_ids))

    def build(self, info, kind, payload):
        import llguidance
        from llguidance import LLMatcher

        if kind in ("json_schema", "json_object"):
            g = LLMatcher.grammar_from_json_schema(payload or {"type": "object"}, defaults=JSON_LAYOUT)
        else:
            g = llguidance.grammar_from(kind, payload)
        err = LLMatcher.validate_grammar(g, info)
        if err:
            raise ValueError(err)
        return g

    def start(self, info, compiled):
        return _LLMatcher(info, compiled)


class _LLMatcher:
    def __init__(self, info, g):
        from llguidance import LLMatcher

        self.m, self.n = LLMatcher(info, g, log_level=0), info.vocab_size
        self.bits = np.zeros((self.n + 31) // 32, np.int32)

    def mask(self):
        self.m.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return bits_to_bool(self.bits, self.n)

    def accept(self, t):
        return self.m.consume_token(t)

    @property
    def done(self):
        return self.m.is_stopped()


class XGrammar:
    name = "xgrammar"

    def __init__(self):
        from importlib.metadata import version

        import xgrammar  # noqa: F401 -- imported here: its import (torch) is not the tokenizer's build time

        self.version = version("xgrammar")

    def prepare(self, tok):
        import xgrammar as xgr

        vocab = tok.tk.get_vocab(with_added_tokens=True)
        enc = [""] * (max(vocab.values()) + 1)
        for s, i in vocab.items():
            enc[i] = s
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.tk.to_str())  # what from_huggingface reads
        info = xgr.TokenizerInfo(enc, meta["vocab_type"], vocab_size=len(enc), stop_token_ids=sorted(tok.eos_ids),
                                 add_prefix_space=meta["add_prefix_space"])
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), len(enc)

    def build(self, info, kind, payload):
        comp, _ = info
        if kind in ("json_schema", "json_object"):
            return comp.compile_json_schema(json.dumps(payload or {"type": "object"}), any_whitespace=False)
        if kind == "gbnf":
            return comp.compile_grammar(payload)
        return comp.compile_lark(payload)

    def start(self, info, compiled):
        return _XGMatcher(compiled, info[1])


class _XGMatcher:
    def __init__(self, compiled, n):
        import xgrammar as xgr

        self.m, self.n = xgr.GrammarMatcher(compiled), n
        self.bits = np.zeros((1, (n + 31) // 32), np.int32)

    def mask(self):
        self.m.fill_next_token_bitmask(self.bits)
        return bits_to_bool(self.bits, self.n)

    def accept(self, t):
        return self.m.accept_token(t)

    @property
    def done(self):
        return self.m.is_terminated()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self):
        from importlib.metadata import version

        import outlines_core  # noqa: F401

        self.version = version("outlines-core")

    def prepare(self, tok):
        from outlines_core import Vocabulary

        eos = min(tok.eos_ids)
        by_bytes: dict[bytes, list[int]] = {}
        raw = token_bytes(tok)
        for i, b in enumerate(raw):
            if b is not None and i not in tok.eos_ids:
                by_bytes.setdefault(b, []).append(i)
        return Vocabulary(eos, by_bytes), len(raw), eos

    def build(self, info, kind, payload):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        if kind not in ("json_schema", "json_object"):
            raise Refused("regular expressions and JSON schemas only: no context-free grammars")
        return Index(build_regex_from_schema(json.dumps(payload or {"type": "object"})), info[0])

    def start(self, info, compiled):
        return _OCGuide(compiled, info[1], info[2])


class _OCGuide:
    def __init__(self, index, n, eos):
        from outlines_core import Guide

        self.g, self.n, self.eos = Guide(index), n, eos
        self.bits = np.zeros((n + 31) // 32, np.int32)

    def mask(self):
        self.g.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)
        return bits_to_bool(self.bits, self.n)

    def accept(self, t):
        if t != self.eos:  # end of text is allowed in a final state but has no transition
            self.g.advance(t, return_tokens=False)
        return True

    @property
    def done(self):
        return False  # a final state may still extend (its regex); end of text ends it


class Cflow:
    """cflow.runtime.grammar: the chosen engine behind the constraint interface (allowed / accept / finished)."""
    name = "cflow"

    def __init__(self):
        from cflow.runtime import grammar

        self.version = f"llguidance {grammar.engine_version()}"

    def prepare(self, tok):
        from cflow.runtime import grammar

        grammar.engine_tokenizer(tok)  # built once per tokenizer, cached
        return tok

    def build(self, tok, kind, payload):
        from cflow.runtime import grammar

        if kind == "json_object":
            return lambda: grammar.json_object(tok)
        if kind == "json_schema":
            return lambda: grammar.json_schema(tok, payload)
        return lambda: grammar.grammar(tok, payload, syntax=kind)

    def start(self, tok, compiled):
        return _CflowConstraint(compiled())


class _CflowConstraint:
    def __init__(self, c):
        self.c, self.masks = c, 0
        computed = c._mask

        def counted():  # the masks the engine computes (a forced token's is known without one)
            self.masks += not c._forced
            return computed()

        c._mask = counted

    def mask(self):
        return self.c.allowed()

    def accept(self, t):
        self.c.accept(t)
        return True

    @property
    def done(self):
        return self.c.finished


ENGINES = {e.name: e for e in (LLGuidance, XGrammar, OutlinesCore, Cflow)}


CLOSERS = '"@.]})'  # in the order a walk leans on them: strings end, then emails, numbers, containers


def closing_tokens(tok, n: int) -> np.ndarray:
    """[1 + len(CLOSERS), n] bool: end of text, then the tokens whose text holds each closer. A random walk leans on
    them more and more (each class with an allowed token in turn, taken with odds 0.6) so that every walk ends."""
    out = np.zeros((1 + len(CLOSERS), n), bool)
    out[0, [i for i in tok.eos_ids if i < n]] = True
    for i in range(n):
        text = tok.tk.decode([i])
        for k, c in enumerate(CLOSERS):
            out[1 + k, i] = c in text
    out[1:, [i for i in tok.eos_ids if i < n]] = False
    return out


def walk(matcher, tok, closing: np.ndarray, rng) -> tuple[list[int], list[float], str]:
    """One random walk: (tokens, seconds of mask + advance per token, how it ended: done / eos / cap / error)."""
    out, cost = [], []
    for step in range(CAP):
        t0 = time.perf_counter()
        allowed = matcher.mask()
        t1 = time.perf_counter()
        ids = np.flatnonzero(allowed)
        if ids.size == 0:
            return out, cost, "error: nothing allowed"
        if rng.random() < min(0.9, 0.15 + step / 60):
            ids = next((c for c in (ids[cls[ids]] for cls in closing) if c.size and rng.random() < 0.6), ids)
        t = int(rng.choice(ids))
        t2 = time.perf_counter()
        ok = matcher.accept(t)
        cost.append(t1 - t0 + time.perf_counter() - t2)
        if not ok:
            return out, cost, f"error: token {t} refused after it was allowed"
        if t in tok.eos_ids:
            return out, cost, "eos"
        out.append(t)
        if matcher.done:
            return out, cost, "done"
    return out, cost, "cap"


BOUNDED_STRING = {"type": "string", "minLength": 1, "maxLength": 12}


def control_probe(engine, info, tok) -> dict:
    """JSON strings hold no raw control characters (U+0000..U+001F must be escaped): inside a length-bounded
    string, does the engine allow a token with one?"""
    raw = token_bytes(tok)
    ctrl = np.array([b is not None and any(c < 0x20 for c in b) for b in raw])
    m = engine.start(info, engine.build(info, "json_schema", BOUNDED_STRING))
    for t in tok.encode('"', add_special=False):
        m.accept(t)
    allowed = m.mask()
    k = min(allowed.size, ctrl.size)
    bad = int((allowed[:k] & ctrl[:k]).sum())
    return {"status": "ok" if not bad else "invalid",
            "why": f"{bad} tokens with raw control characters allowed inside a string" if bad else None}


def coverage(engine, tok, samples: int) -> dict[str, dict]:
    """Per case: status (ok / invalid k/N / refused / cap / error) and the first problem seen."""
    info = engine.prepare(tok)
    closing = closing_tokens(tok, tok.vocab_size)
    result = {}
    for name, (kind, payload, _) in CASES.items():
        try:
            compiled = engine.build(info, kind, payload)
            walks = [walk(engine.start(info, compiled), tok, closing, np.random.default_rng(seed))
                     for seed in range(samples)]
        except Refused as e:
            result[name] = {"status": "refused", "why": str(e)}
            continue
        except Exception as e:  # noqa: BLE001 -- every engine raises its own kinds for a case it cannot take
            result[name] = {"status": "refused", "why": f"{type(e).__name__}: {str(e).strip()[:160]}"}
            continue
        bad, ends, why = 0, [], None
        for ids, _, end in walks:
            ends.append(end)
            problem = end if end == "cap" or end.startswith("error") else check_text(kind, payload, tok.decode(ids))
            bad += bool(problem) and not problem.startswith(("cap", "error"))
            why = why or problem
        status = (f"invalid {bad}/{samples}" if bad else "cap" if "cap" in ends
                  else "error" if why else "ok")
        result[name] = {"status": status, "why": why, "ends": ends}
    result["control-chars"] = control_probe(engine, info, tok)
    return result


def speed_walks(engine, tok, samples: int) -> dict:
    """Tokenizer data build time; per speed case the compile time (to the first mask) and mask + advance per
    token over random walks."""
    t = time.perf_counter()
    info = engine.prepare(tok)
    out = {"tokenizer_s": time.perf_counter() - t, "cases": {}}
    closing = closing_tokens(tok, tok.vocab_size)
    for name, (kind, payload, fast) in CASES.items():
        if not fast:
            continue
        try:
            t = time.perf_counter()
            compiled = engine.build(info, kind, payload)
            first = engine.start(info, compiled)
            first.mask()
            compile_s = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 -- recorded as refused
            out["cases"][name] = {"refused": f"{type(e).__name__}: {str(e).strip()[:160]}"}
            continue
        costs = []
        for seed in range(samples):
            costs += walk(engine.start(info, compiled), tok, closing, np.random.default_rng(seed))[1]
        us = np.array(costs) * 1e6
        out["cases"][name] = {"compile_ms": compile_s * 1e3, "tokens": len(us), "mean_us": float(us.mean()),
                              "p50_us": float(np.median(us)), "p99_us": float(np.percentile(us, 99)),
                              "max_us": float(us.max())}
    return out


PROMPTS = {"gbnf": "Write an arithmetic expression with a few numbers.",
           "json_object": "Reply with a JSON object describing a cat.",
           "person": "Reply with a JSON object for a person: name, age, email, address (city, zip) and tags."}


def prompt_ids(m, case: str) -> list[int]:
    """The case's request in the model's chat template where it has one, else a story opening (a small model
    trained on stories has no instructions to follow: the constraint then does all the work)."""
    if m.chat_template is not None:
        return m.tokenizer.encode(m.chat_prompt([{"role": "user", "content": PROMPTS[case]}]))
    return m.tokenizer.encode("Once upon a time")


def decode_loop(m, ids: list[int], tokens: int, seed: int, start=None, mode: str = "mask") -> dict:
    """`tokens` sampled tokens (temperature 0.8) one decode step each, as the server's loop takes them; with
    `start` (a constraint factory) under the constraint, a new one whenever the last is finished. mode "mask":
    mask, draw from the masked logits, accept; "chooser" (cflow's constraint): the server's sampler,
    cflow.runtime.choice.Chooser, over the constraint (forced tokens taken, draws first, the mask when refused);
    "ahead": as "mask", the next mask computed on a helper thread while the model steps. Returns seconds per token
    of the loop, of the constraint's calls (in "chooser" mode: the Chooser's time less a plain sampler's on the
    same row), of the sampler's calls (the whole Chooser in "chooser" mode), and how many masks the engine
    computed."""
    from cflow.runtime.choice import Chooser
    from cflow.runtime.sampling import Sampler

    s, sampler = m.session, Sampler(0.8, seed=seed)
    s.reset()
    logits = s.prefill(ids)
    c, cost, masks, draw_s, t0 = (start() if start else None), 0.0, 0, 0.0, time.perf_counter()
    chooser, choosers = None, 0
    for i in range(tokens):
        if c is None:
            a = time.perf_counter()
            tok = sampler(logits)
            draw_s += time.perf_counter() - a
        elif mode == "chooser":
            if chooser is None:
                chooser = Chooser(0.8, seed=seed + choosers, constraint=c.m.c, eos_id=min(m.eos_ids))
                choosers += 1
            # paired: the plain sampler on the same row (its token unused), before or after by turns, so that
            # the cost is the chooser's time less the plain sampler's, token by token
            a = time.perf_counter()
            if i % 2:
                sampler(logits)
            b = time.perf_counter()
            tok = chooser(logits)
            d = time.perf_counter()
            if not i % 2:
                sampler(logits)
            e = time.perf_counter()
            draw_s += d - b
            cost += (d - b) - (b - a) - (e - d)
        else:
            a = time.perf_counter()
            allowed = c.mask()
            b = time.perf_counter()
            x = np.full(logits.shape, -np.inf, dtype=logits.dtype)
            np.copyto(x[: allowed.size], logits[: allowed.size], where=allowed)
            tok = sampler(x)
            cost += b - a
            a = time.perf_counter()
            c.accept(tok)
            cost += time.perf_counter() - a
        if c is not None:
            if c.done or tok in m.eos_ids:
                masks += c.masks
                c.close()
                c, chooser = start(), None
        if i + 1 < tokens:
            logits = s.step(tok)
    if c is not None:
        masks += c.masks
        c.close()
    n = max(tokens, 1)
    return {"loop_s": (time.perf_counter() - t0) / n, "constraint_s": cost / n, "draw_s": draw_s / n, "masks": masks}


def generate_tok_s(m, ids: list[int], tokens: int) -> float:
    t = time.perf_counter()
    out = m.generate(ids, max_new_tokens=tokens, temperature=0.8, seed=1, stop=False)
    return len(out) / (time.perf_counter() - t)


def model_runs(name: str, path: str, engines: list, args) -> list[dict]:
    """Per engine (and mode, for cflow's constraint) and speed case: the decode loop under the constraint against
    the same loop without one, in interleaved rounds."""
    import cflow

    m = cflow.load(path)
    try:
        cases = [c for c, (_, _, fast) in CASES.items() if fast]
        prompt = {c: prompt_ids(m, c) for c in cases}
        tokens = min(args.tokens, m.session.max_seq - max(len(p) for p in prompt.values()))
        plans = [(e, "mask") for e in engines] + [(e, mode) for e in engines if e.name == "cflow"
                                                    for mode in ("chooser", "ahead")]
        starts = {}
        for e in engines:
            info = e.prepare(m.tokenizer)
            for c in cases:
                kind, payload, _ = CASES[c]
                try:
                    starts[e.name, c] = (e, info, e.build(info, kind, payload))
                except Exception as err:  # noqa: BLE001 -- refused: noted, not timed
                    print(f"# {name} {e.name} {c}: refused ({type(err).__name__})", flush=True)
        samples: dict[tuple, list] = {}
        for r in range(args.rounds):
            for c in cases:
                samples.setdefault(("plain", c), []).append(
                    busy_fraction(lambda c=c, r=r: decode_loop(m, prompt[c], tokens, r)))
                for e, mode in plans:
                    if (e.name, c) not in starts:
                        continue
                    e_, info, compiled = starts[e.name, c]
                    wrap = _Ahead if mode == "ahead" else _Sampling

                    def start(e_=e_, info=info, compiled=compiled, wrap=wrap):
                        return wrap(e_.start(info, compiled))

                    label = e.name if mode == "mask" else f"{e.name}+{mode}"
                    samples.setdefault((label, c), []).append(
                        busy_fraction(lambda c=c, r=r, start=start, mode=mode:
                                      decode_loop(m, prompt[c], tokens, r, start, mode)))
        gen = max(generate_tok_s(m, prompt[cases[0]], tokens) for _ in range(args.rounds))
        return summarize(name, m, samples, gen, tokens)
    finally:
        m.close()


class _Sampling:
    """A benchmark matcher (mask / accept / done) that counts the masks its engine computes."""

    def __init__(self, matcher):
        self.m, self.calls = matcher, 0

    def mask(self):
        self.calls += 1
        return self.m.mask()

    @property
    def masks(self):
        return getattr(self.m, "masks", self.calls)  # cflow's constraint counts its engine's own

    def accept(self, t):
        if not self.m.accept(t):
            raise RuntimeError(f"token {t} refused after it was allowed")

    @property
    def done(self):
        return self.m.done

    def close(self):
        pass


class _Ahead(_Sampling):
    """The mask of the next token computed on a helper thread from accept() on, while the model runs its step
    (the engine and the native step both release the GIL)."""

    def __init__(self, matcher):
        super().__init__(matcher)
        self.go, self.ready, self.out, self.stop = threading.Semaphore(1), threading.Semaphore(0), None, False
        self.finished = False  # read after accept, never while the helper thread holds the matcher
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            self.go.acquire()
            if self.stop:
                return
            self.out = self.m.mask()
            self.ready.release()

    def mask(self):
        self.ready.acquire()
        return self.out

    def accept(self, t):
        super().accept(t)
        self.finished = self.m.done
        if not self.finished:
            self.go.release()

    @property
    def done(self):
        return self.finished

    def close(self):
        self.stop = True
        self.go.release()


def summarize(name: str, m, samples: dict, gen_tok_s: float, tokens: int) -> list[dict]:
    """Rows of (engine, case): medians over rounds of loop and constraint time per token, the plain loop's beside."""
    rows = []
    for (engine, case), runs in samples.items():
        if engine == "plain":
            continue
        plain = float(np.median([r["loop_s"] for r, _ in samples["plain", case]]))
        loop = float(np.median([r["loop_s"] for r, _ in runs]))
        cost = float(np.median([r["constraint_s"] for r, _ in runs]))
        rows.append({"model": name, "engine": engine, "case": case, "tokens": tokens, "plain_us": plain * 1e6,
                     "loop_us": loop * 1e6, "constraint_us": cost * 1e6, "ratio": cost / plain,
                     "masks_per_token": float(np.median([r["masks"] for r, _ in runs])) / tokens,
                     "generate_tok_s": gen_tok_s, "other_load": max(b for _, b in runs),
                     "quant": m.session.header.get("quant"), "threads": m.session.threads})
    return rows


def model_tokenizer(path: str):
    """A fresh cflow Tokenizer of a compiled file (its header only: no weights mapped)."""
    from cflow.runtime.format.reader import FileReader
    from cflow.runtime.tokenizer import Tokenizer

    with FileReader(path) as r:
        h = r.header
    return Tokenizer(h["tokenizer"], h.get("eos_token_ids") or (), h.get("special_tokens"))


def print_coverage(cov: dict[str, dict]) -> None:
    names = list(cov)
    print("\n| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for case in [*CASES, "control-chars"]:
        print(f"| {case} | " + " | ".join(cov[e][case]["status"] for e in names) + " |")
    for e in names:
        for case, r in cov[e].items():
            if r["status"] != "ok":
                print(f"#   {e} {case}: {r['why']}")


def print_walks(walks: dict) -> None:
    print("\n| model | engine | tokenizer data s | case | compile ms | mask + advance us/token: mean | p50 | p99 |"
          "\n|---|---|---|---|---|---|---|---|")
    for (model, engine), w in walks.items():
        for case, r in w["cases"].items():
            if "refused" in r:
                print(f"| {model} | {engine} | {w['tokenizer_s']:.3f} | {case} | refused | | | |")
            else:
                print(f"| {model} | {engine} | {w['tokenizer_s']:.3f} | {case} | {r['compile_ms']:.1f} | "
                      f"{r['mean_us']:.1f} | {r['p50_us']:.1f} | {r['p99_us']:.1f} |")


def print_loops(rows: list[dict]) -> None:
    print("\n| model | engine | case | decode us/token | constrained loop us/token | constraint us/token | "
          "ratio | masks/token |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['engine']} | {r['case']} | {r['plain_us']:.1f} | {r['loop_us']:.1f} | "
              f"{r['constraint_us']:.1f} | {100 * r['ratio']:.1f}% | {r['masks_per_token']:.2f} |")
    for model in dict.fromkeys(r["model"] for r in rows):
        r = next(r for r in rows if r["model"] == model)
        print(f"# {model}: m.generate (temperature 0.8) {r['generate_tok_s']:.1f} tok/s = "
              f"{1e6 / r['generate_tok_s']:.1f} us/token")


def main(argv=None) -> int:
    from benchmarks.conformance import cache_dir
    from benchmarks.speculate import model_file
    from cflow.codegen.target import cpu_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar", description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="llguidance,xgrammar,outlines-core,cflow",
                   help=f"engines to compare, of {', '.join(ENGINES)} (default all)")
    p.add_argument("--models", default="bundled,qwen2.5-coder-0.5b",
                   help="models whose tokenizers (and decode) are timed: 'bundled' and/or conformance.py names "
                        "(default bundled,qwen2.5-coder-0.5b)")
    p.add_argument("--samples", type=int, default=8, help="random walks per case (default 8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode loop (default 128)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every decode loop (default 3)")
    p.add_argument("--no-decode", action="store_true", help="coverage and random walks only")
    p.add_argument("--cache", default=None, help="where the GGUF files are kept (conformance.py's --cache)")
    add_json_argument(p)
    args = p.parse_args(argv)
    run = Run("grammar", argv)
    engines = []
    for name in args.engines.split(","):
        if name not in ENGINES:
            p.error(f"unknown engine {name!r}")
        engines.append(ENGINES[name]())
    work = cache_dir(args.cache) / "speculate"
    work.mkdir(exist_ok=True)
    paths = {name: model_file(name, cache_dir(args.cache), work) for name in args.models.split(",")}
    print(f"# {cpu_model()} | " + ", ".join(f"{e.name} {e.version}" for e in engines), flush=True)
    records = []

    cov = {e.name: coverage(e, model_tokenizer(paths["bundled"]), args.samples) for e in engines}
    print_coverage(cov)
    for e in engines:
        for case, r in cov[e.name].items():
            records.append(run.record(engine=e.name, model="bundled", isa_path=None, variant=f"coverage/{case}",
                                      engine_version=e.version, **r))

    walks = {(name, e.name): speed_walks(e, model_tokenizer(path), args.samples)
             for name, path in paths.items() for e in engines}
    print_walks(walks)
    for (name, engine), w in walks.items():
        for case, r in w["cases"].items():
            records.append(run.record(engine=engine, model=name, isa_path=None, variant=f"walk/{case}",
                                      tokenizer_s=w["tokenizer_s"], **r))

    if not args.no_decode:
        rows = [r for name, path in paths.items() for r in model_runs(name, path, engines, args)]
        print_loops(rows)
        for r in rows:
            records.append(run.record(engine=r["engine"], model=r["model"], quant=r["quant"], threads=r["threads"],
                                      variant=f"decode/{r['case']}", tok_s=1e6 / r["loop_us"],
                                      **{k: v for k, v in r.items()
                                         if k not in ("engine", "model", "quant", "threads")}))
    run.write(args.json, records, {"engines": {e.name: e.version for e in engines}, "cap": CAP})
    return 0


if __name__ == "__main__":
    sys.exit(main())
