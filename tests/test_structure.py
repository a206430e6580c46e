"""Size limits that keep the code readable: no function in cflow/ over 150 lines, no class over 400.

Checked with ast on every module (nested functions and methods included), counting a definition from its
`def` / `class` line to its last line, docstring and comments included. Offenders are named file:line.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "cflow"
MAX_FUNCTION_LINES = 150
MAX_CLASS_LINES = 400


def _definitions():
    """(path relative to the repository, line, kind, name, lines) of every function and class in cflow/."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield rel, node.lineno, "function", node.name, node.end_lineno - node.lineno + 1
            elif isinstance(node, ast.ClassDef):
                yield rel, node.lineno, "class", node.name, node.end_lineno - node.lineno + 1


def _over(kind: str, limit: int) -> list[str]:
    return [f"{rel}:{line} {name}: {n} lines" for rel, line, k, name, n in _definitions() if k == kind and n > limit]


def test_definitions_are_found():  # the walk sees methods and nested functions, not only top-level ones
    found = {(str(rel), kind, name) for rel, _, kind, name, _ in _definitions()}
    assert ("cflow/compiler.py", "function", "compile_file") in found
    assert ("cflow/layout/tile.py", "class", "TileLayout") in found
    assert ("cflow/passes/manager.py", "function", "after") in found  # a method
    assert ("cflow/runtime/emit.py", "function", "run") in found  # nested in emit_file


def test_no_function_over_150_lines():
    bad = _over("function", MAX_FUNCTION_LINES)
    assert not bad, f"functions over {MAX_FUNCTION_LINES} lines (split them by what they do):\n" + "\n".join(bad)


def test_no_class_over_400_lines():
    bad = _over("class", MAX_CLASS_LINES)
    assert not bad, f"classes over {MAX_CLASS_LINES} lines (split them by what they hold):\n" + "\n".join(bad)
