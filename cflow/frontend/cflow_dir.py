"""cflow checkpoint directory -> Graph whose weights are read lazily from model.safetensors (no torch model built).

State-dict names map onto IR names (stacked experts [E, out, in] become one lazily sliced weight per
expert), so compiling streams one tensor at a time. tokenizer.json beside config.json goes to
graph.meta.tokenizer, eos ids to graph.meta.eos_token_ids.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import CflowError
from ..ir import Graph, build_graph, verify
from ..models.checkpoint import WEIGHTS, read_config
from .tensors import LazyWeights, SafetensorsDir


def checkpoint_plan(src: SafetensorsDir) -> tuple[dict, dict]:
    """(IR weight name -> loader, IR weight name -> shape) for PipelineNativeLM state-dict names."""
    plan, shapes = {}, {}
    for k in sorted(src.keys()):
        shape = src.shape(k)
        name = k.removesuffix(".weight")
        if ".attn.w" in name and k.endswith(".bias"):  # blocks.i.attn.wq.bias -> blocks.i.attn.bq
            name = k.replace(".attn.w", ".attn.b").replace(".bias", "")
        if ".moe.w_" in name and len(shape) == 3:  # stacked experts [E, out, in]
            prefix, wname = name.rsplit(".", 1)
            for e in range(shape[0]):
                plan[f"{prefix}.experts.{e}.{wname}"] = partial(src.load, k, e)
                shapes[f"{prefix}.experts.{e}.{wname}"] = tuple(shape[1:])
            continue
        plan[name], shapes[name] = partial(src.load, k), tuple(shape)
    return plan, shapes


def from_checkpoint(path) -> Graph:
    path = Path(path)
    config = read_config(path)
    if not (path / WEIGHTS).is_file():
        raise CflowError(f"{path}: no {WEIGHTS}")
    plan, shapes = checkpoint_plan(SafetensorsDir(path))
    g = build_graph(config, None, name=config.name)
    for name, shape in g.meta.shapes.items():  # headers only: nothing read yet
        if name not in shapes:
            raise CflowError(f"{path}: weight {name!r} missing from {WEIGHTS}")
        if shapes[name] != tuple(shape):
            raise CflowError(f"{path}: weight {name!r} has shape {shapes[name]}, config says {tuple(shape)}")
    extra = sorted(set(shapes) - set(g.meta.shapes) - {"lm_head"})
    if extra:
        raise CflowError(f"{path}: {WEIGHTS} has tensor {extra[0]!r} that config.json does not describe")
    g.weights = LazyWeights(plan)
    from .hf_weights import eos_token_ids, read_special_tokens, read_tokenizer

    g.meta.tokenizer = read_tokenizer(path)
    g.meta.eos_token_ids = eos_token_ids(path)
    g.meta.special_tokens = read_special_tokens(path, g.meta.tokenizer)
    return verify(g)
