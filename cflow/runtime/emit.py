"""File emission as the lowering's last pass: the planned state's tensors, packed and streamed to disk.

Input: a CompileState after order_tensors (graph with weights). Output: the .vflow/.cflow file
(atomic: complete or absent) and `state.file` with its size and bytes per token. Tensors are
quantised and packed in PACK_WORKERS background threads, the next ones while the current one is checksummed
and written (util.prefetch_map, in file order), so memory stays near PACK_WORKERS + 1 tensors (the largest
ones) and the packing overlaps the disk: generating and packing a Q4 tensor costs more CPU per byte than
writing it, so one thread would leave the disk waiting (docs/expert-tier.md, the writer's table). Q4 tile-rows
are packed by codegen/q4pack.py's native loop (imported here, it plugs itself into layout.tile), the NumPy
packer's bytes at 2-3x its speed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..codegen import q4pack  # noqa: F401  (sets layout.tile.Q4_BAND_PACKER: the native Q4 packer)
from ..layout import STORED
from ..passes.manager import Pass, state_pass
from ..passes.state import CompileState
from ..util import prefetch_map, small_pages, usable_cpus
from .format import FileWriter
from .format.spec import FORMAT_NAME

PACK_WORKERS = 2  # threads packing ahead of the writer (fewer on a machine with fewer CPUs)
PACK_AHEAD = 64 << 20  # bytes of packed tensors queued ahead of the writer at most (beyond the workers' own)


def header_for(state: CompileState, tokenizer: str | None, eos: list[int] | None) -> dict:
    """The file header: config, delays, quantisation, tile, packing plan, schedule, tokenizer, chat template."""
    g = state.graph
    m = g.meta
    return {
        "format": FORMAT_NAME,
        "name": g.name,
        "config": g.config.to_dict(),
        "delays": list(m.delays),
        "trained_delays": list(m.trained_delays),
        "routing": m.routing,
        "quant": STORED if m.stored else m.quant.label,
        "tile": list(state.tile),
        "weight_dtypes": {n: d.label for n, d in m.weight_dtypes.items()},
        "packing": {n: t.to_json() for n, t in state.tensors.items()},
        "schedule": state.schedule.to_json(),
        "tokenizer": tokenizer,
        "eos_token_ids": list(eos or []),
        "chat_template": m.chat_template,  # {"template", "bos_token", "eos_token"} or None (runtime/chat.py)
        "special_tokens": m.special_tokens,  # {"bos", "eos", "add_bos", "add_eos", "source"} or None (tokenizer.py)
        **({"quant_mix": m.quant_mix} if m.quant_mix else {}),  # the chosen types and their errors (passes/mix.py)
    }


def packed_tensors(state: CompileState, workers: int | None = None):
    """(name, stored bytes) of every tensor of the plan in file order, made ahead by `workers` threads
    (default: PACK_WORKERS, at most the usable CPUs)."""
    workers = min(PACK_WORKERS, usable_cpus()) if workers is None else workers
    weights = state.graph.weights

    def pack(name: str):
        return name, state.tensors[name].materialize(weights)

    with small_pages():  # arrays made once, touched once: no huge pages to compact for (util.small_pages)
        yield from prefetch_map(pack, state.order, workers=workers, name="cflow-pack",
                                size=lambda n: state.tensors[n].nbytes, ahead_bytes=PACK_AHEAD)


def emit_file(out: str | os.PathLike, tokenizer: str | None = None, eos: list[int] | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> Pass:
    """Quantise, pack and stream every tensor of the plan into `out` in file order."""

    @state_pass(name="emit_file", requires=("order_tensors",))
    def run(state: CompileState, ctx) -> CompileState:
        t0 = time.perf_counter()
        total = sum(state.tensors[n].nbytes for n in state.order)
        done = 0
        with FileWriter(out, header_for(state, tokenizer, eos), layout=str(state.layout)) as w:
            for name, data in packed_tensors(state):  # the next tensors packed while this one is written
                t = state.tensors[name]
                w.add_tensor(name, t.file_dtype, t.shape, data, tile=t.file_tile, layer=t.block, expert=t.expert,
                             stage=state.stage_of[name])
                del data
                done += t.nbytes
                if progress:
                    progress(done, total, name)
        info = {"path": os.fspath(out), "seconds": time.perf_counter() - t0, "file_bytes": os.path.getsize(out),
                "bytes_per_token": state.bytes_per_token, "tensors": len(state.order)}
        return state.evolve(file=info)

    return run
