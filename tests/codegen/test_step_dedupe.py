"""The step is a loop over a table of stage functions, one per distinct stage (codegen/step.py emit_body).

Stages that differ only in layer-specific integers (pointer-table slots, pool, KV-cache and route offsets) read
them from a per-stage descriptor and share one function, so the number of stage functions follows the layer
kinds and the delays' ramp-up/ramp-down stages, not the depth. Sharing is decided on the whole IR text, so a
constant left inline only costs sharing, never correctness: the runtime tests below check both.
"""

import numpy as np
import pytest
from llvmlite import binding as llvm

from cflow.codegen import step as step_mod
from cflow.codegen.cgutils import c64
from cflow.compiler import compile_file, lower
from cflow.ir import Interpreter, build_graph
from cflow.ir.build import weight_shapes
from cflow.models.presets import get_preset
from cflow.runtime.session import Session
from tests._shared import SMALL_TILE


def _config(preset, n_layers, size="tiny"):
    shared = preset == "arch5_shared"
    return get_preset(preset, size).evolve(n_layers=n_layers, n_blocks=n_layers // 2 if shared else n_layers)


def _graph(config, seed=0):
    rng = np.random.default_rng(seed)
    w = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in weight_shapes(config).items()}
    return build_graph(config, w, name=config.name)


def _program(preset, n_layers, tmax=4, **kw):
    state = lower(_graph(_config(preset, n_layers)), "q4", SMALL_TILE)  # (stages are the subject: small kernels)
    return state, step_mod.build_step(state, "avx2", 64, tmax=tmax, **kw)


@pytest.mark.parametrize("preset", ["arch1", "arch2_4_combined", "arch5_shared"])
def test_stage_functions_do_not_grow_with_depth(preset):
    counts = {}
    for n_layers in (4, 12):
        state, prog = _program(preset, n_layers)
        text = str(prog.module)
        for body in ("stage", "multi_stage"):
            stages, distinct = prog.stage_functions[body]
            assert stages == state.schedule.n_stages
            assert text.count(f'define internal void @"{body}_') == distinct  # dropped duplicates leave nothing
        counts[n_layers] = {body: distinct for body, (_, distinct) in prog.stage_functions.items()}
        if n_layers == 12:
            stages, distinct = prog.stage_functions["stage"]
            assert distinct < stages / 2
    assert counts[4] == counts[12]


def test_module_is_valid_llvm():
    _, prog = _program("arch2_4_combined", 6, profile=True, segmented=True)
    llvm.parse_assembly(str(prog.module)).verify()


def test_descriptor_holds_the_layer_constants():
    _, prog = _program("arch1", 6)
    text = str(prog.module)
    assert '@"stage_table" = internal constant' in text and '@"stage_desc" = internal constant' in text
    assert '@"multi_stage_table" = internal constant' in text


def _inline_constants(monkeypatch):
    """Emit every layer constant inline again (no descriptor): every stage then differs from every other."""
    monkeypatch.setattr(step_mod._Emitter, "k", lambda self, v, name="d": c64(v))


def test_an_inline_constant_only_costs_sharing(monkeypatch):
    _inline_constants(monkeypatch)
    state, prog = _program("arch2_4_combined", 6)
    assert prog.stage_functions["stage"] == (state.schedule.n_stages, state.schedule.n_stages)


def _run(path, ids, threads, **kw):
    """The logits of a 9-token prompt and 6 steps, and the session (closed) for its program and cache type."""
    s = Session(str(path), threads=threads, **kw)
    try:
        return np.stack([s.prefill(ids[:9])] + [s.step(int(t)).copy() for t in ids[9:]]), s
    finally:
        s.close()


# Each preset at one weight type: the delays and experts (arch2_4) and shared blocks (arch5) reach the descriptor
# the same way at either; each weight type's stage code reads its layer constants from it in one of them.
@pytest.mark.parametrize("preset, quant", [("arch2_4_combined", "q4"), ("arch5_shared", "f32")])
def test_deep_shared_stages_match_the_interpreter(tmp_path, monkeypatch, preset, quant):
    """10 layers through a few shared stage functions (decode and prompt blocks of 4, 2 threads): the logits equal
    the interpreter's (f32: float summation order only), and equal bit for bit a build where every stage has its
    own function with its constants inline (q4 too: there rounding flips of int8 activation codes over 10 random
    layers would blur a comparison with the interpreter)."""
    g = _graph(_config(preset, 10), seed=3)
    path = tmp_path / "deep.vflow"
    compile_file(g, path, quant, SMALL_TILE)
    ids = np.random.default_rng(5).integers(0, g.config.vocab_size, 9 + 6)
    got, s = _run(path, ids, 2, cache=False, prefill_block=4)
    kv = s.kv_dtype
    for body in ("stage", "multi_stage"):
        stages, distinct = s.program.stage_functions[body]
        assert distinct < stages / 2
    if quant == "f32":
        it = Interpreter(g, kv=kv)
        ref = np.concatenate([it.prefill(ids[:9])[-1:]] + [it.step(int(t))[None] for t in ids[9:]])
        assert np.abs(got - ref).max() <= 1e-4
    _inline_constants(monkeypatch)
    assert np.array_equal(_run(path, ids, 2, cache=False, prefill_block=4)[0], got)
