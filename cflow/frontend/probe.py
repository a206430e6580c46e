"""An import that proves itself: a model matched by structure is accepted only if its own forward agrees with the IR.

Stage: frontend (hf.py calls it for every transformers module and model directory it imports). Modules that share
Llama's parts can differ in what their forward does with them (a RoPE layout, a scaling, a norm): matching the
module tree cannot see that, and at default init (weights of std 0.02, nearly flat logits) a wrong function hides
under any tolerance. So a small model of the same class and config (fewer layers, one of each layer type; smaller
widths where the config allows), with weights ~ N(0, 1/fan_in) and embeddings ~ N(0, 1) so every activation is of
order 1 (attention scores too: softmax is far from uniform), goes through the same import, and its own forward
(output_hidden_states) is compared with the NumPy interpreter layer by layer, for a prompt and for decode steps
after it. A difference past float32 rounding is one UnsupportedModelError naming the class and the first layer
whose output differs: refused rather than miscomputed. Results are cached per class and config.
"""

from __future__ import annotations

import copy

import numpy as np

from ..errors import UnsupportedModelError
from ..ir import names

TOL = 2e-4  # relative to the layer output's spread: float32 rounding of two summation orders is ~1e-6
PROMPT, STEPS = 9, 3


def _shrunk(cfg):
    """A copy of `cfg` for the probe: one layer of each layer type (at least 2), a small vocabulary, and small
    widths where the config has the usual fields (None if it cannot be shrunk: the caller keeps the widths)."""
    c = copy.deepcopy(cfg)
    types = getattr(c, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        keep = list(dict.fromkeys(types))
        keep = keep + [keep[-1]] * (2 - len(keep)) if len(keep) < 2 else keep
        c.layer_types = keep
        c.num_hidden_layers = len(keep)
    else:
        c.num_hidden_layers = min(int(c.num_hidden_layers), 2)
    for attr in ("mlp_only_layers",):
        if getattr(c, attr, None):
            setattr(c, attr, [i for i in getattr(c, attr) if i < c.num_hidden_layers] or [c.num_hidden_layers - 1])
    vocab = min(int(c.vocab_size), 512)
    c.vocab_size = vocab
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        v = getattr(c, attr, None)
        if isinstance(v, int) and v >= vocab:
            setattr(c, attr, vocab - 1)
        elif isinstance(v, list):
            setattr(c, attr, [x if x < vocab else vocab - 1 for x in v])
    return c


def _narrowed(c):
    """Smaller widths on a shrunk config (heads keep their grouping; head_dim and RoPE dims are kept, since RoPE
    factor lists and scalings are sized by them)."""
    c = copy.deepcopy(c)
    heads, kv = int(c.num_attention_heads), int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
    group = heads // kv if kv and heads % kv == 0 else 1
    new_kv = min(kv, 2)
    c.num_attention_heads = new_kv * group if group * new_kv <= 8 else new_kv
    c.num_key_value_heads = new_kv if c.num_attention_heads % new_kv == 0 else c.num_attention_heads
    c.head_dim = head_dim
    c.hidden_size = max(64, min(int(c.hidden_size), 128))
    for attr, small in (("intermediate_size", 192), ("moe_intermediate_size", 64),
                        ("shared_expert_intermediate_size", 96)):
        if getattr(c, attr, None):
            setattr(c, attr, min(int(getattr(c, attr)), small))
    for attr, small in (("num_experts", 4), ("num_local_experts", 4), ("n_routed_experts", 4)):
        if getattr(c, attr, None):
            setattr(c, attr, min(int(getattr(c, attr)), small))
    if getattr(c, "num_experts_per_tok", None):
        c.num_experts_per_tok = min(int(c.num_experts_per_tok), 2)
    return c


def _randomize(model, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model.eval()


def _build(cls, cfg):
    """An instance of `cls` for `cfg` (narrowed if that constructs), random O(1) weights; None if neither does."""
    for c in (_narrowed(cfg), cfg):
        try:
            return _randomize(cls(c))
        except Exception:  # noqa: BLE001 -- a config this family cannot take narrowed: try the next
            continue
    return None


def _stream_after(g, layer: int) -> str:
    """The IR value holding the residual stream after `layer` (1-based)."""
    for name in (names.x(layer), names.b(layer), names.a(layer)):
        if name in g:
            return name
    raise KeyError(layer)


def compare(module, graph, where: str) -> None:
    """The module's forward against the interpreter on `graph` (module docstring): raise on the first layer that
    differs, for a prompt and for decode steps after it."""
    import torch

    from ..ir import Interpreter

    L = graph.config.n_layers
    ids = np.random.default_rng(0).integers(0, graph.config.vocab_size, PROMPT + STEPS)
    with torch.no_grad():
        out = module(input_ids=torch.as_tensor(ids)[None], output_hidden_states=True)
    hidden = [h[0].float().numpy() for h in out.hidden_states]
    logits = out.logits[0].float().numpy()
    it = Interpreter(graph)
    ref = it.prefill(ids)
    vals = it.values
    checks = [(names.EMBED, hidden[0], "the embedding")]
    checks += [(_stream_after(graph, l), hidden[l], f"layer {l}") for l in range(1, min(L, len(hidden) - 1))]
    for name, want, what in checks:
        got = vals[name]
        err = float(np.abs(got - want).max() / max(float(want.std()), 1e-6))
        if not err <= TOL:
            raise UnsupportedModelError(
                f"{where}: the import does not reproduce the module's own forward: {what}'s output differs by "
                f"{err:.2g} of its spread on a probe with activations of order 1 (a family matched by its parts but "
                "computing something else: refused rather than miscomputed)")
    err = float(np.abs(ref - logits).max() / max(float(logits.std()), 1e-6))
    if not err <= TOL:
        raise UnsupportedModelError(f"{where}: the import does not reproduce the module's own forward: the logits "
                                    f"differ by {err:.2g} of their spread on a probe (refused rather than miscomputed)")
    it.reset()
    step = np.concatenate([it.prefill(ids[:PROMPT])[-1:]] + [it.step(int(t))[None] for t in ids[PROMPT:]])
    err = float(np.abs(step - logits[PROMPT - 1 :]).max() / max(float(logits.std()), 1e-6))
    if not err <= TOL:
        raise UnsupportedModelError(f"{where}: the import does not reproduce the module's own forward in decode (one "
                                    f"token at a time after a prompt): the logits differ by {err:.2g} of their spread")


def probe_context(config) -> int | None:
    """The context the probe's import is compiled for: a RoPE whose tables depend on the compiled context (longrope
    and dynamic past their original context: cflow picks once, statically, where transformers picks per call by
    the sequence's length) is probed in the regime a short sequence gets from transformers, the original context;
    the other regime's frequencies are checked against the module's buffers (hf._check_rotary) and by the longrope
    tests. None: the import's own default."""
    from ..ir.rope import scaling_dict

    sd = scaling_dict(config.rope_scaling) or {}
    orig = sd.get("original_max_position_embeddings")
    if sd.get("rope_type") in ("longrope", "dynamic") and orig and orig >= PROMPT + STEPS:
        return max(min(int(orig), config.max_seq_len), PROMPT + STEPS)
    return None


def _key(cls, cfg) -> str:
    try:
        text = cfg.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 -- a config that does not serialise: no caching
        text = repr(id(cfg))
    return f"{cls.__module__}.{cls.__qualname__}:{text}"


_PASSED: set[str] = set()


def probe_module_class(cls, cfg, importer, where: str) -> None:
    """Build a probe of `cls` for `cfg` (shrunk), import it with `importer(module) -> Graph`, compare (raises)."""
    key = _key(cls, cfg)
    if key in _PASSED:
        return
    probe = _build(cls, _shrunk(cfg))
    if probe is None:
        raise UnsupportedModelError(f"{where}: a probe model of this class could not be built from its config, so the "
                                    "import cannot be checked against its forward")
    compare(probe, importer(probe), where)
    _PASSED.add(key)
