"""Data flows one way: every stage imports only from the stages below it (docs/ARCHITECTURE.md).

    layout -> ir -> passes -> codegen -> runtime        frontend -> ir;  models -> ir (models only above ir)
    errors, util: anyone.  api (+ chatting), compiler, cli, serve: the front doors, anything.

Checked two ways: statically (every import statement of every module, lazy ones inside functions
included) and dynamically (importing an early stage in a fresh process loads no later one, nor torch).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cflow"
BASE = {"errors", "util", "__init__", "__version__"}  # cflow/errors.py, cflow/util.py, cflow/__init__ (version)
ALLOWED = {
    "layout": set(),
    "ir": {"layout"},
    "models": {"ir", "layout"},
    "frontend": {"ir", "layout", "models"},
    "passes": {"ir", "layout"},
    "codegen": {"passes", "ir", "layout"},
    "runtime": {"codegen", "passes", "ir", "layout"},
}
FRONT_DOORS = {"api", "chatting", "compiler", "cli", "serve"}


def _stage(module: str) -> str | None:
    """'cflow.passes.pack' -> 'passes'; 'cflow' -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[int, str]]:
    pkg = ".".join(("cflow",) + path.relative_to(ROOT).with_suffix("").parts)
    if path.name == "__init__.py":
        pkg = pkg.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("cflow")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("cflow"):
                if mod == "cflow":  # `from cflow import x` / `from .. import x`: the names are modules
                    out += [(node.lineno, f"cflow.{a.name}") for a in node.names]
                else:
                    out.append((node.lineno, mod))
    return out


def _modules():
    return sorted(p for p in ROOT.rglob("*.py"))


def test_every_stage_imports_only_from_below():
    bad = []
    for path in _modules():
        rel = path.relative_to(ROOT)
        src = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"
        if src in FRONT_DOORS or src in BASE:
            continue
        assert src in ALLOWED, f"{rel}: stage {src!r} is not in the layering table (add it to ALLOWED and docs)"
        for line, mod in _imports(path):
            dst = _stage(mod)
            if dst == src or dst in BASE or dst in ALLOWED[src]:
                continue
            bad.append(f"{rel}:{line} imports {mod} ({src} -> {dst})")
    assert not bad, "imports against the one-way order:\n" + "\n".join(bad)


DYNAMIC = {
    "cflow.layout": ("cflow.ir", "cflow.passes", "cflow.codegen", "cflow.runtime", "cflow.frontend", "torch"),
    "cflow.ir": ("cflow.passes", "cflow.codegen", "cflow.runtime", "cflow.frontend", "cflow.models", "torch"),
    "cflow.passes.pipeline": ("cflow.codegen", "cflow.runtime", "cflow.frontend", "torch", "llvmlite"),
    "cflow.codegen.step": ("cflow.runtime", "cflow.frontend", "torch"),
    "cflow.runtime.session": ("cflow.frontend", "cflow.compiler", "cflow.api", "torch"),
    "cflow.models": ("torch", "cflow.passes", "cflow.codegen", "cflow.runtime"),
}


@pytest.mark.parametrize("mod", list(DYNAMIC))
def test_no_later_stage_loaded(mod):
    code = f"import sys, {mod}; bad = [m for m in {DYNAMIC[mod]!r} if m in sys.modules]; print(','.join(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {mod} loaded {out}"
