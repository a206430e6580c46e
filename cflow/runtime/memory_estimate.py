"""What loading a model will allocate, by part, checked against the memory this process may still use before
the JIT or any allocation runs."""

from __future__ import annotations

import os

from ..errors import CflowError


def memory_parts(compiled, run_state, *, tmax: int, max_seq: int, n_slots: int, kv: str, threads: int,
                 weights: str, experts: str, read_ahead: int, expert_cache_mb: float | None = None,
                 activations: str = "q8") -> dict[str, int]:
    """Bytes loading allocates, by part (what the memory check adds up). `compiled` is the file's plan,
    `run_state` the one the step runs (the disk tier's late schedule). The KV cache and the scratch are exact,
    sized by codegen.abi next to the layouts they describe (ScratchLayout, Binding.KV) rather than by a second
    formula here; tests/runtime/test_memory_estimate.py checks they equal what NativeStep allocates. The
    activation buffers are an upper bound."""
    from ..codegen.abi import kv_cache_bytes, scratch_layout
    from ..layout.quant import padded

    c, T, S, tc = compiled.graph.config, tmax, max_seq, compiled.tile[1]
    widest = padded(max(c.d_model, c.ffn_dim, c.expert_dim, c.shared_expert_dim, c.n_heads * c.head_dim), tc)
    parts = {
        (f"the KV cache (config.max_seq_len={S} positions x {c.n_layers} layers"
         + (f" x max_batch={n_slots} sequences" if n_slots > 1 else "")
         + "; load with a smaller max_seq" + (" or max_batch)" if n_slots > 1 else ")")):
            kv_cache_bytes(c, S, n_slots, kv),
        f"the RoPE tables (config.max_seq_len={S})": S * c.head_dim * 4 * (  # a second pair: Gemma 3's local
            2 if c.local_rope_theta and any(c.is_sliding(l) for l in range(1, c.n_layers + 1)) else 1),
        f"the per-thread scratch ({threads} threads)":
            scratch_layout(c, run_state.tensors, S, T, activations).nbytes * threads,
        "the activation buffers": 4 * T * (padded(c.vocab_size, 64) + 32 * widest),
    }
    tensors = compiled.tensors
    lookup = lookup_tensors(compiled) if weights == "disk" or experts == "disk" else frozenset()
    if lookup:  # an untied embedding stays mapped (Session._tensor): the pages of the rows a context reads
        parts["the embedding rows a context reads (mapped)"] = sum(
            min(tensors[n].nbytes, S * n_slots * row_touch(tensors[n])) for n in lookup)
    if weights == "disk":  # streamed: only what is not tiled stays in RAM, plus the read-ahead buffers
        stages = [sum(tensors[n].nbytes for st in stage for n in st.tensors  # experts: the tier's, not streamed
                      if n in tensors and tensors[n].expert < 0 and tensors[n].form.is_tiled)
                  for stage in run_state.schedule.stages]
        parts["the weights kept in RAM and the read-ahead buffers"] = (
            sum(t.nbytes for n, t in tensors.items() if t.expert < 0 and not t.form.is_tiled and n not in lookup)
            + (read_ahead + 2) * max(stages, default=0))
    elif experts == "disk":
        parts["the non-expert weights read into RAM (--weights-on-disk streams them)"] = sum(
            t.nbytes for n, t in tensors.items() if t.expert < 0 and n not in lookup)
    if experts == "disk" and expert_cache_mb is not None and expert_cache_mb > 0:
        # the tier never allocates more slots than there are experts (ExpertTier), so neither does the estimate
        parts[f"the expert cache (--expert-cache-mb {expert_cache_mb})"] = min(
            int(expert_cache_mb * 2**20), sum(t.nbytes for t in tensors.values() if t.expert >= 0))
    return parts


def lookup_tensors(compiled) -> frozenset[str]:
    """The stored tensors a step reads a row of per token (an untied embedding: Graph.lookup_weights)."""
    rows = compiled.graph.lookup_weights()
    return frozenset(n for n, t in compiled.tensors.items() if t.parts and all(p in rows for p in t.parts))


