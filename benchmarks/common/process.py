"""A benchmark's worker in a fresh Python process (its own peak RSS, an empty cache, another cflow tree)."""

from __future__ import annotations

import os
import sys

from . import ROOT


def module_command(module: str, *args) -> list[str]:
    """The command that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def child_env(tree: str | None = None, **overrides: str) -> dict[str, str]:
    """This process's environment for a child that imports `benchmarks` from this repository and cflow from
    `tree` when given (another cflow checkout, first on the path), else from this repository. The working
    directory is not put on the child's path (PYTHONSAFEPATH), so a tree's cflow is not shadowed by the one in
    the directory the benchmark was started from."""
    env = dict(os.environ, **overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, ROOT, os.environ.get("PYTHONPATH")) if p)
    env["PYTHONSAFEPATH"] = "1"
    return env
