"""Public Python API: cflow.compile(model) and cflow.load(path) -> CompiledModel.

    m = cflow.compile(model)                 # nn.Module, ONNX, checkpoint/HF dir, "preset:NAME@SIZE"
    m = cflow.load("model.vflow", threads=2)
    m.generate("Once upon a time", max_new_tokens=64)    # text in -> continuation text out
    m.generate([1, 2, 3], max_new_tokens=16)             # ids in -> new ids out
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import CflowError
from .layout.tile import DEFAULT_TILE


def compile(model, delays: tuple[int, int] | None = None, quant: str = "q4", tokenizer: str | None = None,
            threads: int | None = None, tile=DEFAULT_TILE, layout: str = "vflow") -> CompiledModel:
    """Compile a model to tile-native weights and a JIT-compiled decode step.

    Args:
        model: a torch.nn.Module (cflow or Hugging Face), an ONNX path or ModelProto, a checkpoint or
            Hugging Face model directory, or "preset:NAME[@SIZE]".
        delays: None keeps the model's own delays; (dd, de) rewrites the DAG (and warns: this changes
            the function unless the model was trained that way).
        quant: q4 | q8 | f16 | f32.
        tokenizer: path to a tokenizer.json (directories bring their own).
    """
    from .compiler import compile_file
    from .frontend.load import load_graph
    from .layout.packed import FileLayout

    layout = FileLayout.parse(layout)
    g = load_graph(model)
    tok = g.meta.tokenizer
    if tokenizer is not None:
        from .runtime.tokenizer import read_tokenizer_file

        tok = read_tokenizer_file(tokenizer)
    tmp = tempfile.mkdtemp(prefix="cflow-")
    path = os.path.join(tmp, f"{g.name}.{layout}")
    try:
        compile_file(g, path, quant, tile, delays, layout, tok, g.meta.eos_token_ids)
        m = load(path, threads=threads)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    weakref.finalize(m, shutil.rmtree, tmp, True)
    return m


def load(path, threads: int | None = None, verify: bool = False, max_seq: int | None = None,
         experts: str = "ram", expert_cache_mb: float | None = None, expert_io: str = "async",
         weights: str = "ram", read_ahead: int = 2) -> CompiledModel:
    """Map a .vflow/.cflow file, validate it, JIT the step (cached on disk) and get ready to decode.

    Args:
        experts: 'ram' (every weight mapped from the file) or 'disk': non-expert weights read into RAM,
            experts read on demand with O_DIRECT into a cache of `expert_cache_mb` MiB (default: a
            quarter of the experts, at least what one expert-delay window needs).
        expert_io: 'async' (reads start when the router has chosen, awaited where the experts are used)
            or 'sync' (read when needed, blocking: the baseline the overlap is measured against).
        weights: 'disk' streams the big non-expert matrices from the file every token, stage by stage,
            `read_ahead` stages ahead (a model larger than RAM still decodes; experts go to disk too).
    """
    from .runtime.session import Session

    p = Path(path)
    if not p.is_file():
        raise CflowError(f"{p}: no such file")
    return CompiledModel(Session(str(p), threads=threads, verify=verify, max_seq=max_seq, experts=experts,
                                 expert_cache_mb=expert_cache_mb, expert_io=expert_io, weights=weights,
                                 read_ahead=read_ahead))


class CompiledModel:
    """A loaded model. Not thread-safe: one generation at a time."""

    def __init__(self, session):
        self.session = session
        h = session.header
        self.config = session.config
        self.tokenizer = None
        if h.get("tokenizer"):
            from .runtime.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(h["tokenizer"], h.get("eos_token_ids") or ())
        self.eos_ids = set(h.get("eos_token_ids") or ()) | (self.tokenizer.eos_ids if self.tokenizer else set())
        self._ir = None

    # --- introspection ----------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.session.path

    @property
    def threads(self) -> int:
        return self.session.threads

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

        return analyze(self.session.compiled.graph, self.session.header["quant"])

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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                from .runtime.tokenizer import parse_id_prompt

                return parse_id_prompt(prompt, self.config.vocab_size)
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise CflowError("the prompt encodes to no tokens")
            return ids
        ids = [int(i) for i in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise CflowError("empty prompt")
        return ids

    def logits(self, ids) -> np.ndarray:
        """Logits [vocab] after feeding `ids` from an empty context (for parity tests)."""
        self.session.reset()
        return self.session.prefill(self._ids(ids))

    def stream(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: bool = True) -> Iterator:
        """Yield new tokens as they come: text pieces for a text prompt with a tokenizer, else ids."""
        from .runtime.sampling import Sampler

        sampler = Sampler(temperature, top_k, top_p, seed)
        ids = self._ids(prompt)
        text_mode = isinstance(prompt, str) and self.tokenizer is not None
        dec = None
        if text_mode:
            from .runtime.tokenizer import StreamDecoder

            dec = StreamDecoder(self.tokenizer, ids)
        s = self.session
        s.reset()
        logits = s.prefill(ids)
        for i in range(max_new_tokens):
            tok = sampler(logits)
            if stop and tok in self.eos_ids:
                return
            yield dec.push(tok) if text_mode else tok
            if i + 1 == max_new_tokens or s.pos >= s.max_seq:
                return
            logits = s.step(tok)

    def generate(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: bool = True):
        """The continuation: a string for a text prompt (with a tokenizer), else a list of new token ids."""
        out = list(self.stream(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop))
        if isinstance(prompt, str) and self.tokenizer is not None:
            return "".join(out)
        return out

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"<CompiledModel {self.session.header.get('name')} {c.n_layers}x{c.d_model} "
                f"{self.session.header['quant']} delays={tuple(self.session.header['delays'])} threads={self.threads}>")
