"""What loading a model will allocate, by part, checked against the memory this process may still use before
the JIT or any allocation runs."""

from __future__ import annotations

import contextlib
import os

from ..errors import CflowError


def memory_parts(compiled, run_state, *, tmax: int, max_seq: int, n_slots: int, kv: str, threads: int,
                 weights: str, experts: str, read_ahead: int, expert_cache_mb: float | None = None,
                 activations: str = "q8", expert_io: str = "async", cache_default: bool = False) -> dict[str, int]:
    """Bytes loading allocates, by part (what the memory check adds up). `compiled` is the file's plan,
    `run_state` the one the step runs (the disk tier's late schedule); cache_default: count the expert cache a
    load without expert_cache_mb gets (open_tier's default). The KV cache and the scratch are exact,
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
    if experts == "disk" and expert_io == "async":  # RouteGuess: each router, its norm and the inverse, in f32
        routers = [n for n in run_state.graph.nodes() if n.kind == "router"]
        parts["the route guesser's copies of the routers"] = sum(4 * (n.n_experts + 2) * n.dim for n in routers)
    if experts == "disk" and expert_cache_mb is None and cache_default:
        from .segments import default_cache_bytes

        slot, n, window = expert_slots(run_state, tensors, c.top_k, every_stage=weights == "disk",
                                       sync=expert_io == "sync")
        parts["the expert cache (default: a quarter of the experts; --expert-cache-mb sets it)"] = (
            default_cache_bytes(n, slot, window))
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


def expert_slots(run_state, tensors, top_k: int, *, every_stage: bool, sync: bool) -> tuple[int, int, int]:
    """(bytes of one expert's cache slot, experts stored, slots one expert-delay window pins at once) for the
    disk tier, as segments.open_tier sizes it."""
    from .segments import expert_entries, plan_segments

    names, slot = expert_entries(tensors)
    window = plan_segments(run_state.schedule, top_k, every_stage=every_stage, sync=sync).min_slots
    return slot, len(names), window


# Address space a load maps besides its parts, which a limit on the address space (RLIMIT_AS, `ulimit -v`)
# counts although little of it becomes resident: the JIT's libraries, code and working memory, and for each
# thread the load starts a stack (8 MiB) and a malloc arena (64 MiB reserved). Measured: the tiny presets 180 MiB
# with one thread, 55 more per thread; the ~4 GB sibling with experts on disk, 2 threads, a cold JIT: 549 MiB
# (616 reserved).
AS_RESERVE = 256 * 2**20
AS_PER_THREAD = 72 * 2**20


def load_threads(threads: int, experts: str, weights: str) -> int:
    """Threads a load starts: the decode workers besides the caller, the expert tier's and the streamer's I/O."""
    from .experts import IO_THREADS
    from .streaming import IO_THREADS as STREAM_THREADS

    return threads - 1 + (IO_THREADS if experts == "disk" else 0) + (STREAM_THREADS if weights == "disk" else 0)


def check_memory(path: str, parts: dict[str, int], threads: int = 0) -> None:
    """The parts' sum (KV cache, RoPE tables, per-thread scratch, buffers, weights read into RAM) against the
    memory this process may still use, and under an address-space limit the parts plus what the JIT and the
    `threads` threads the load starts map: one error naming the largest part and how to shrink it."""
    from ..util import address_space_left, available_memory, format_bytes

    need, avail = sum(parts.values()), available_memory()
    big = max(parts, key=parts.get)
    if avail is not None and need > avail:
        raise CflowError(f"{path}: loading needs {format_bytes(need)} of memory, {format_bytes(parts[big])} "
                         f"of it for {big}, but {format_bytes(avail)} is available")
    left = address_space_left()
    extra = AS_RESERVE + threads * AS_PER_THREAD
    if left is not None and need + extra > left:
        raise CflowError(f"{path}: loading needs {format_bytes(need + extra)} of address space: "
                         f"{format_bytes(parts[big])} for {big}, {format_bytes(need - parts[big])} for the other "
                         f"buffers and {format_bytes(extra)} for the JIT and {threads} threads' stacks and heaps, "
                         f"but the address-space limit (RLIMIT_AS, ulimit -v) leaves {format_bytes(left)}")


@contextlib.contextmanager
def allocating(session):
    """Around the JIT and the allocations a load makes after check_memory: one that fails all the same (memory
    taken meanwhile by another process, a limit the estimate does not see) is one CflowError, the session closed,
    never a MemoryError from deep inside numpy."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "can't start new thread" not in str(e):
            raise
        from ..util import available_memory, format_bytes

        session.close()
        parts = session.memory_parts()
        avail = available_memory()
        raise CflowError(f"{session.path}: out of memory while loading ({type(e).__name__}: {e}); the buffers it "
                         f"allocates come to {format_bytes(sum(parts.values()))}, "
                         f"{format_bytes(parts[max(parts, key=parts.get)])} of it for {max(parts, key=parts.get)}"
                         + (f"; {format_bytes(avail)} is available now" if avail is not None else "")) from None


def check_load(session, expert_cache_mb: float | None) -> None:
    """check_memory for a session about to be built (its options set): the parts, the expert cache it will get
    and the threads it will start."""
    parts = session.memory_parts(expert_cache_mb, cache_default=expert_cache_mb is None and session.max_ram is None)
    check_memory(session.path, parts, load_threads(session.threads, session.experts, session.weights))


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
        if not has_experts:
            ex = "ram"  # a dense model streamed: no expert tier
        session._set_tiers(ex, we, prefill_block)
        need = sum(session.memory_parts().values())
        window = 0
        if we == "ram" and ex == "ram":  # mapped: every page of the file is touched each token, but an untied
            lookup = lookup_tensors(session.compiled)  # embedding's rows
            need += sum(t.nbytes if n not in lookup else min(t.nbytes, session.max_seq * row_touch(t))
                        for n, t in tensors.items())
        elif ex == "disk":  # the experts one expert-delay window pins at once: the least cache decoding can run with
            slot, _, slots = expert_slots(session.run_state, tensors, session.config.top_k, every_stage=we == "disk",
                                          sync=session.expert_io == "sync")
            window = slot * slots
        options.append((ex, we, need, window))
    ex, we, _ = choose_tiers(session.max_ram, process_rss(), options)
    return ex, we


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def choose_tiers(max_ram: int, used: int, options: list[tuple[str, str, int, int]]) -> tuple[str, str, int]:
    """Where the weights go under a budget of `max_ram` bytes for the whole process: the first of `options`
    ((experts, weights, bytes it needs besides a cache, bytes of one window of experts), cheapest first: all in
    RAM, experts on disk, weights on disk) that leaves room for one window of experts, with `used` (what the
    process holds now) and LOAD_RESERVE. Returns it with the bytes left for the expert cache (an estimate: the
    cache is sized again once the step is built). None fitting: one error with the numbers, before the JIT."""
    for experts, weights, need, window in options:
        left = max_ram - used - LOAD_RESERVE - need
        if left >= window:
            return experts, weights, left
    experts, weights, need, window = options[-1]
    what = "dense weights read into RAM" if weights == "ram" else "weights kept in RAM and read-ahead buffers"
    total = used + LOAD_RESERVE + need + window
    raise CflowError(f"max_ram {_mib(max_ram)} is too small for this model: with "
                     f"{'the weights' if weights == 'disk' else 'the experts'} on disk it needs {_mib(total)}: "
                     f"{_mib(need)} for the {what}, the KV cache and buffers, "
                     + (f"{_mib(window)} for one window of experts (those decoding holds at once), " if window else "")
                     + f"{_mib(LOAD_RESERVE)} reserved for loading and {_mib(used)} this process already holds")


def cache_budget(max_ram: int, parts: int) -> int:
    """Bytes for the expert cache under `max_ram`, once the step is built: what the resident set now, the load's
    parts in full (`parts`: the dense weights not read in yet, the KV cache and buffers allocated but touched
    only as the context grows; counted again where already resident) and RUN_RESERVE leave."""
    return max_ram - process_rss() - parts - RUN_RESERVE
