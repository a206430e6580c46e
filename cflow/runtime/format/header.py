"""The header's schema: what a .vflow/.cflow header must hold before anything is built from it.

A file is untrusted input: its checksums only catch accidents (anyone can recompute them), so every field
is type-checked and bounded here, and the plan the config asks for is bounded by what the file actually
holds, before the IR is built, lowered or JIT-compiled (docs/reliability.md).

    check_header(reader) -> ModelConfig     every field: kinds, ranges, the plan's size against the file
    check_plan(reader, compiled)            the header's packing and schedule and the tensor table equal the
                                            plan the config implies (the loader's and `cflow inspect`'s check)
    stale_file_error(header, path, err)     a file from another cflow: "compiled by cflow X (format N, plan P);
                                            recompile with cflowc" instead of a confusing mismatch
    written_by()                            the version keys the writer stamps into every header

Input: a validated FileReader (structure already checked). Output: a ModelConfig or FormatError naming
the file and the field.
"""

from __future__ import annotations

import json
import numbers

from cflow.errors import CflowError, FormatError
from cflow.layout import QUANTS  # stored: each weight at its GGUF's type (the header's weight_dtypes says which)
from cflow.layout.tile import tile_problem

from . import spec as F

# The keys of the version stamp (FileWriter adds them to every header it writes).
VERSION_KEYS = ("cflow_version", "format_version", "plan_version")

MAX_NAME = 1024  # characters of the model name
MAX_TOKENIZER = 256 << 20  # characters of the tokenizer JSON

# Every stored weight block holds at least its attention norm, QKV stream and output matrix; every expert at
# least its gate+up and down streams. How often a stored block runs (weight sharing) is not bounded: the step's
# LLVM work follows the distinct stage kinds, not the depth (codegen/step.py emit_body). What still grows with
# the executed layers is the Python emission (every stage is emitted to compare its text, ~30 ms per layer on
# Zen 4) and the lowering, so the executed layers are bounded: 1024 is ~30 s of emission, 8x the deepest
# published model (docs/reliability.md, "JIT time").
TENSORS_PER_BLOCK = 3
TENSORS_PER_EXPERT = 2
MAX_EXECUTED_LAYERS = 1024
MIN_BYTES_PER_WEIGHT = 84 / 256  # Q2_K (2.625 bits a weight), the smallest stored type (layout/blocks.py)


