"""Public Python API: cflow.compile(model) and cflow.load(path) -> CompiledModel.

    m = cflow.compile(model)                 # nn.Module, ONNX, checkpoint/HF dir, "preset:NAME@SIZE"
    m = cflow.load("model.vflow", threads=2)
    m.generate("Once upon a time", max_new_tokens=64)    # text in -> continuation text out
    m.generate([1, 2, 3], max_new_tokens=16)             # ids in -> new ids out
    m.chat([{"role": "user", "content": "Hi"}])          # the model's chat template; the KV cache is reused
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .chatting import ChatMethods
from .errors import CflowError, RuntimeFault
from .layout.tile import DEFAULT_TILE
from .runtime.choice import check_sampler, sampler_for
from .runtime.requests import check_draft, check_fits, check_sampling, check_speculate, prompt_ids


def compile(model, delays: tuple[int, int] | None = None, quant: str | None = None, tokenizer: str | None = None,
            threads: int | None = None, tile=None, layout: str = "vflow", activations: str = "q8") -> CompiledModel:
    """Compile a model to tile-native weights and a JIT-compiled decode step.

    Args:
        model: a torch.nn.Module (cflow or Hugging Face), an ONNX path or ModelProto, a checkpoint or
            Hugging Face model directory, or "preset:NAME[@SIZE]".
        delays: None keeps the model's own delays; (dd, de) rewrites the DAG (and warns: this changes
            the function unless the model was trained that way).
        quant: q4 | q8 | f16 | f32 | stored (a GGUF's own types, tensor by tensor) | auto (each matrix's type
            chosen within 4.5 bits per weight, as `cflowc --quant auto`: docs/quantization.md). Default: stored
            for a GGUF, q4 otherwise (cflowc, unlike this, gives a float model file auto).
        tile: (rows, cols); default (128, 256), or for a GGUF kept as stored columns that divide every matrix
            width (nothing padded).
        tokenizer: path to a tokenizer.json (directories bring their own).
        activations: the quantised activations of the loaded model (load's).
    """
    from .compiler import compile_file
    from .frontend.load import load_graph
    from .layout.packed import FileLayout

    layout = FileLayout.parse(layout)
    from .layout.tile import tile_problem

    if tile is not None:
        try:
            tr, tc = (int(t) for t in tile)
        except (TypeError, ValueError):
            raise CflowError(f"tile must be (rows, cols), not {tile!r}") from None
        problem = tile_problem((tr, tc))  # what the loader would refuse, refused before compiling
        if problem:
            raise CflowError(f"tile {problem}")
    g = load_graph(model)
    from .passes.quantize import STORED, default_quant, fit_tile

    quant = default_quant(g) if quant is None else quant
    if quant == "auto":
        from .passes.mix import auto_mix

        g, quant = auto_mix(g)[0], STORED
    tile = (fit_tile(g) if quant == STORED else DEFAULT_TILE) if tile is None else tile
    tok = g.meta.tokenizer
    if tokenizer is not None:
        from .runtime.tokenizer import read_tokenizer_file

        tok = read_tokenizer_file(tokenizer)
        from .frontend.hf_weights import read_special_tokens

        g.meta.special_tokens = read_special_tokens(os.path.dirname(os.path.abspath(tokenizer)), tok)
    tmp = tempfile.mkdtemp(prefix="cflow-")
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", g.name).strip("._")[:64] or "model"  # a model name is not a path
    path = os.path.join(tmp, f"{safe}.{layout}")
    try:
        compile_file(g, path, quant, tile, delays, layout, tok, g.meta.eos_token_ids)
        m = load(path, threads=threads, activations=activations)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weakref.finalize(m, shutil.rmtree, tmp, True)
    return m


def load(path, threads: int | None = None, verify: bool = False, max_seq: int | None = None,
         experts: str = "ram", expert_cache_mb: float | None = None, expert_io: str = "async",
         weights: str = "ram", read_ahead: int = 2, prefill_block: int = 64, max_batch: int = 1,
         kv: str = "auto", draft=None, activations: str = "q8", max_ram_mb: float | None = None,
         expert_guess: bool = True, detached: bool = False) -> CompiledModel:
    """Map a .vflow/.cflow file, validate it, JIT the step (cached on disk) and get ready to decode.

    Args:
        threads: worker threads. Default: the cores this process may run on (os.sched_getaffinity), backing off
            to one thread while another process keeps a worker off its core (docs/journal/performance.md, "Under
            load"); a number is taken as asked, and one above the usable cores warns (OversubscribedWarning).
        experts: 'ram' (every weight mapped from the file) or 'disk': non-expert weights read into RAM,
            experts read on demand with O_DIRECT into a cache of `expert_cache_mb` MiB (default: a
            quarter of the experts, at least what one expert-delay window needs).
        expert_io: 'async' (reads start when the router has chosen, awaited where the experts are used)
            or 'sync' (read when needed, blocking: the baseline the overlap is measured against).
        expert_guess: with async expert reads, also start the next routed layer's reads when a layer routes, on
            a guess of its route from this layer's router input (runtime/route_guess.py); the real router still
            decides, so a wrong guess costs a read, never a token.
        weights: 'disk' streams the big non-expert matrices from the file every token, stage by stage,
            `read_ahead` stages ahead (a model larger than RAM still decodes; experts go to disk too).
        prefill_block: prompt tokens per native call (each weight tile read once per block); 1 = token by token.
        max_batch: sequences (KV-cache slots) that batch_step advances together in one pass over the weights.
        kv: the KV cache's element type: 'f32', 'f16' (half the cache's memory and the bytes attention reads
            per token at long contexts; K and V rounded to half once, when written: docs/journal/performance.md),
            'bf16' (as many bytes, f32's range; attention's q.k and weighted sum as bf16 dot products), or
            'auto' (default): f16 for Q4 / Q8 weights, where it measured equal in perplexity, f32 for f16 / f32
            weights (runtime.session.resolve_kv). `CompiledModel.kv` is the type in use.
        max_ram_mb: memory for the whole process, in MiB: the weights stay mapped if they fit with everything
            else, else the experts go to disk with a cache of what the budget leaves once the step is built
            (measured from the resident set), else the big matrices are streamed too; starts from the
            placement `experts` / `weights` ask for. Not with `expert_cache_mb`.
        draft: a smaller compiled model of the same vocabulary (a path, or a loaded CompiledModel) that drafts
            tokens for `speculate="draft"` (runtime/speculate.py); loaded with the same threads.
        activations: how the activation entering a quantised matrix is rounded: 'q8' (default: int8 blocks of 32,
            llama.cpp's Q8_0 pairing) or 'q8x2' (two int8 planes on one scale, about 15 bits, for the 32-input block
            types Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL; the K-quants and IQ4_XS keep int8): closer to the
            weights' exact function, at some cost in speed (docs/conformance.md). `session.activations` is it.
        detached: every thread of the step is a worker, the first too, so that `session.step_launch(token)`
            returns while the step runs and the caller works meanwhile (`cflow serve` does its host work between
            tokens so when the step's threads leave it a core: docs/serving.md); weights in RAM only.
    """
    from .runtime.session import Session

    p = Path(path)
    if not p.is_file():
        raise CflowError(f"{p}: no such file")
    m = CompiledModel(Session(str(p), threads=threads, verify=verify, max_seq=max_seq, experts=experts,
                              expert_cache_mb=expert_cache_mb, expert_io=expert_io, weights=weights,
                              read_ahead=read_ahead, prefill_block=prefill_block, max_batch=max_batch, kv=kv,
                              activations=activations, max_ram_mb=max_ram_mb, guess_routes=expert_guess,
                              detached=detached))
    if draft is not None:
        d = None
        try:
            d = draft if isinstance(draft, CompiledModel) else load(draft, threads=m.threads)
            m.set_draft(d)
            m._owns_draft = d is not draft
        except BaseException:
            if d is not None and d is not draft:
                d.close()
            m.close()
            raise
    return m


class CompiledModel(ChatMethods):
    """A loaded model: one generation at a time, safely.

    Calls from several threads are serialised (a call waits for the running generation to finish); a
    `stream()` holds the model from its first token until it is exhausted or closed. Starting a second
    generation in the thread whose stream is still open would corrupt that stream, so it is refused with a
    CflowError. For concurrent generations, load the file once per stream (the weights are mapped once).
    """

    def __init__(self, session):
        self.session = session
        self._busy = threading.Lock()  # held by the running generation
        self._busy_thread: int | None = None
        self._closed = False
        h = session.header
        self.config = session.config
        self.tokenizer = None
        if h.get("tokenizer"):
            from .runtime.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(h["tokenizer"], h.get("eos_token_ids") or (), h.get("special_tokens"))
        self.eos_ids = set(h.get("eos_token_ids") or ()) | (self.tokenizer.eos_ids if self.tokenizer else set())
        self._ir = None
        self._ctx: list[int] = []  # the tokens whose keys and values the session's KV cache holds, in order
        self.reused_tokens = 0  # prompt tokens the last generation found in the KV cache (a chat's earlier turns)
        self.draft: CompiledModel | None = None  # drafts for speculate="draft" (set_draft)
        self._owns_draft = False  # the draft was loaded by load(..., draft=PATH): closed with this model
        self.speculation = None  # the last speculative generation's Speculation: acceptance, passes
        self._drafting = None  # runtime.speculate.Drafting: what this model's speculative streams share

    # --- introspection ----------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.session.path

    @property
    def threads(self) -> int:
        return self.session.threads

    @property
    def kv(self) -> str:
        """The KV cache's element type in use, 'f32', 'f16' or 'bf16' (load's kv='auto' resolved by the weights'
        type)."""
        return self.session.kv_dtype

    @property
    def ir(self):
        """The quantised IR, its weights read lazily from the file (what the interpreter checks against)."""
        if self._ir is None:
            from .runtime.weights import FileWeights

            g = self.session.compiled.graph.copy()
            g.weights = FileWeights(self.session.reader, self.session.compiled.tensors)
            self._ir = g
        return self._ir

    @property
    def schedule(self):
        return self.session.compiled.schedule

    def analysis(self):
        from .passes.analysis import analyze

        return analyze(self.session.compiled.graph, self.session.header["quant"], self.session.tile)

    @property
    def expert_stats(self):
        """The disk expert tier's counters (hits, misses, hit_rate, bytes_read, ...), or None in RAM mode."""
        return self.session.tier.stats if self.session.tier is not None else None

    @property
    def bytes_per_token(self) -> int:
        return sum(s.nbytes for s in self.schedule.steps())

    def save(self, path) -> None:
        """Copy the compiled file to `path` (atomically)."""
        from .util import atomic_copy

        atomic_copy(self.path, path)

    # --- running ---------------------------------------------------------------------------
    def _ids(self, prompt) -> list[int]:
        return prompt_ids(prompt, self.tokenizer, self.config.vocab_size)

    def check_request(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int | None = None) -> list[int]:
        """The prompt's token ids, once every argument of a generation is checked (CflowError naming it): the
        sampling options, and that the prompt and `max_new_tokens` fit the context. Runs nothing."""
        check_sampling(max_new_tokens, temperature, top_k, top_p, seed)
        ids = self._ids(prompt)
        check_fits(len(ids), max_new_tokens, self.session.max_seq)
        return ids

    @contextlib.contextmanager
    def _generation(self):
        """Hold the model for one generation (see the class docstring)."""
        me = threading.get_ident()
        if not self._busy.acquire(blocking=False):
            if self._busy_thread == me:
                raise CflowError("this model is already generating in this thread (a stream() that is not "
                                 "exhausted or closed): finish or close() it first, or load the file once per stream")
            self._busy.acquire()  # another thread's generation: wait for it
        self._busy_thread = me
        try:
            if self._closed:
                raise CflowError(f"{self.path}: this model is closed")
            yield self.session
        finally:
            self._busy_thread = None
            self._busy.release()

    def logits(self, ids) -> np.ndarray:
        """Logits [vocab] after feeding `ids` from an empty context (for parity tests)."""
        ids = self._ids(ids)
        with self._generation() as s:
            return self._feed(s, ids, reuse=False)

    def _feed(self, s, ids: list[int], reuse: bool) -> np.ndarray:
        """Prefill `ids`; with reuse, the longest prefix the KV cache already holds (from the previous generation)
        is kept and only the rest is fed (a chat's new turn). At least one token is fed, for its logits."""
        common = 0
        if reuse:
            n = min(len(self._ctx), len(ids) - 1)
            while common < n and self._ctx[common] == ids[common]:
                common += 1
        self._ctx = []
        if common:
            s.pos = common  # positions from here on are overwritten as the new tokens are fed
        else:
            s.reset()
        logits = s.prefill(ids[common:])
        self._ctx = list(ids)
        self.reused_tokens = common
        return logits

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: bool = True,
               speculate: str | None = None, sampler=None) -> Iterator:
        """Yield new tokens as they come: text pieces for a text prompt with a tokenizer, else ids.

        speculate: None (plain decode), "ngram" (prompt lookup drafts) or "draft" (the draft model of
        load(..., draft=)): the same tokens greedily, the same distribution sampled, faster when drafts stand.
        sampler: a ready runtime.choice.Chooser (penalties, logit_bias, min_p, a constraint, logprobs) or Sampler
        for this one generation, used instead of temperature / top_k / top_p / seed (speculate: plain ones only).
        The arguments are checked here (check_request); the model is held from the first token on."""
        ids = self.check_request(prompt, max_new_tokens, temperature, top_k, top_p, seed)
        self._check_speculate(speculate, sampler)
        return self._stream(prompt, ids, max_new_tokens, temperature, top_k, top_p, seed, stop, speculate=speculate,
                            sampler=sampler)

    def set_draft(self, draft: CompiledModel) -> None:
        """Use `draft` (a loaded model with this model's vocabulary) for speculate="draft"."""
        check_draft(self.config.vocab_size, self.tokenizer, draft.config.vocab_size, draft.tokenizer, draft.path)
        if self._owns_draft and self.draft is not draft:
            self.draft.close()  # the one load(..., draft=PATH) opened; a draft given here is the caller's
        self.draft, self._owns_draft = draft, False

    def _check_speculate(self, speculate, sampler=None) -> None:
        check_speculate(speculate, self.session.tmax, self.draft)
        check_sampler(sampler, speculate)

    def _stream(self, prompt, ids, max_new_tokens, temperature, top_k, top_p, seed, stop, reuse: bool = False,
                stop_ids: frozenset = frozenset(), stop_text: tuple[str, ...] = (),
                speculate: str | None = None, sampler=None) -> Iterator:
        from .runtime import generation
        from .runtime.stop_text import StopText

        sampler = sampler_for(sampler, temperature, top_k, top_p, seed)
        text_mode = isinstance(prompt, str) and self.tokenizer is not None
        dec = None
        if text_mode:
            from .runtime.tokenizer import StreamDecoder

            dec = StreamDecoder(self.tokenizer, ids[-16:] if reuse else ids)  # a chat: the tail is context enough
        stops = self.eos_ids | stop_ids
        cut = StopText(stop_text) if text_mode and stop_text else None
        drafting = self.draft._generation() if speculate == "draft" else contextlib.nullcontext()
        with self._generation() as s, drafting:
            logits = self._feed(s, ids, reuse)

            def guard():
                if self._closed:
                    raise CflowError(f"{self.path}: the model was closed during this stream")

            def check(rows):
                top = float(np.max(rows))
                if not math.isfinite(top):  # NaN or +Inf: overflowing weights or activations (a crafted file)
                    raise RuntimeFault(f"{self.path}: the logits at position {s.pos} are not finite ({top}): the "
                                       "model's weights or activations overflow")

            if speculate is None:
                tokens = generation.plain(s, logits, sampler, max_new_tokens, guard, check)
            else:
                drafter = self._drafter(speculate, sampler, seed)
                tokens = generation.speculative(s, logits, sampler, drafter, self.speculation, list(ids),
                                                max_new_tokens, guard, check)
            out = list(ids)
            try:
                for tok in tokens:
                    if stop and tok in stops:
                        break
                    out.append(tok)
                    piece = dec.push(tok) if text_mode else tok
                    if cut is not None:
                        piece, hit = cut.push(piece)
                        if piece:
                            yield piece
                        if hit:
                            return
                        continue
                    yield piece
                if cut is not None and (rest := cut.flush()):
                    yield rest  # a tail held back for a stop string that never came: it was text
            finally:
                tokens.close()
                self._ctx = out[: s.pos]  # what the KV cache holds: the fed prefix of prompt and output

    def _drafter(self, speculate: str, sampler, seed):
        from .runtime import speculate as sp

        if self._drafting is None:
            self._drafting = sp.Drafting()
        drafter, self.speculation = self._drafting.start(speculate, sampler, seed, self.draft and self.draft.session)
        return drafter

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, stop: bool = True, speculate: str | None = None, sampler=None):
        """The continuation: a string for a text prompt (with a tokenizer), else a list of new token ids.
        speculate, sampler: see stream()."""
        out = list(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, speculate, sampler))
        if isinstance(prompt, str) and self.tokenizer is not None:
            return "".join(out)
        return out

    # --- several sequences at once (load(..., max_batch=B)) -------------------------------------
    def batch_start(self, prompt, slot: int) -> np.ndarray:
        """Empty KV-cache slot `slot` and feed it a prompt (ids or text); returns its last logits [vocab]."""
        ids = self._ids(prompt)
        with self._generation() as s:
            s.reset(slot)
            self._ctx = []  # slot 0's cache no longer holds the single-sequence API's context
            return s.prefill(ids, slot=slot)

    def batch_extend(self, prompt, slot: int) -> np.ndarray:
        """Feed more of a prompt (ids, or text encoded on its own) to slot `slot`, continuing its sequence at its
        current position; returns the logits [vocab] after its last token.

        A long prompt can so be read in pieces (batch_start with the first, batch_extend with the rest) between
        batch_steps of the other slots (chunked prefill: the server's engine does this). Pieces of
        `self.prefill_block` tokens (the last may be shorter) make exactly the native calls one batch_start of the
        whole prompt makes, so the KV cache and the logits are bit-identical. A slot that holds no sequence (never
        started, or released) is refused: extending it would continue from whatever its cache last held."""
        ids = self._ids(prompt)
        with self._generation() as s:
            s.check_open(slot, "batch_extend")
            self._ctx = []  # slot 0's cache no longer holds the single-sequence API's context
            return s.prefill(ids, slot=slot)

    @property
    def prefill_block(self) -> int:
        """Prompt tokens one native call reads: load's prefill_block, or max_batch if larger (batch_start and
        batch_extend split longer prompts into such calls)."""
        return int(self.session.tmax)

    def batch_release(self, slot: int) -> None:
        """Free slot `slot` once its sequence is finished: batch_step and batch_extend refuse it until batch_start
        gives it a new prompt (so a finished request's slot cannot be stepped by mistake)."""
        with self._generation() as s:
            if slot == 0:
                self._ctx = []
            s.release(slot)

    def batch_step(self, tokens, slots) -> np.ndarray:
        """Advance each slot by one token in one pass over the weights; logits [len(slots), vocab].

        Slots are independent (own positions and KV cache): any subset may step, a finished one may be
        restarted with batch_start while the others go on (continuous batching). Every slot must hold a
        sequence (batch_start, not released), have room in its context, and there may be at most max_batch."""
        with self._generation() as s:
            self._ctx = []
            return s.step_batch(tokens, slots)

    def generate_batch(self, prompts, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None, stop: bool = True) -> list:
        """generate() for several prompts decoded together (at most max_batch); a list of their outputs."""
        from .runtime.sampling import Sampler

        if not prompts or len(prompts) > self.session.n_slots:
            raise CflowError(f"generate_batch takes 1..{self.session.n_slots} prompts (max_batch), "
                             f"got {len(prompts)}")
        samplers = [Sampler(temperature, top_k, top_p, None if seed is None else seed + i)
                    for i in range(len(prompts))]
        new: list[list[int]] = [[] for _ in prompts]
        live, toks = [], []
        for i, p in enumerate(prompts):
            tok = samplers[i](self.batch_start(p, i))
            if not (stop and tok in self.eos_ids):
                new[i].append(tok)
                live.append(i)
                toks.append(tok)
        while live:
            room = self.session.slot_pos < self.session.max_seq
            live_now = [i for i in live if len(new[i]) < max_new_tokens and room[i]]
            if not live_now:
                break
            logits = self.batch_step([new[i][-1] for i in live_now], live_now)
            live = []
            for row, i in zip(logits, live_now):
                tok = samplers[i](row)
                if stop and tok in self.eos_ids:
                    continue
                new[i].append(tok)
                live.append(i)
        out = []
        for p, ids in zip(prompts, new):
            out.append(self.tokenizer.decode(ids) if isinstance(p, str) and self.tokenizer is not None else ids)
        return out

    def close(self) -> None:
        """Free the worker threads and buffers; waits for another thread's running generation. A stream still
        open in this thread fails cleanly on its next token."""
        if self._closed:
            return
        if self._owns_draft:
            self.draft.close()
        if self._busy_thread == threading.get_ident():
            self._closed = True
            self.session.close()
            return
        with self._busy:
            self._closed = True
            self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"<CompiledModel {self.session.header.get('name')} {c.n_layers}x{c.d_model} "
                f"{self.session.header['quant']} kv={self.kv} delays={tuple(self.session.header['delays'])} "
                f"threads={self.threads}>")
