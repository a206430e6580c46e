"""GraphMeta: what a Graph knows about its model besides the nodes (every field documented here).

The config always describes the DAG as it stands: delay passes evolve it together with the edges,
so `delays` and `routing` are read from it, never stored twice. `trained_*` record what the weights
were trained with, so a rewrite can warn that it changes the function.
"""

from __future__ import annotations

import attrs

from ..layout.quant import DType
from .config import ModelConfig


@attrs.define(kw_only=True)
class GraphMeta:
    config: ModelConfig  # hyper-parameters of the DAG (delays and routing point included)
    trained_delays: tuple[int, int]  # (dd, de) the weights were trained with
    trained_routing: str  # 'post' | 'pre' the weights were trained with
    shapes: dict[str, tuple[int, ...]] = attrs.Factory(dict)  # IR weight name -> shape ([out, in] or [d])
    quant: DType | None = None  # requested weight type once quantize_weights ran
    weight_dtypes: dict[str, DType] = attrs.Factory(dict)  # IR weight name -> storage type (quantize_weights)
    stored: bool = False  # quantize_weights kept every weight at its source's type (quant "stored")
    # IR weight name -> the type the source stores it in (a GGUF's tensor types), what quant "stored" keeps
    source_dtypes: dict[str, DType] | None = None
    source_notes: dict[str, str] | None = None  # IR weight name -> where its source tensor is and its type (errors)
    passes: tuple[str, ...] = ()  # names of the passes that produced this graph, in order
    tokenizer: str | None = None  # tokenizer.json text the frontend found (directories, GGUF), else None
    # The chat template the frontend found (tokenizer_config.json / chat_template.jinja, GGUF metadata), else None:
    # {"template": Jinja text, "bos_token": its bos text or None, "eos_token": its eos text or None}; stored in the
    # compiled file's header and rendered by runtime/chat.py.
    chat_template: dict | None = None
    eos_token_ids: list[int] = attrs.Factory(list)  # end-of-sequence ids the frontend found
    # BOS/EOS the model's prompts carry ({"bos", "eos", "add_bos", "add_eos", "source"}: runtime/tokenizer.py), as the
    # frontend read them (GGUF add_bos_token, tokenizer_config.json, the tokenizer.json post-processor), else None
    special_tokens: dict | None = None
    source: str | None = None  # where the model came from, e.g. 'transformers:LlamaForCausalLM'
    # a per-tensor type mix (passes/mix.py): {"bpw", "budget", "imatrix", "tensors": {name: {"type", "error"}}}
    quant_mix: dict | None = None

    @property
    def delays(self) -> tuple[int, int]:
        """(dd, de) the DAG implements."""
        return (self.config.dense_delay, self.config.expert_delay)

    @property
    def routing(self) -> str:
        return self.config.routing

    def copy(self) -> GraphMeta:
        return attrs.evolve(self)


def special_tokens(bos=None, eos=None, add_bos: bool = False, add_eos: bool = False, source: str = "") -> dict:
    """A GraphMeta.special_tokens value (the file header's special_tokens entry): the BOS / EOS ids, whether
    runtime.tokenizer.Tokenizer.encode(add_special=True) adds them, and where that rule came from."""
    return {"bos": None if bos is None else int(bos), "eos": None if eos is None else int(eos),
            "add_bos": bool(add_bos and bos is not None), "add_eos": bool(add_eos and eos is not None),
            "source": source}
