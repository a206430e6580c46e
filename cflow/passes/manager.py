"""A small pass manager: named graph passes, pipelines that are passes too, a context with instruments.

    @graph_pass(name="fuse_swiglu", requires=("expert_delay",))
    def fuse_swiglu(g, ctx): ...
    Pipeline([dense_delay(1), expert_delay(2)], name="delays")(graph)

A graph pass takes a Graph and returns a (new or the same) Graph; a state pass (`@state_pass`) takes
and returns a CompileState (passes/state.py): the packing plan, the schedule, the file and the native
step are lowering passes too. Neither mutates its input. Failures read "pass X failed (after: a, b): ...".
Instruments (PrintAfter, DumpIR, Timing) never touch what they see. `PassContext.verify_each` (on with
--debug) runs the verifier after every pass; pipelines always verify their result once.
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs

from ..errors import CflowError, PassError
from ..ir import Graph, verify


class Instrument:
    def before(self, pass_: Pass, g: Graph, ctx: PassContext) -> None:
        pass

    def after(self, pass_: Pass, g: Graph, ctx: PassContext) -> None:
        pass


@attrs.define
class PrintAfter(Instrument):
    """Print the IR after the named passes (all passes if names is empty)."""

    names: tuple[str, ...] = ()
    write: Callable[[str], None] = print

    def after(self, pass_, g, ctx):
        if not self.names or pass_.name in self.names:
            self.write(f"; IR after {pass_.name}\n{g}")


@attrs.define
class DumpIR(Instrument):
    """Write `NN_passname.ir` into a directory after every pass."""

    directory: str | os.PathLike
    count: int = 0

    def after(self, pass_, g, ctx):
        self.count += 1
        d = Path(self.directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{self.count:02d}_{pass_.name}.ir").write_text(str(g))


@attrs.define
class Timing(Instrument):
    """Wall time per pass name (nested pipelines included: a stack of start times)."""

    times: dict[str, float] = attrs.Factory(dict)
    _starts: list[float] = attrs.Factory(list)

    def before(self, pass_, g, ctx):
        self._starts.append(time.perf_counter())

    def after(self, pass_, g, ctx):
        self.times[pass_.name] = self.times.get(pass_.name, 0.0) + time.perf_counter() - self._starts.pop()

    def table(self) -> str:
        return "\n".join(f"{t * 1e3:10.1f} ms  {name}" for name, t in self.times.items())


_current: contextvars.ContextVar[PassContext | None] = contextvars.ContextVar("cflow_pass_context", default=None)


@attrs.frozen
class PassContext:
    """Options for a pipeline run; use as `with PassContext(...):` or pass explicitly."""

    options: dict = attrs.field(factory=dict)
    disabled: tuple[str, ...] = ()
    instruments: tuple[Instrument, ...] = ()
    verify_each: bool = False  # verify after every pass (cflowc --debug); the lowering verifies its result

    def __enter__(self) -> PassContext:
        object.__setattr__(self, "_token", _current.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)

    @staticmethod
    def current() -> PassContext:
        return _current.get() or PassContext()


class Pass:
    """A named transform of a Graph (`on="graph"`) or of a CompileState (`on="state"`).

    `requires` lists passes that must have run earlier. A graph pass run on a CompileState applies
    to its graph, so one pipeline carries a model from the delay rewrites down to the written file.
    """

    def __init__(self, fn: Callable, name: str, requires: Sequence[str] = (), on: str = "graph"):
        if on not in ("graph", "state"):
            raise ValueError(f"pass {name}: on must be 'graph' or 'state', not {on!r}")
        self.fn, self.name, self.requires, self.on = fn, name, tuple(requires), on

    def __call__(self, unit, ctx: PassContext | None = None):
        return run_passes([self], unit, ctx)

    def apply(self, unit, ctx: PassContext):
        """Run this pass once on a Graph or a CompileState (no bookkeeping; see run_passes)."""
        from .state import CompileState

        if isinstance(unit, CompileState):
            if self.on == "graph":
                return unit.evolve(graph=self.fn(unit.graph, ctx))
            return self.fn(unit, ctx)
        if self.on == "state":
            raise PassError(f"pass {self.name} lowers a compile state, not a bare graph")
        return self.fn(unit, ctx)

    def __repr__(self) -> str:
        return f"<Pass {self.name}>"


def graph_pass(name: str | None = None, requires: Sequence[str] = ()):
    """Decorator: `def f(g, ctx) -> Graph` becomes a Pass named `name` (default: the function's name)."""

    def wrap(fn):
        return Pass(fn, name or fn.__name__, requires, on="graph")

    return wrap


def state_pass(name: str | None = None, requires: Sequence[str] = ()):
    """Decorator: `def f(state, ctx) -> CompileState` becomes a lowering Pass (plan, schedule, file, code)."""

    def wrap(fn):
        return Pass(fn, name or fn.__name__, requires, on="state")

    return wrap


class Pipeline(Pass):
    """A sequence of passes, itself a pass, so pipelines nest."""

    def __init__(self, passes: Iterable[Pass], name: str = "pipeline"):
        self.passes = list(passes)
        super().__init__(lambda unit, ctx: run_passes(self.passes, unit, ctx), name,
                         on="state" if any(p.on == "state" for p in self.passes) else "graph")

    def apply(self, unit, ctx: PassContext):
        return run_passes(self.passes, unit, ctx)


def _done(unit) -> tuple[str, ...]:
    return unit.passes if hasattr(unit, "passes") else unit.meta.passes


def _record(unit, name: str):
    """Append a pass name to the unit's history (the state's, and its graph's for graph passes)."""
    from .state import CompileState

    if isinstance(unit, CompileState):
        return unit.evolve(passes=unit.passes + (name,))
    unit.meta.passes = unit.meta.passes + (name,)
    return unit


def verify_unit(unit) -> None:
    """The IR verifier on a graph; on a state, also the lowering's own invariants."""
    from .state import CompileState

    if isinstance(unit, CompileState):
        unit.verify()
    else:
        verify(unit)


def run_passes(passes: Sequence[Pass], unit, ctx: PassContext | None = None):
    """Run passes in order on a Graph or CompileState: requirements, instruments, per-pass verification."""
    ctx = ctx or PassContext.current()
    for p in passes:
        if p.name in ctx.disabled:
            continue
        done = _done(unit)
        missing = [r for r in p.requires if r not in done]
        if missing:
            raise PassError(f"pass {p.name} requires {', '.join(missing)} to run first "
                            f"(after: {', '.join(done) or 'none'})")
        for ins in ctx.instruments:
            ins.before(p, unit, ctx)
        try:
            out = p.apply(unit, ctx)
            if out is None:
                raise PassError(f"pass {p.name} returned nothing")
            if ctx.verify_each and not isinstance(p, Pipeline):
                verify_unit(out)
        except PassError:
            raise
        except CflowError as e:
            raise PassError(f"pass {p.name} failed (after: {', '.join(done) or 'none'}): {e}") from e
        if not isinstance(p, Pipeline):
            out = _record(out, p.name)
        for ins in ctx.instruments:
            ins.after(p, out, ctx)
        unit = out
    return unit
