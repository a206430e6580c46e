"""The lowering pipeline, read as steps: delays -> quantise -> pack -> schedule -> file order.

`lower` turns a Graph into a planned CompileState (no weight bytes touched); the front door
(cflow/compiler.py) appends the file emission pass, the runtime the native-step pass.
`plan_from_header` rebuilds the plan a file's header claims, so the runtime can check the file
against it without importing the compiler front door.
"""

from __future__ import annotations

from ..errors import CflowError, FormatError, UnsupportedModelError
from ..ir import Graph, build_graph
from ..ir.config import ModelConfig
from ..layout.packed import FileLayout
from ..layout.tile import DEFAULT_TILE
from .delays import set_delays
from .manager import Pass, PassContext, Pipeline
from .order import order_tensors
from .pack import plan_packing
from .quantize import STORED, quantize_weights
from .schedule import schedule_stages
from .state import CompileState

# Every pass a compile can run, in pipeline order (cflowc --print-after NAME).
PASS_NAMES = ("dense_delay", "expert_delay", "routing_point", "quantize_weights", "plan_packing", "schedule_stages",
              "order_tensors", "emit_step", "emit_file")


def native_gaps(c: ModelConfig) -> list[str]:
    """What the native runtime (codegen) cannot run yet in a model the IR and the interpreter do model.

    The one list to shorten as the kernels learn ops; empty today, since every variant ModelConfig accepts is
    compiled: RoPE scaling, partial rotary and Gemma 3's local RoPE base live in the RoPE tables the session
    computes (ir/rope.py); q/k norms, the attention soft-cap and the sliding window in the attention core
    (codegen/attention.py:attention); both gate activations (ir.config.ACTIVATIONS) in every gate_up kernel; post
    norms in the residual adds; the final soft-cap in the head step (tests/runtime/test_families.py)."""
    gaps: list[str] = []
    return gaps


def check_native(graph_or_config, where: str | None = None) -> None:
    """Raise UnsupportedModelError naming what the native runtime lacks (see native_gaps)."""
    c = getattr(graph_or_config, "config", graph_or_config)
    gaps = native_gaps(c)
    if gaps:
        name = where or getattr(graph_or_config, "name", None) or c.name
        raise UnsupportedModelError(
            f"{name}: {'; '.join(gaps)}: not yet supported by the native runtime (the IR and the interpreter "
            "model it: `cflowc MODEL --emit ir`, cflow.ir.interpret)")


def lowering(quant: str = "q4", delays: tuple[int, int] | None = None, dtypes: dict | None = None) -> Pipeline:
    """The passes from a frontend's graph to a planned state (dtypes: a header's weight_dtypes, for "stored")."""
    passes: list[Pass] = []
    if delays is not None:
        passes += set_delays(*delays)  # before quantisation: a rewrite changes no weight
    passes += [
        quantize_weights(quant, dtypes),  # storage type per weight (lazy: quantised when written)
        plan_packing,  # which tensors the file holds: needs the dtypes
        schedule_stages,  # stages and buffers: needs each step's tensors and bytes
        order_tensors,  # file order: needs the stage that first streams each tensor
    ]
    return Pipeline(passes, name="lower")


def lower(graph: Graph, quant: str = "q4", tile=DEFAULT_TILE, delays: tuple[int, int] | None = None,
          layout: str | FileLayout = FileLayout.VFLOW, ctx: PassContext | None = None,
          dtypes: dict | None = None) -> CompileState:
    """Run the lowering passes (no weights touched); the result is verified once."""
    check_native(graph)
    state = lowering(quant, delays, dtypes)(CompileState(graph=graph, tile=tile, layout=layout), ctx)
    state.verify()
    return state


def plan_from_header(h: dict, path: str) -> CompileState:
    """The plan a file header claims (config -> IR -> lowering), to check the file against.

    Raises FormatError naming the file when the header does not describe a valid model, and
    UnsupportedModelError when it describes one the native runtime cannot run yet.
    """
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except CflowError as e:
        raise FormatError(f"{path}: header does not describe a valid model: {e}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"{path}: header field missing or malformed: {type(e).__name__}: {e}") from None
    check_native(cfg, path)
    try:
        g = build_graph(cfg, None, name=h.get("name", cfg.name),
                        trained_delays=tuple(h.get("trained_delays", cfg.delays)))
        dtypes = h.get("weight_dtypes") if h["quant"] == STORED else None
        if h["quant"] == STORED and not isinstance(dtypes, dict):
            raise FormatError(f"{path}: header field weight_dtypes missing: a file compiled as stored needs it")
        return lower(g, h["quant"], tuple(h["tile"]), None, dtypes=dtypes)
    except CflowError as e:
        raise FormatError(f"{path}: header does not describe a valid model: {e}") from None
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise FormatError(f"{path}: header field missing or malformed: {type(e).__name__}: {e}") from None
