"""A benchmark's worker in a fresh Python process (its own peak RSS, an empty cache, another cflow tree)."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

from . import ROOT


def module_command(module: str, *args) -> list[str]:
    """The command that runs `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


def package_dir(tree: str) -> str:
    """A directory holding only `tree`'s cflow package (a symlink to it), for the front of a child's path: a whole
    checkout there (`git worktree add`, `git archive | tar -x`) would also put its own `benchmarks` first, and the
    child would run the old tree's benchmark code. Named after the tree, so made once and kept."""
    tree = os.path.abspath(tree)
    if not os.path.isdir(os.path.join(tree, "cflow")):
        raise SystemExit(f"{tree} holds no cflow package (expected a cflow checkout)")
    d = os.path.join(tempfile.gettempdir(), "cflow-tree-" + hashlib.sha1(tree.encode()).hexdigest()[:12])
    link = os.path.join(d, "cflow")
    if not os.path.islink(link):
        os.makedirs(d, exist_ok=True)
        try:
            os.symlink(os.path.join(tree, "cflow"), link)
        except FileExistsError:  # another process made it meanwhile
            pass
    return d


def child_env(tree: str | None = None, **overrides: str) -> dict[str, str]:
    """This process's environment for a child that imports `benchmarks` from this repository and cflow from
    `tree` when given (another cflow checkout: its package alone first on the path, package_dir), else from this
    repository. The working directory is not put on the child's path (PYTHONSAFEPATH), so a tree's cflow is not
    shadowed by the one in the directory the benchmark was started from."""
    env = dict(os.environ, **overrides)
    first = package_dir(tree) if tree else None
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first, ROOT, os.environ.get("PYTHONPATH")) if p)
    env["PYTHONSAFEPATH"] = "1"
    return env
