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
                                   else None: taken with neither a mask nor a draw
    finished                       the grammar is complete: only end of text may follow

Where the grammar forces the next bytes (a JSON key and its `": "`, the rest of an enum value), llguidance's mask
is the first token of those bytes as its tokenizer writes them, alone; one engine call (compute_ff_tokens) gives
the whole run. The constraint asks it (and whether the grammar stopped) right after the token the sampler chose,
while the engine's data is still in the cache (the first engine call after a decode step costs several times what
the next ones do), as long as the grammar forces runs often enough to pay for the question.

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
RUN_PROBE, RUN_RATE = 0.05, 0.125  # see Constraint._learn
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
        self.grammars: OrderedDict[str, object] = OrderedDict()  # grammar text -> a matcher before its first token

    def matcher(self, what: str, grammar: str):
        """A fresh matcher of `grammar` (compiled once, copied after)."""
        with _lock:
            template = self.grammars.get(grammar)
            if template is not None:
                self.grammars.move_to_end(grammar)
                return template.deep_copy()
        m = _llguidance().LLMatcher(self.llt, grammar, log_level=0, limits=self.limits)
        if m.is_error():
            raise CflowError(f"{what}: {_message(m.get_error())}")
        with _lock:
            self.grammars[grammar] = m
            while len(self.grammars) > _KEPT_GRAMMARS:
                self.grammars.popitem(last=False)
            return m.deep_copy()


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

    def __init__(self, engine: _Engine, matcher, stop_ids=None):
        self._m, self._eos, self.n = matcher, engine.eos, engine.n
        stops = engine.stops if stop_ids is None else frozenset(int(i) for i in stop_ids) | {engine.eos}
        self._stops = np.array(sorted(i for i in stops if 0 <= i < self.n), dtype=np.int64)
        self._stop_set = frozenset(self._stops.tolist())
        self._bits = np.zeros((self.n + 31) // 32, dtype=np.int32)
        self._bits_at = (self._bits.ctypes.data, self._bits.nbytes)
        # What is known of the current state, learnt right after the token that led to it (module docstring):
        # whether it is stopped, the tokens the grammar forces from here (the next one last; `_probed`: asked),
        # and its mask once computed.
        self._stopped = False
        self._forced: list[int] = []
        self._probed = False
        self._ok: np.ndarray | None = None
        # how often a drawn token led to a forced run (a running share): below RUN_PROBE the question is asked only
        # where a mask is computed anyway (`_skipped`: not asked after the last token)
        self._runs, self._skipped = 2 * RUN_PROBE, False
        self._learn(drawn=True)

    def allowed(self) -> np.ndarray:
        """The mask of the current state (kept for it: read it, do not change it)."""
        if self._ok is None:
            self._ok = self._mask()
        return self._ok

    def forced(self) -> int | None:
        """The next token if the grammar forces it, else None. Where the grammar forces the next bytes (a JSON
        key and its `": "`), the engine's mask allows exactly one token, the first of those bytes as its
        tokenizer writes them; one question after a token gives the whole run, so neither a mask nor a draw is
        needed for its tokens."""
        return self._forced[-1] if self._forced else None

    def try_accept(self, token: int) -> bool:
        token = int(token)
        if self._forced:
            ok = token == self._forced[-1]
        elif token in self._stop_set and self._stopped:
            return True  # the grammar is complete: end of text is what may follow
        elif self._ok is not None:  # the mask is known: a look-up
            ok = 0 <= token < self.n and bool(self._ok[token])
        else:  # ask the engine (cheaper than a mask)
            if token in self._stop_set:
                token = self._eos
            if self._m.try_consume_tokens([token]) != 1:
                return False
            if self._skipped:  # the state before was not asked about; its draw was taken: it forced nothing
                self._runs *= 1 - RUN_RATE
            self._learn(drawn=True)
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

    def _learn(self, drawn: bool) -> None:
        """After a token: is the grammar stopped, and does it force the next tokens? Asked after a drawn token
        while drawn tokens often lead to forced runs (a JSON value's end to the next key); a forced run ends
        where the grammar stops forcing, so the state after one seldom forces."""
        m = self._m
        self._ok, self._skipped = None, False
        self._stopped = m.is_stopped()
        if self._forced:
            self._probed = True  # the rest of a forced run
        elif drawn and not self._stopped and self._runs > RUN_PROBE:
            self._forced, self._probed = m.compute_ff_tokens()[::-1], True
            self._runs += RUN_RATE * (bool(self._forced) - self._runs)
        else:
            self._probed, self._skipped = False, drawn and not self._stopped

    def _consume(self, token: int) -> None:
        """Advance with a token known to be allowed."""
        drawn = not self._forced
        if not drawn:
            self._forced.pop()
        elif token in self._stop_set:
            token = self._eos
        if not self._m.consume_token(token):
            raise CflowError(f"grammar: {_message(self._m.get_error())}")
        self._learn(drawn)

    def _mask(self) -> np.ndarray:
        """The allowed tokens of the current state (stop tokens where end of text is allowed)."""
        m = self._m
        if not self._probed and not self._stopped:
            self._forced, self._probed = m.compute_ff_tokens()[::-1], True
            if self._skipped:  # what the question after the last token would have found
                self._runs += RUN_RATE * (bool(self._forced) - self._runs)
                self._skipped = False
        if self._forced:  # the engine's mask is this token alone
            ok = np.zeros(self.n, bool)
            ok[self._forced[-1]] = True
            return ok
        m.unsafe_compute_mask_ptr(*self._bits_at)
        if m.is_error():  # a limit of the engine's (lexer or parser too complex for one step)
            raise CflowError(f"grammar: {_message(m.get_error())}")
        ok = np.unpackbits(self._bits.view(np.uint8), count=self.n, bitorder="little").view(bool)
        if ok[self._eos]:
            ok[self._stops] = True  # any of the sequence's stop tokens ends it where the grammar may end
        return ok


def _constraint(tokenizer, what: str, grammar: str, stop_ids) -> Constraint:
    engine = engine_tokenizer(tokenizer)
    return Constraint(engine, engine.matcher(what, grammar), stop_ids)


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
