"""The memory check before the JIT sizes the KV cache and the per-thread scratch exactly as they are then allocated.

Session.memory_parts asks codegen.abi (scratch_layout, kv_cache_bytes) for these sizes instead of keeping a formula
of its own; a change to ScratchLayout or the KV layout that the check does not follow fails here (issue 14)."""

import pytest

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph


def _part(parts: dict, prefix: str) -> int:
    (v,) = [n for k, n in parts.items() if k.startswith(prefix)]
    return v


@pytest.mark.parametrize("preset, quant, tile, kw", [
    # experts, both delays, a tile narrower than d_model, two-plane activations (the int8 fields doubled)
    ("arch2_4_combined", "q4", (32, 64), dict(threads=2, activations="q8x2")),
    ("arch5_shared", "q8", (16, 32), dict(threads=1, max_batch=3, max_seq=48)),  # shared blocks, batch slots
    ("arch1", "q4", (128, 256), dict(threads=2, prefill_block=5)),  # a tile wider than every matrix, T = 5
    ("arch4_async_experts", "q4", (32, 64), dict(threads=1, experts="disk")),  # the segmented step
])
def test_estimate_equals_allocation(tmp_path, preset, quant, tile, kw):
    path = tmp_path / f"{preset}.vflow"
    compile_file(load_graph(f"preset:{preset}@tiny"), path, quant, tile)
    with cflow.load(path, **kw) as m:
        s = m.session
        parts = s.memory_parts()
        assert _part(parts, "the KV cache") == s.kv.nbytes
        assert _part(parts, "the per-thread scratch") == s.scratch.nbytes
        assert s.scratch.nbytes == s.program.scratch.nbytes * s.threads
        assert _part(parts, "the RoPE tables") == s.cos.nbytes + s.sin.nbytes
        assert _part(parts, "the activation buffers") >= sum(p.nbytes for p in s.pools.values())  # an upper bound
        rg = getattr(s, "route_guess", None)
        if rg is not None:  # experts on disk, async: the guesser's f32 copies of the routers and norms
            copies = sum(w.nbytes + r.nbytes for w, r, _ in rg.layers.values()) + sum(v.nbytes for v in rg.inv.values())
            assert _part(parts, "the route guesser's") >= copies