def written_by() -> dict:
    """The version stamp of a header written now: package version, container format, plan derivation."""
    from cflow import __version__

    return {"cflow_version": __version__, "format_version": F.VERSION, "plan_version": F.PLAN_VERSION}


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _short(v) -> str:
    text = json.dumps(v) if isinstance(v, (list, dict, str, int, float, bool, type(None))) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def check_header(reader) -> object:
    """Validate `reader.header` field by field; returns its ModelConfig. FormatError names the field."""
    from cflow.ir.config import ModelConfig

    h, path = reader.header, reader.path

    def bad(field: str, msg: str) -> FormatError:
        return FormatError(f"{path}: header field {field}: {msg}")

    if h.get("format") != F.FORMAT_NAME:
        raise bad("format", f"{_short(h.get('format'))} is not {F.FORMAT_NAME!r} (not a cflow model file)")
    for key in VERSION_KEYS:  # optional: files written before versions were stamped have none
        v = h.get(key)
        if v is not None and not (isinstance(v, str) if key == "cflow_version" else _is_int(v)):
            raise bad(key, f"{_short(v)} is not a version")
    name = h.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME):
        raise bad("name", f"{_short(name)}: expected a string of at most {MAX_NAME} characters")
    if "config" not in h:
        raise bad("config", "missing")
    if not isinstance(h["config"], dict):
        raise bad("config", f"{_short(h['config'])}: expected an object")
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except CflowError as e:
        raise FormatError(f"{path}: header field config: {e}") from None
    quant = h.get("quant")
    if quant not in QUANTS:
        raise bad("quant", f"{_short(quant)}: expected one of {', '.join(QUANTS)}")
    tile = h.get("tile")
    if not (isinstance(tile, list) and len(tile) == 2 and all(_is_int(t) for t in tile)):
        raise bad("tile", f"{_short(tile)}: expected [rows, cols]")
    msg = tile_problem(tile)
    if msg:
        raise bad("tile", msg)
    for key, want in (("delays", list(cfg.delays)), ("trained_delays", None)):
        v = h.get(key)
        if v is None and key == "trained_delays":
            continue
        if not (isinstance(v, list) and len(v) == 2 and all(_is_int(d) and 0 <= d < cfg.n_layers for d in v)):
            raise bad(key, f"{_short(v)}: expected [dense_delay, expert_delay], each in 0..{cfg.n_layers - 1}")
        if want is not None and v != want:
            raise bad(key, f"{v} differs from the config's delays {want}")
    if "routing" in h and h["routing"] != cfg.routing:
        raise bad("routing", f"{_short(h['routing'])} differs from the config's {cfg.routing!r}")
    eos = h.get("eos_token_ids")
    if eos is not None:
        if not isinstance(eos, list) or len(eos) > 1024:
            raise bad("eos_token_ids", f"{_short(eos)}: expected a list of token ids")
        for i in eos:
            if not _is_int(i) or not 0 <= i < cfg.vocab_size:
                raise bad("eos_token_ids", f"{_short(i)} is not a token id in 0..{cfg.vocab_size - 1}")
    sp = h.get("special_tokens")
    if sp is not None:
        if not isinstance(sp, dict) or set(sp) - {"bos", "eos", "add_bos", "add_eos", "source"}:
            raise bad("special_tokens", f"{_short(sp)}: expected {{bos, eos, add_bos, add_eos, source}}")
        for key in ("bos", "eos"):
            v = sp.get(key)
            if v is not None and (not _is_int(v) or not 0 <= v < cfg.vocab_size):
                raise bad("special_tokens", f"{key} {_short(v)} is not a token id in 0..{cfg.vocab_size - 1}")
        for key in ("add_bos", "add_eos"):
            if not isinstance(sp.get(key, False), bool):
                raise bad("special_tokens", f"{key} {_short(sp.get(key))}: expected true or false")
        if not isinstance(sp.get("source", ""), str) or len(sp.get("source", "")) > 256:
            raise bad("special_tokens", f"source {_short(sp.get('source'))}: expected a short string")
    tok = h.get("tokenizer")
    if tok is not None and (not isinstance(tok, str) or len(tok) > MAX_TOKENIZER):
        raise bad("tokenizer", f"{_short(tok)[:40]}: expected the text of a tokenizer.json")
    for key in ("packing", "weight_dtypes"):
        if key in h and not isinstance(h[key], dict):
            raise bad(key, f"{_short(h[key])}: expected an object")
    if "schedule" in h and not isinstance(h["schedule"], dict):
        raise bad("schedule", f"{_short(h['schedule'])}: expected an object")
    check_budget(cfg, reader)
    return cfg


def check_budget(cfg, reader) -> None:
    """The plan's size against what the file holds: refused here, before the IR is built (its size follows
    n_layers and n_experts) or anything is compiled (the step's emission follows the executed layers)."""
    from cflow.ir.build import weight_shapes

    path, n_t, data = reader.path, len(reader.tensors), reader.data_len

    def refuse(field: str, msg: str) -> FormatError:
        return FormatError(f"{path}: header field config.{field}: {msg}")

    blocks_field = "n_layers" if cfg.n_blocks == cfg.n_layers else "n_blocks"
    if TENSORS_PER_BLOCK * cfg.n_blocks > n_t:
        raise refuse(blocks_field, f"{getattr(cfg, blocks_field)} asks for {cfg.n_blocks} weight blocks, but the "
                                   f"file holds {n_t} tensors (each block needs at least {TENSORS_PER_BLOCK})")
    if cfg.n_layers > MAX_EXECUTED_LAYERS:
        raise refuse("n_layers", f"{cfg.n_layers} executed layers; at most {MAX_EXECUTED_LAYERS} (the step is "
                                 f"emitted stage by stage at load)")
    if cfg.n_experts:
        moe_blocks = {cfg.block_of(l) for l in range(1, cfg.n_layers + 1) if cfg.has_moe(l)}
        need = TENSORS_PER_EXPERT * cfg.n_experts * len(moe_blocks)
        if need > n_t:
            raise refuse("n_experts", f"{cfg.n_experts} experts in {len(moe_blocks)} blocks need at least {need} "
                                      f"tensors, but the file holds {n_t}")
    # Now weight_shapes is O(file size); its bytes, at the smallest stored type, must fit the data section.
    by_field: dict[str, int] = {}
    for name, shape in weight_shapes(cfg).items():
        n = 1
        for d in shape:
            n *= d
        field = _field_of(name)
        by_field[field] = by_field.get(field, 0) + (4 * n if len(shape) == 1 else int(n * MIN_BYTES_PER_WEIGHT))
    least = sum(by_field.values())
    if least > data:
        field = max(by_field, key=by_field.get)
        raise refuse(field, f"{getattr(cfg, field)}: the config's weights need at least {least:,} bytes, but the "
                            f"file's data section holds {data:,}")


