"""The options of a load (Session, cflow.load): each bad value is one CflowError naming it, raised before the
file is read where the file is not needed; and the KV cache type `kv` names."""

from __future__ import annotations

from ..codegen.abi import KV_BYTES
from ..errors import CflowError
from ..ir.config import ModelConfig
from ..layout import STORED
from ..layout.quant import ACT_FORMATS, QUANT_TARGETS
from .requests import whole

MAX_THREADS = 1024  # worker threads of one model
MAX_BATCH = 4096  # sequences decoded together (each its own KV cache)
# kv="auto": the KV cache's element type for each weight type. Measured equal in quality where f16 (the bundled
# model's perplexity, benchmarks/long_context.py --text: Q8 weights 8.3391 with an f32 cache vs 8.3397 with f16,
# Q4 8.5117 vs 8.5100; docs/journal/performance.md, "Long contexts"); f16 / f32 weights keep the exact f32 cache (not
# measured, and there the cache's rounding would be the largest error left).
KV_AUTO = {dt.label: "f16" if dt.quantised else "f32" for dt in QUANT_TARGETS} | {STORED: "f16"}  # stored: GGUF types


def resolve_kv(kv: str, quant: str) -> str:
    """The KV cache type that load(kv=...) / Session(kv=...) / --kv mean for weights of type `quant`: 'auto' is
    KV_AUTO[quant], 'f32' / 'f16' / 'bf16' (abi.KV_BYTES) are taken as given; anything else is a CflowError."""
    if kv == "auto":
        return KV_AUTO.get(quant, "f32")
    if kv not in KV_BYTES:
        raise CflowError(f"the KV cache type must be auto or one of {', '.join(KV_BYTES)}, not {kv!r}")
    return kv


def check_options(threads, max_seq, experts: str, weights: str, expert_io: str, read_ahead, kv: str,
                  activations: str = "q8") -> None:
    """The checks that need no file."""
    if activations not in ACT_FORMATS:
        raise CflowError(f"activations must be one of {', '.join(ACT_FORMATS)}, not {activations!r}")
    if experts not in ("ram", "disk"):
        raise CflowError(f"experts must be 'ram' or 'disk', not {experts!r}")
    if weights not in ("ram", "disk"):
        raise CflowError(f"weights must be 'ram' or 'disk', not {weights!r}")
    if expert_io not in ("async", "sync"):
        raise CflowError(f"expert_io must be 'async' or 'sync', not {expert_io!r}")
    resolve_kv(kv, "f32")  # a bad type fails before the file is read
    if not isinstance(read_ahead, int) or read_ahead < 0:
        raise CflowError(f"read-ahead must be a whole number of stages >= 0, not {read_ahead!r}")
    if threads is not None and (not whole(threads) or not 1 <= threads <= MAX_THREADS):
        raise CflowError(f"threads must be a whole number in 1..{MAX_THREADS}, not {threads!r}")
    if max_seq is not None and (not whole(max_seq) or max_seq < 1):
        raise CflowError(f"max_seq must be a whole number of tokens >= 1, not {max_seq!r}")


def context_length(max_seq: int | None, config: ModelConfig) -> int:
    """The positions each sequence may hold: `max_seq`, at most the model's context (by default all of it)."""
    if max_seq is not None and max_seq > config.max_seq_len:
        raise CflowError(f"max_seq {max_seq} exceeds the model's context of {config.max_seq_len} tokens "
                         "(config.max_seq_len)")
    return int(max_seq or config.max_seq_len)


def tokens_per_call(prefill_block, max_batch, max_seq: int, segmented: bool) -> int:
    """Prompt tokens per multi-token call (the step's tmax); a batch needs a row per sequence. The disk tiers
    (`segmented`) read prompts token by token (their host logic follows one token's routes), as does a block
    of 1."""
    if not isinstance(prefill_block, int) or prefill_block < 1:
        raise CflowError(f"prefill block must be a whole number of tokens >= 1, not {prefill_block!r}")
    tmax = 1 if segmented else min(prefill_block, max_seq)
    if not whole(max_batch) or not 1 <= max_batch <= MAX_BATCH:
        raise CflowError(f"max_batch must be a whole number of sequences in 1..{MAX_BATCH}, not {max_batch!r}")
    if max_batch > 1 and segmented:
        raise CflowError("batched decode (max_batch > 1) is not available with experts or weights on disk")
    return max(tmax, max_batch) if max_batch > 1 else tmax
