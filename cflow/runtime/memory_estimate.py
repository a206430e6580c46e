"""What loading a model will allocate, by part, checked against the memory this process may still use before
the JIT or any allocation runs."""

from __future__ import annotations

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
    if weights == "disk":  # streamed: only what is not tiled stays in RAM, plus the read-ahead buffers
        stages = [sum(tensors[n].nbytes for st in stage for n in st.tensors if n in tensors)
                  for stage in run_state.schedule.stages]
        parts["the weights kept in RAM and the read-ahead buffers"] = (
            sum(t.nbytes for t in tensors.values() if t.expert < 0 and not t.form.is_tiled)
            + (read_ahead + 2) * max(stages, default=0))
    elif experts == "disk":
        parts["the non-expert weights read into RAM (--weights-on-disk streams them)"] = sum(
            t.nbytes for t in tensors.values() if t.expert < 0)
    if experts == "disk" and expert_cache_mb is not None and expert_cache_mb > 0:
        # the tier never allocates more slots than there are experts (ExpertTier), so neither does the estimate
        parts[f"the expert cache (--expert-cache-mb {expert_cache_mb})"] = min(
            int(expert_cache_mb * 2**20), sum(t.nbytes for t in tensors.values() if t.expert >= 0))
    return parts


def check_memory(path: str, parts: dict[str, int]) -> None:
    """The parts' sum (KV cache, RoPE tables, per-thread scratch, buffers, weights read into RAM) against the
    memory this process may still use: one error naming the largest part and how to shrink it."""
    from ..util import available_memory, format_bytes

    need, avail = sum(parts.values()), available_memory()
    if avail is not None and need > avail:
        big = max(parts, key=parts.get)
        raise CflowError(f"{path}: loading needs {format_bytes(need)} of memory, {format_bytes(parts[big])} "
                         f"of it for {big}, but {format_bytes(avail)} is available")