def _field_of(weight: str) -> str:
    """The config field that sizes an IR weight most (for naming it when the file is too small)."""
    if weight in ("tok_embeddings", "lm_head"):
        return "vocab_size"
    for part, field in ((".experts.", "expert_dim"), (".shared", "shared_expert_dim"), (".ffn.", "ffn_dim"),
                        (".router", "n_experts")):
        if part in weight:
            return field
    return "d_model"


def check_plan(reader, compiled) -> None:
    """The header's packing and schedule, and every tensor the plan needs, equal what the config implies."""
    h, p = reader.header, reader.path
    planned = {n: t.to_json() for n, t in compiled.tensors.items()}
    if h.get("packing") != planned:
        raise FormatError(f"{p}: header section 'packing' does not match the packing the config implies")
    if json.dumps(h.get("schedule"), sort_keys=True) != json.dumps(compiled.schedule.to_json(), sort_keys=True):
        raise FormatError(f"{p}: header section 'schedule' does not match the schedule the config implies")
    for name, t in compiled.tensors.items():
        try:
            e = reader.entry(name)
        except (KeyError, FormatError):
            raise FormatError(f"{p}: tensor table has no entry {name!r} that the model needs") from None
        if e.dtype != t.file_dtype or tuple(e.shape) != tuple(t.shape) or tuple(e.tile) != tuple(t.file_tile) \
                or e.nbytes != t.nbytes:
            raise FormatError(
                f"{p}: tensor table entry {e.index} ({name!r}) at file offset {e.file_offset:#x}: "
                f"{e.dtype.label} {tuple(e.shape)} tile {tuple(e.tile)} {e.nbytes} B, expected "
                f"{t.file_dtype.label} {tuple(t.shape)} tile {tuple(t.file_tile)} {t.nbytes} B")
        want = (t.block, t.expert, compiled.stage_of.get(name, e.stage))
        if (e.layer, e.expert, e.stage) != want:  # the disk tiers find experts and stages by these fields
            raise FormatError(f"{p}: tensor table entry {e.index} ({name!r}) at file offset {e.file_offset:#x}: "
                              f"layer {e.layer}, expert {e.expert}, stage {e.stage}; expected layer {want[0]}, "
                              f"expert {want[1]}, stage {want[2]}")
    extra = len(reader.tensors) - len(compiled.tensors)
    if extra:  # every tensor the file holds is one the plan reads: nothing unexplained in the data section
        name = next(t.name for t in reader.tensors if t.name not in compiled.tensors)
        raise FormatError(f"{p}: tensor table entry {name!r} is not part of the model ({extra} such entries)")


def describe_versions(h: dict) -> str:
    """'cflow 0.1.0 (format 1, plan 1)' for a header's stamp ('an earlier cflow (...)' without one)."""
    v = h.get("cflow_version")
    fmt, plan = h.get("format_version", F.VERSION), h.get("plan_version")
    who = f"cflow {v}" if isinstance(v, str) else "an earlier cflow (no version recorded)"
    return f"{who} (format {fmt}" + (f", plan {plan})" if plan is not None else ")")


def stale_file_error(h: dict, path: str, err: Exception) -> FormatError | None:
    """For a file written by another cflow (its version stamp differs from ours, or it has none), the error
    to raise instead of `err`: who compiled it and that it must be recompiled. None: same version, a real fault."""
    mine = written_by()
    theirs = {k: h.get(k) for k in VERSION_KEYS}
    if theirs == mine:
        return None
    ours = f"cflow {mine['cflow_version']} (format {F.VERSION}, plan {F.PLAN_VERSION})"
    return FormatError(f"{path}: compiled by {describe_versions(h)}; this is {ours}: recompile with cflowc "
                       f"({_reason(err, path)})")


def _reason(err: Exception, path: str) -> str:
    text = str(err)
    return text[len(path) + 2:] if text.startswith(f"{path}: ") else text
