"""File order of the packed tensors: stage-major (.vflow) or layer-major (.cflow).

.vflow orders tensors by the stage that first streams them, so a sequential read of the file follows
the decode step; .cflow orders them by weight block (embedding first, global tensors last).
"""

from __future__ import annotations

from ..layout.packed import FileLayout
from .manager import state_pass

LAST = 1 << 30  # sort key after every block


@state_pass(name="order_tensors", requires=("plan_packing", "schedule_stages"))
def order_tensors(state, ctx):
    tensors, sched = state.tensors, state.schedule
    stage_of: dict[str, int] = {}
    for step in sched.steps():
        for t in step.tensors:
            stage_of.setdefault(t, step.stage)
    for step in sched.steps():  # norms and biases read in a prologue: the stage of their reader
        if step.norm:
            stage_of.setdefault(step.norm, step.stage)
    for name in tensors:
        stage_of.setdefault(name, sched.n_stages)  # final norm etc.: read with the head
    first = {name: i for i, name in enumerate(tensors)}
    if state.layout == FileLayout.VFLOW:
        order = sorted(tensors, key=lambda n: (stage_of[n], first[n]))
    else:
        def block(n: str) -> int:
            b = tensors[n].block
            return b if b >= 0 else (-1 if n == "tok_embeddings" else LAST)

        order = sorted(tensors, key=lambda n: (block(n), first[n]))
    return state.evolve(order=tuple(order), stage_of=stage_of)
