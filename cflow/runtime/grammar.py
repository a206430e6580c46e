"""Structured output: the tokens one sequence may take next under a JSON schema, "any JSON object", or a user's
grammar (llama.cpp GBNF, Lark, a regular expression), computed by llguidance (docs/structured-output.md says why
this engine).

A Constraint is what the sampler asks, once per token:

    allowed() -> bool array [n]    the token ids the grammar allows next (ids >= n are not allowed); n is the
                                   tokenizer's vocabulary; end of text is allowed exactly where the grammar may end
    accept(token)                  advance with the chosen token (CflowError if the grammar does not allow it)
    try_accept(token) -> bool      advance if allowed, else leave the state as it was and say so: a sampler that
                                   draws first and computes the mask only when its token is refused pays the mask
                                   on those tokens only (the masked distribution's draw, exact for temperature)
    forced() -> int | None         the next token where the grammar forces it (the one token its mask allows),
                                   else None (also where that is not known yet): taken with neither a mask nor a draw
    finished                       the grammar is complete: only end of text may follow

Where the grammar forces the next bytes (a JSON key and its `": "`, the rest of an enum value), llguidance's mask
is the first token of those bytes as its tokenizer writes them, alone; one engine call (compute_ff_tokens) then
gives the whole run, whose other tokens need neither a mask nor a draw. The constraint asks for the run only where
a mask allows one token: asking after every token, or before every mask, costs more than it saves (a question
costs about a mask; most states force nothing). Every sequence of a grammar starts in the same state, so the run
there (the `{"` of a JSON schema) is asked once per compiled grammar.

The engine's view of a tokenizer (every token's bytes and a trie over them) takes about a second to build for a
150k vocabulary, so it is built once per cflow Tokenizer and kept while the tokenizer lives; a compiled grammar
(about a millisecond for a JSON schema) is kept too, the last few per tokenizer, and each new sequence starts
from a copy of it (a microsecond).
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections import OrderedDict

import numpy as np

from ..errors import CflowError

SYNTAXES = ("gbnf", "lark", "regex")
# JSON as json.dumps writes it: one line, ", " and ": ". A fixed layout leaves the model no run of whitespace to
# get lost in, and it is what models have seen most.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_KEPT_GRAMMARS = 32  # compiled grammars kept per tokenizer (a server's schemas repeat; n > 1 shares one)

_lock = threading.Lock()
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> _Engine


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise CflowError("structured output (response_format, grammar) needs the llguidance package: "
                         "pip install 'cflow[serve]'") from None
    return llguidance


def engine_version() -> str:
    return _llguidance().__version__


class _Engine:
    """llguidance's tokenizer for one cflow Tokenizer and the grammars compiled against it."""

    def __init__(self, tokenizer):
        llg = _llguidance()
        tk = copy.copy(tokenizer.tk)  # the Hugging Face `tokenizers` object the compiled file carries
        tk.no_padding()  # the engine tokenizes single texts: no batch settings
        tk.no_truncation()
        eos = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids, default=None)
        self.llt = llg.LLTokenizer(tk.to_str(), eos_token=eos)
        self.eos = self.llt.eos_token
        self.n = self.llt.vocab_size
        self.stops = frozenset(int(i) for i in (*tokenizer.eos_ids, self.eos) if 0 <= int(i) < self.n)
        self.limits = llg.LLParserLimits(verbose_errors=False)
        # grammar text -> (a matcher before its first token, the tokens its start state forces)
        self.grammars: OrderedDict[str, tuple[object, list[int]]] = OrderedDict()

    def matcher(self, what: str, grammar: str) -> tuple[object, list[int]]:
        """A fresh matcher of `grammar` (compiled once, copied after) and the tokens its first state forces."""
        with _lock:
            kept = self.grammars.get(grammar)
            if kept is not None:
                self.grammars.move_to_end(grammar)
                return kept[0].deep_copy(), kept[1]
        m = _llguidance().LLMatcher(self.llt, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise CflowError(f"{what}: {_message(m.get_error())}")
        run = [] if m.is_stopped() else list(m.compute_ff_tokens())
        with _lock:
            kept = self.grammars.setdefault(grammar, (m, run))
            while len(self.grammars) > _KEPT_GRAMMARS:
                self.grammars.popitem(last=False)
            return kept[0].deep_copy(), kept[1]


def engine_tokenizer(tokenizer) -> _Engine:
    """The engine's data for `tokenizer` (built on first use, then kept while the tokenizer lives)."""
    if tokenizer is None or getattr(tokenizer, "tk", None) is None:
        raise CflowError("structured output needs a model with a tokenizer")
    with _lock:
        engine = _engines.get(tokenizer)
    if engine is None:
        engine = _Engine(tokenizer)  # outside the lock: a second or so for a large vocabulary
        with _lock:
            engine = _engines.setdefault(tokenizer, engine)
    return engine


def _message(text: str) -> str:
    """An engine message on one line: no caret markers, no blank lines, at most 400 characters."""
    lines = [s.strip() for s in str(text).splitlines()]
    out = " ".join(s for s in lines if s and set(s) - set("^") and s != "<non-verbose/>")
    return out[:400] or "invalid"


class Constraint:
    """The grammar state of one sequence (module docstring). Not shared between threads."""

    def __init__(self, engine: _Engine, matcher, stop_ids=None, start_run=()):
        self._m, self._eos, self.n = matcher, engine.eos, engine.n
        stops = engine.stops if stop_ids is None else frozenset(int(i) for i in stop_ids) | {engine.eos}
        self._stops = np.array(sorted(i for i in stops if 0 <= i < self.n), dtype=np.int64)
        self._stop_set = frozenset(self._stops.tolist())
        self._bits = np.zeros((self.n + 31) // 32, dtype=np.int32)
        self._bits_at = (self._bits.ctypes.data, self._bits.nbytes)
        # What is known of the current state: whether it is stopped, its mask once computed (`_known`: in _bits,
        # llguidance's packed layout; `_ok`: as a bool array once asked for), and the tokens the grammar forces
        # from here (the next one last), learnt with a mask of one token or at the start.
        self._stopped = matcher.is_stopped()
        self._known = False
        self._ok: np.ndarray | None = None
        self._forced: list[int] = list(start_run)[::-1]

    def allowed(self) -> np.ndarray:
        """The mask of the current state as a bool array [n] (kept for it: read it, do not change it)."""
        if self._ok is None:
            words = self.allowed_bits()
            self._ok = np.unpackbits(words.view(np.uint8), count=self.n, bitorder="little").view(bool)
        return self._ok

    def allowed_bits(self) -> np.ndarray:
        """The mask of the current state packed as llguidance writes it: int32 words [ceil(n / 32)], token i
        allowed where bit i % 32 of word i // 32 is set (kept for it: read it, do not change it)."""
        if not self._known:
            self._mask()
        return self._bits

    def forced(self) -> int | None:
        """The next token if the grammar forces it and that is known (module docstring), else None."""
        return self._forced[-1] if self._forced else None

    def try_accept(self, token: int) -> bool:
        token = int(token)
        if self._forced:
            ok = token == self._forced[-1]
        elif token in self._stop_set and self._stopped:
            return True  # the grammar is complete: end of text is what may follow
        elif self._known:  # the mask is known: a look-up
            ok = 0 <= token < self.n and bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)
        else:  # ask the engine (cheaper than a mask)
            if self._m.try_consume_tokens([self._eos if token in self._stop_set else token]) != 1:
                return False
            self._ok, self._known, self._stopped = None, False, self._m.is_stopped()
            return True
        if ok:
            self._consume(token)
        return ok

    def accept(self, token: int) -> None:
        if not self.try_accept(token):
            raise CflowError(f"token {int(token)} is not allowed by the grammar here")

    @property
    def finished(self) -> bool:
        return self._stopped

    @property
    def mask_known(self) -> bool:
        """Is the current state's mask computed already (allowed_bits() then costs nothing)?"""
        return self._known

    def _consume(self, token: int) -> None:
        """Advance with a token known to be allowed."""
        if self._forced:
            self._forced.pop()
        elif token in self._stop_set:
            token = self._eos
        if not self._m.consume_token(token):
            raise CflowError(f"grammar: {_message(self._m.get_error())}")
        self._ok, self._known, self._stopped = None, False, self._m.is_stopped()

    def _mask(self) -> None:
        """The allowed tokens of the current state into _bits (stop tokens where end of text is allowed). A mask
        of one token (not end of text) starts a forced run: asked for whole (module docstring)."""
        m, bits = self._m, self._bits
        self._known = True
        if self._forced:  # the engine's mask is this token alone
            bits[:] = 0
            t = self._forced[-1]
            bits[t >> 5] = np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            return
        m.unsafe_compute_mask_ptr(*self._bits_at)
        if m.is_error():  # a limit of the engine's (lexer or parser too complex for one step)
            self._known = False
            raise CflowError(f"grammar: {_message(m.get_error())}")
        if (int(bits[self._eos >> 5]) >> (self._eos & 31)) & 1:
            words = bits.view(np.uint32)  # any of the sequence's stop tokens ends it where the grammar may end
            for t in self._stops.tolist():
                words[t >> 5] |= np.uint32(1 << (t & 31))
        elif (one := _one_token(bits)) is not None:
            run = m.compute_ff_tokens()
            self._forced = run[::-1] if run and run[0] == one else [one]


def _one_token(words: np.ndarray) -> int | None:
    """The token of a bit mask that allows exactly one, else None."""
    nz = np.flatnonzero(words)
    if nz.size != 1:
        return None
    w = int(words[nz[0]]) & 0xFFFFFFFF
    return int(nz[0]) * 32 + w.bit_length() - 1 if w & (w - 1) == 0 else None


def _constraint(tokenizer, what: str, grammar: str, stop_ids) -> Constraint:
    engine = engine_tokenizer(tokenizer)
    matcher, run = engine.matcher(what, grammar)
    return Constraint(engine, matcher, stop_ids, run)


def json_schema(tokenizer, schema, strict: bool = True, stop_ids=None) -> Constraint:
    """JSON text valid under `schema` (a dict, or its JSON text). strict: a keyword the engine cannot enforce is
    an error naming it; otherwise it is left out (the output may then miss that one rule). stop_ids: the end of
    text tokens allowed where the JSON is complete (default the tokenizer's EOS)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise CflowError(f"json_schema: not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise CflowError(f"json_schema: the schema must be a JSON object, got {type(schema).__name__}")
    options = {**JSON_LAYOUT, "lenient": not strict}
    try:
        grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise CflowError(f"json_schema: {_message(e)}") from None
    return _constraint(tokenizer, "json_schema", grammar, stop_ids)


def json_object(tokenizer, stop_ids=None) -> Constraint:
    """Any JSON object (response_format {"type": "json_object"})."""
    return json_schema(tokenizer, {"type": "object"}, stop_ids=stop_ids)


def grammar(tokenizer, text: str, syntax: str = "gbnf", stop_ids=None) -> Constraint:
    """Text in the language of a grammar: syntax "gbnf" (llama.cpp's GBNF; Lark is taken there too), "lark"
    (llguidance's Lark dialect) or "regex"."""
    if syntax not in SYNTAXES:
        raise CflowError(f"grammar syntax must be one of {', '.join(SYNTAXES)}, got {syntax!r}")
    if not isinstance(text, str) or not text.strip():
        raise CflowError(f"{syntax} grammar: empty")
    try:
        g = _llguidance().grammar_from(syntax, text)
    except (ValueError, TypeError) as e:
        raise CflowError(f"{syntax} grammar: {_message(e)}") from None
    return _constraint(tokenizer, f"{syntax} grammar", g, stop_ids)
