"""The compiler front door: a model's graph down to a .vflow/.cflow file, as one pipeline of passes.

    [dense_delay, expert_delay] -> quantize_weights -> plan_packing -> schedule_stages -> order_tensors
        -> [emit_step] -> emit_file

The lowering passes live in passes/ (passes/pipeline.py reads as the list); the native step pass in
codegen/step.py (only for `cflowc --emit llvm`), the file emission pass in runtime/emit.py. cflowc runs
every lowering through compile_file; `cflowc --print-after PASS` shows the state after any of them,
`--time-passes` times them, `--debug` verifies after each.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .codegen import quantfit  # noqa: F401  (sets layout.quantize_blocks.NATIVE_FITTERS: the native fitters)
from .ir import Graph
from .layout.packed import FileLayout
from .layout.tile import DEFAULT_TILE
from .passes.manager import PassContext, Pipeline
from .passes.pipeline import check_native, lower, lowering
from .passes.state import CompileState

__all__ = ["lower", "compile_file", "CompileState"]


def compile_file(graph: Graph, out: str | os.PathLike | None, quant: str = "q4", tile=DEFAULT_TILE,
                 delays: tuple[int, int] | None = None, layout: str | FileLayout | None = None,
                 tokenizer: str | None = None, eos: list[int] | None = None,
                 progress: Callable[[int, int, str], None] | None = None,
                 ctx: PassContext | None = None, isa: str | None = None) -> CompileState:
    """Lower `graph` and write it to `out` (layout from the extension unless given). Returns the final state.

    out None: no file, the planned state only (cflowc --emit schedule). isa: also emit the native decode step for
    that ISA into state.program (cflowc --emit llvm)."""
    if layout is not None:
        layout = FileLayout.parse(layout)
    else:
        layout = FileLayout.from_path(out) if out is not None else FileLayout.VFLOW
    check_native(graph)  # nothing written for a model the runtime cannot run yet
    passes = [lowering(quant, delays)]
    if isa is not None:
        from .codegen.step import emit_step

        passes.append(emit_step(isa))
    if out is not None:
        from .runtime.emit import emit_file

        passes.append(emit_file(out, tokenizer, eos, progress))
    state = Pipeline(passes, name="compile")(CompileState(graph=graph, tile=tile, layout=layout), ctx)
    state.verify()
    return state
