"""ONNX export of our models and of Hugging Face causal LMs: the full-sequence forward, no KV cache.

The recipe (torch 2.13 + transformers 5.x): `torch.onnx.export(..., dynamo=True)` (needs onnxscript)
with input `input_ids [1, T]` (T dynamic) and output `logits [1, T, V]`. Hugging Face MoE models
first get `model.set_experts_implementation("batched_mm")` (the default grouped-mm path has no ONNX
function), which exports as Softmax -> TopK -> (Div) -> GatherND over the 3-D expert weights -> MatMul.
PipelineNativeLM's MoE dispatches tokens with nonzero/index_add_ (data-dependent shapes); for export
it computes the same function densely: softmax -> top-k -> weights scattered into [T, E] -> every
expert applied -> weighted sum. from_onnx recognises both forms.
"""

from __future__ import annotations

import contextlib
import io
import types
import warnings
from pathlib import Path

from ..errors import CflowError
from ..util import atomic_path

EXTERNAL_DATA_BYTES = 1 << 30  # weights above 1 GiB go to a .data file beside the .onnx (protobuf caps at 2 GiB)
META_PREFIX = "cflow."  # metadata_props we write: name and context only (hints, never structure)
STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"  # torch.onnx: where in Python each node came from (dropped)


def _dense_moe_forward(self, h):
    """MoE.forward with every expert computed and non-selected ones weighted 0 (same function, static shapes)."""
    import torch
    import torch.nn.functional as F

    shape = h.shape
    x = h.reshape(-1, shape[-1])
    w, idx = self.route(x)
    dense = torch.zeros(x.shape[0], self.c.n_experts, dtype=w.dtype).scatter(1, idx, w)  # [T, E]
    xe = x.unsqueeze(0)  # [1, T, d] against [E, d, i]
    act = F.silu(torch.matmul(xe, self.w_gate.transpose(1, 2))) * torch.matmul(xe, self.w_up.transpose(1, 2))
    y = torch.matmul(act, self.w_down.transpose(1, 2))  # [E, T, d]
    out = (y * dense.t().unsqueeze(-1)).sum(0)
    return self.add_shared(x, out).reshape(shape)


@contextlib.contextmanager
def export_friendly(model):
    """Temporarily give a model an exportable forward (dense MoE / batched_mm experts); restores it after."""
    from ..models.reference import MoE, PipelineNativeLM

    undo = []
    try:
        if isinstance(model, PipelineNativeLM):
            for m in model.modules():
                if isinstance(m, MoE):
                    m.forward = types.MethodType(_dense_moe_forward, m)
                    undo.append(lambda m=m: m.__dict__.pop("forward", None))
        elif (hasattr(model, "set_experts_implementation")
              and getattr(model.config, "_experts_implementation", None) is not None):
            before = model.config._experts_implementation
            if any(hasattr(m, "gate_up_proj") for m in model.modules()):
                model.set_experts_implementation("batched_mm")
                undo.append(lambda: model.set_experts_implementation(before))
        yield model
    finally:
        for u in reversed(undo):
            u()


def _logits_module(model):
    """nn.Module wrapper: input_ids [1, T] -> logits [1, T, V] (no cache, no extra outputs)."""
    import torch

    from ..models.reference import PipelineNativeLM

    class LogitsOnly(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            if isinstance(self.m, PipelineNativeLM):
                return self.m(input_ids)
            return self.m(input_ids=input_ids, use_cache=False).logits

    return LogitsOnly(model).eval()


@contextlib.contextmanager
def _quiet_torch_logs():
    """The exporter logs progress and missing-torchvision notes; a compiler stays quiet."""
    import logging

    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _context(model) -> int:
    """The context the export declares (T's upper bound, recorded as cflow.max_seq_len)."""
    from .hf import MAX_CONTEXT

    c = getattr(model, "config", None)
    v = getattr(c, "max_seq_len", None) or getattr(c, "max_position_embeddings", None) or MAX_CONTEXT
    return int(min(int(v), MAX_CONTEXT))


def export_onnx(model, path, *, name: str | None = None, seq_len: int = 8, external_data: bool | None = None,
                opset: int | None = None) -> Path:
    """Export `model` (PipelineNativeLM or a transformers *ForCausalLM) to `path` as ONNX.

    External data (`path` + '.data') is used when the weights exceed 1 GiB or if asked. The file is
    written atomically: on failure nothing is left at `path`. Returns the path.
    """
    import torch

    path = Path(path)
    model = model.eval()
    ctx = _context(model)
    vocab = int(getattr(model.config, "vocab_size", 2))
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if external_data is None:
        external_data = n_bytes > EXTERNAL_DATA_BYTES
    T = max(2, min(seq_len, ctx))
    ids = torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(0))
    dyn = {"input_ids": {1: torch.export.Dim("T", min=1, max=ctx)}}
    kw = {} if opset is None else {"opset_version": opset}
    with export_friendly(model), torch.no_grad(), warnings.catch_warnings(), _quiet_torch_logs(), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            prog = torch.onnx.export(_logits_module(model), (ids,), dynamo=True, input_names=["input_ids"],
                                     output_names=["logits"], dynamic_shapes=dyn, verbose=False, **kw)
        except Exception as e:
            raise CflowError(f"ONNX export of {type(model).__name__} failed: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from e
    meta = {f"{META_PREFIX}name": name or getattr(model.config, "name", None) or path.stem,
            f"{META_PREFIX}max_seq_len": str(ctx)}
    for k, v in meta.items():
        prog.model.metadata_props[k] = str(v)
    _strip_stack_traces(prog.model)
    path.parent.mkdir(parents=True, exist_ok=True)
    # atomic_path keeps the file name, so the external data ("NAME.data", which the model refers to by
    # name) is written beside it and published with it, before the model itself.
    with atomic_path(path) as tmp, contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog.save(str(tmp), external_data=external_data)
    return path


def _strip_stack_traces(model) -> None:
    """Drop the exporter's per-node Python stack traces: they name the source files' absolute paths (1,087 times
    in a tiny preset's export), so the same model exported from two checkouts would give different bytes. The
    export is then a function of the model alone (and smaller); nothing reads them."""
    graphs = [model.graph, *model.functions.values()]
    for g in graphs:
        for node in g.all_nodes():
            node.metadata_props.pop(STACK_TRACE_KEY, None)


def load_torch_model(spec, seed: int = 0):
    """What `cflow export-onnx MODEL` exports: preset:NAME[@SIZE] (random weights) or a checkpoint directory."""
    from ..models import from_preset, parse_preset_spec
    from .load import is_preset_spec

    if is_preset_spec(spec):
        name, size = parse_preset_spec(spec)
        return from_preset(name, size, seed=seed)
    p = Path(spec)
    if not p.exists():
        raise CflowError(f"{p}: no such file or directory (expected preset:NAME[@SIZE] or a checkpoint directory)")
    from ..models.checkpoint import is_checkpoint_dir, load_checkpoint

    if is_checkpoint_dir(p):
        return load_checkpoint(p)
    raise CflowError(f"{p}: not a cflow checkpoint directory (config.json with \"format\": \"cflow\")")
