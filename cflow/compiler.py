"""The compiler pipeline in one place: model -> IR -> passes -> packing plan + schedule -> .vflow/.cflow file.

    load_graph -> [set_delays] -> quantize_weights -> pack.plan + build_schedule -> FileWriter

Tensors are quantised, packed and written one at a time, so memory stays near the source weights
plus the largest tensor. `.vflow` orders tensors by the stage that first streams them (stage-major),
`.cflow` by weight block (layer-major); the header carries config, delays, schedule and tokenizer.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import attrs

from .errors import CflowError
from .ir import Graph, verify
from .passes import tile as T
from .passes.delays import set_delays
from .passes.manager import Pipeline
from .passes.pack import PackedTensor, plan
from .passes.quantize import quantize_weights
from .passes.schedule import Schedule, build_schedule

FORMAT_NAME = "cflow"


@attrs.frozen
class Compiled:
    graph: Graph  # quantised IR
    tensors: dict  # name -> PackedTensor
    schedule: Schedule
    order: list  # tensor names in file order
    stage_of: dict  # tensor name -> stage of first use


def lower(graph: Graph, quant: str = "q4", tile=T.DEFAULT_TILE, delays: tuple[int, int] | None = None,
          layout: str = "vflow") -> Compiled:
    """Run the passes and plan the file (no weights touched)."""
    passes = []
    if delays is not None:
        passes += set_delays(*delays)
    passes.append(quantize_weights(quant))
    g = Pipeline(passes, name="compile")(graph)
    verify(g)
    tensors = plan(g, tile)
    sched = build_schedule(g, tile)
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
    if layout == "vflow":
        order = sorted(tensors, key=lambda n: (stage_of[n], first[n]))
    elif layout == "cflow":
        order = sorted(tensors, key=lambda n: (tensors[n].block if tensors[n].block >= 0 else (-1 if n == "tok_embeddings" else 1 << 30), first[n]))
    else:
        raise CflowError(f"unknown layout {layout!r} (expected vflow or cflow)")
    return Compiled(graph=g, tensors=tensors, schedule=sched, order=order, stage_of=stage_of)


def header_for(c: Compiled, tile, tokenizer: str | None, eos: list[int] | None) -> dict:
    g = c.graph
    return {
        "format": FORMAT_NAME,
        "name": g.name,
        "config": g.config.to_dict(),
        "delays": list(g.meta["delays"]),
        "trained_delays": list(g.meta.get("trained_delays", g.meta["delays"])),
        "routing": g.meta["routing"],
        "quant": g.meta["quant"],
        "tile": list(tile),
        "weight_dtypes": g.meta["weight_dtypes"],
        "packing": {n: {"form": t.form, "parts": list(t.parts), "part_shapes": [list(s) for s in t.part_shapes],
                        "dtype": t.dtype.label} for n, t in c.tensors.items()},
        "schedule": c.schedule.to_json(),
        "tokenizer": tokenizer,
        "eos_token_ids": list(eos or []),
    }


def write_file(c: Compiled, out: str | os.PathLike, tile=T.DEFAULT_TILE, tokenizer: str | None = None,
               eos: list[int] | None = None, progress: Callable[[int, int, str], None] | None = None) -> dict:
    """Quantise, pack and stream every tensor into `out` (atomic). Returns a small summary."""
    from .runtime.writer import FileWriter

    t0 = time.perf_counter()
    layout = "cflow" if str(out).endswith(".cflow") else "vflow"
    total = sum(c.tensors[n].nbytes for n in c.order)
    done = 0
    header = header_for(c, tile, tokenizer, eos)
    with FileWriter(out, header, layout=layout) as w:
        for name in c.order:
            t: PackedTensor = c.tensors[name]
            data = t.materialize(c.graph.weights)
            w.add_tensor(name, t.dtype, t.shape, data, tile=t.file_tile, layer=t.block, expert=t.expert,
                         stage=c.stage_of[name])
            del data
            done += t.nbytes
            if progress:
                progress(done, total, name)
    size = os.path.getsize(out)
    return {"seconds": time.perf_counter() - t0, "file_bytes": size,
            "bytes_per_token": sum(s.nbytes for s in c.schedule.steps()), "tensors": len(c.order)}
