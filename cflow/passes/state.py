"""CompileState: what the lowering pipeline carries from the IR down to a file and native code.

Graph passes (delays, quantisation) rewrite `graph`; state passes fill the rest in order:
plan_packing -> tensors, schedule_stages -> schedule, order_tensors -> order and stage_of,
emit_file (runtime) -> file, emit_step (codegen) -> program. Every field a pass has not produced
yet is None. `str(state)` is what `cflowc --print-after PASS` shows.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..errors import VerifyError
from ..ir import Graph, verify
from ..layout.packed import FileLayout, PackedTensor
from ..layout.tile import DEFAULT_TILE, check_tile


@attrs.frozen(kw_only=True)
class CompileState:
    graph: Graph  # the IR (quantised once quantize_weights ran)
    tile: tuple[int, int] = attrs.field(default=DEFAULT_TILE, converter=check_tile)  # (rows, cols) of a tile
    layout: FileLayout = attrs.field(default=FileLayout.VFLOW, converter=FileLayout.parse)  # tensor order
    tensors: dict[str, PackedTensor] | None = None  # plan_packing: every stored tensor, first-use order
    schedule: Any = None  # schedule_stages: passes.schedule.Schedule
    order: tuple[str, ...] | None = None  # order_tensors: tensor names in file order
    stage_of: dict[str, int] | None = None  # order_tensors: tensor -> stage that first streams it
    file: dict | None = None  # emit_file: {"path", "file_bytes", "bytes_per_token", "tensors", "seconds"}
    program: Any = None  # emit_step: codegen.step.StepProgram
    passes: tuple[str, ...] = ()  # passes run on this state, in order

    def evolve(self, **changes) -> CompileState:
        return attrs.evolve(self, **changes)

    @property
    def bytes_per_token(self) -> int:
        """Weight bytes the decode step streams per token (top-k experts only)."""
        return sum(s.nbytes for s in self.schedule.steps()) if self.schedule is not None else 0

    def verify(self) -> None:
        """The IR verifier, then the lowering's invariants between the fields produced so far."""
        verify(self.graph)
        if self.tensors is not None and self.schedule is not None:
            for step in self.schedule.steps():
                for t in step.tensors + ((step.norm,) if step.norm else ()):
                    if t not in self.tensors:
                        raise VerifyError(f"schedule step {step.op}/{step.phase} streams {t!r}, which the packing "
                                          "plan does not hold")
        if self.order is not None:
            if self.tensors is None or sorted(self.order) != sorted(self.tensors):
                raise VerifyError("file order is not a permutation of the packing plan's tensors")

    def __str__(self) -> str:
        parts = [str(self.graph)]
        if self.tensors is not None:
            nbytes = sum(t.nbytes for t in self.tensors.values())
            parts.append(f"packing: {len(self.tensors)} tensors, {nbytes:,} bytes, "
                         f"tile {self.tile[0]}x{self.tile[1]}\n")
        if self.schedule is not None:
            parts.append(str(self.schedule))
        if self.order is not None:
            parts.append(f"file order ({self.layout}): " + ", ".join(self.order[:6])
                         + (", ..." if len(self.order) > 6 else "") + "\n")
        if self.file is not None:
            parts.append(f"file: {self.file['path']} ({self.file['file_bytes']:,} bytes)\n")
        return "".join(parts)
