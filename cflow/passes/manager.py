"""A small pass manager: named graph passes, pipelines that are passes too, a context with instruments.

    @graph_pass(name="fuse_swiglu", requires=("expert_delay",))
    def fuse_swiglu(g, ctx): ...
    Pipeline([dense_delay(1), expert_delay(2)], name="delays")(graph)

A pass takes a Graph and returns a (new or the same) Graph; it never mutates its input. Failures
read "pass X failed (after: a, b): ...". Instruments (PrintAfter, DumpIR, Timing) never touch the graph.
"""

from __future__ import annotations

import contextvars
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import attrs

from ..errors import CflowError, PassError
from ..ir import Graph, verify


class Instrument:
    def before(self, pass_: "Pass", g: Graph, ctx: "PassContext") -> None:
        pass

    def after(self, pass_: "Pass", g: Graph, ctx: "PassContext") -> None:
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
    times: dict[str, float] = attrs.Factory(dict)
    _t0: float = 0.0

    def before(self, pass_, g, ctx):
        self._t0 = time.perf_counter()

    def after(self, pass_, g, ctx):
        self.times[pass_.name] = self.times.get(pass_.name, 0.0) + time.perf_counter() - self._t0


_current: contextvars.ContextVar["PassContext | None"] = contextvars.ContextVar("cflow_pass_context", default=None)


@attrs.frozen
class PassContext:
    """Options for a pipeline run; use as `with PassContext(...):` or pass explicitly."""

    options: dict = attrs.field(factory=dict)
    disabled: tuple[str, ...] = ()
    instruments: tuple[Instrument, ...] = ()
    verify_each: bool = True

    def __enter__(self) -> "PassContext":
        object.__setattr__(self, "_token", _current.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)

    @staticmethod
    def current() -> "PassContext":
        return _current.get() or PassContext()


class Pass:
    """A named graph transform. `requires` lists passes that must have run earlier in the pipeline."""

    def __init__(self, fn: Callable[[Graph, PassContext], Graph], name: str, requires: Sequence[str] = ()):
        self.fn, self.name, self.requires = fn, name, tuple(requires)

    def __call__(self, g: Graph, ctx: PassContext | None = None) -> Graph:
        return run_passes([self], g, ctx)

    def __repr__(self) -> str:
        return f"<Pass {self.name}>"


def graph_pass(name: str | None = None, requires: Sequence[str] = ()):
    """Decorator: `def f(g, ctx) -> Graph` becomes a Pass named `name` (default: the function's name)."""

    def wrap(fn):
        return Pass(fn, name or fn.__name__, requires)

    return wrap


class Pipeline(Pass):
    """A sequence of passes, itself a pass, so pipelines nest."""

    def __init__(self, passes: Iterable[Pass], name: str = "pipeline"):
        self.passes = list(passes)
        super().__init__(lambda g, ctx: run_passes(self.passes, g, ctx, nested=True), name)


def run_passes(passes: Sequence[Pass], g: Graph, ctx: PassContext | None = None, nested: bool = False) -> Graph:
    ctx = ctx or PassContext.current()
    done: list[str] = list(g.meta.get("passes", ())) if not nested else list(g.meta.get("passes", ()))
    for p in passes:
        if p.name in ctx.disabled:
            continue
        missing = [r for r in p.requires if r not in done]
        if missing:
            raise PassError(f"pass {p.name} requires {', '.join(missing)} to run first (after: {', '.join(done) or 'none'})")
        for ins in ctx.instruments:
            ins.before(p, g, ctx)
        try:
            out = p.fn(g, ctx)
            if ctx.verify_each and not isinstance(p, Pipeline):
                verify(out)
        except PassError:
            raise
        except CflowError as e:
            raise PassError(f"pass {p.name} failed (after: {', '.join(done) or 'none'}): {e}") from e
        if out is None:
            raise PassError(f"pass {p.name} returned no graph")
        if not isinstance(p, Pipeline):
            done.append(p.name)
            out.meta["passes"] = tuple(done)
        else:
            done = list(out.meta.get("passes", done))
        for ins in ctx.instruments:
            ins.after(p, out, ctx)
        g = out
    return g