def row_touch(t) -> int:
    """Bytes of the file one row lookup of tensor `t` brings in: its row's pages, or for a tile stream the
    tile-row holding it (the row's codes are spread over the tile-row's units)."""
    from ..layout.quant import padded

    if t.form.is_tiled:
        return t.layout.tile_row_nbytes
    return padded(t.nbytes // max(1, t.shape[0]), 4096)


def check_memory(path: str, parts: dict[str, int]) -> None:
    """The parts' sum (KV cache, RoPE tables, per-thread scratch, buffers, weights read into RAM) against the
    memory this process may still use: one error naming the largest part and how to shrink it."""
    from ..util import available_memory, format_bytes

    need, avail = sum(parts.values()), available_memory()
    if avail is not None and need > avail:
        big = max(parts, key=parts.get)
        raise CflowError(f"{path}: loading needs {format_bytes(need)} of memory, {format_bytes(parts[big])} "
                         f"of it for {big}, but {format_bytes(avail)} is available")


# What a load uses beyond its parts, for choosing where the weights go under max_ram: the JIT's working memory
# and code, the tokenizer and the Python objects of the plan (a Qwen3-30B-A3B-geometry MoE: 12,627 tensors).
# The expert cache itself is sized later, from the resident set measured once the step is built.
LOAD_RESERVE = 256 * 2**20
# Left free under max_ram once the cache is sized: Python objects made while decoding, the page cache's share
# of the dense reads the kernel has not reclaimed yet, the I/O threads' stacks.
RUN_RESERVE = 64 * 2**20


def process_rss() -> int:
    """This process's resident set now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fit_max_ram(session, experts: str, weights: str, prefill_block: int) -> tuple[str, str]:
    """The cheapest placement of a session's weights that fits its max_ram (all mapped in RAM, else experts on
    disk, else the big matrices streamed too), starting from the one asked for; the session's tiers are left
    set to the last one tried."""
    tensors = session.compiled.tensors
    placements = [("ram", "ram"), ("disk", "ram"), ("disk", "disk")]
    asked = placements.index(("disk", "disk") if weights == "disk" else (experts, "ram"))
    has_experts = any(t.expert >= 0 for t in tensors.values())
    options = []
    for k, (ex, we) in enumerate(placements):
        if k < asked or (ex, we) == ("disk", "ram") and not has_experts:
            continue  # cheaper than asked for, or no experts to put on disk
        session._set_tiers(ex, we, prefill_block)
        need = sum(session.memory_parts().values())
        if ex == "ram":  # mapped: every page of the file is touched each token, but an untied embedding's rows
            lookup = lookup_tensors(session.compiled)
            need += sum(t.nbytes if n not in lookup else min(t.nbytes, session.max_seq * row_touch(t))
                        for n, t in tensors.items())
        options.append((ex, we, need))
    ex, we, _ = choose_tiers(session.max_ram, process_rss(), options)
    return ex, we


def choose_tiers(max_ram: int, used: int, options: list[tuple[str, str, int]]) -> tuple[str, str, int]:
    """Where the weights go under a budget of `max_ram` bytes for the whole process: the first of `options`
    ((experts, weights, bytes it needs besides a cache), cheapest first: all in RAM, experts on disk, weights
    on disk) that leaves room, with `used` (what the process holds now) and LOAD_RESERVE. Returns it with the
    bytes left for the expert cache (an estimate: the cache is sized again once the step is built)."""
    from ..util import format_bytes

    for experts, weights, need in options:
        left = max_ram - used - LOAD_RESERVE - need
        if left >= 0:
            return experts, weights, left
    experts, weights, need = options[-1]
    raise CflowError(f"max_ram {format_bytes(max_ram)} is too small for this model: with "
                     f"{'the weights' if weights == 'disk' else 'the experts'} on disk it needs "
                     f"{format_bytes(need)} besides the expert cache, and this process already holds "
                     f"{format_bytes(used)} (+ {format_bytes(LOAD_RESERVE)} reserved for loading)")


def cache_budget(max_ram: int, parts: int) -> int:
    """Bytes for the expert cache under `max_ram`, once the step is built: what the resident set now, the load's
    parts in full (`parts`: the dense weights not read in yet, the KV cache and buffers allocated but touched
    only as the context grows; counted again where already resident) and RUN_RESERVE leave."""
    return max_ram - process_rss() - parts - RUN_RESERVE
