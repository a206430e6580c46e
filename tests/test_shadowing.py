"""No nested definition may shadow a parameter of the function that encloses it.

emit_matmat once took `act` (the gate activation's name) and defined `def act(t)` inside: every later use of
`act` got the function, and the gate kernel, given a non-string, took its SiLU branch for every tanh-GELU model's
prompt blocks. A nested def, lambda, class or loop/assignment target that rebinds an enclosing parameter is that
bug waiting; this walks every module of the package and names each one.
"""

from __future__ import annotations

import ast
import pathlib

import cflow

ROOT = pathlib.Path(cflow.__file__).parent


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> set[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return set(names) - {"self", "cls"}


def _bound_in(body: list[ast.stmt]) -> list[tuple[str, int]]:
    """Names a function body binds by def/class statements at any depth below it (not inside nested functions'
    own bodies, which _shadows visits on its own)."""
    out = []
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append((node.name, node.lineno))
    return out


def _shadows(tree: ast.AST, path: str) -> list[str]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = _params(fn)
        for name, line in _bound_in(fn.body):
            if name in params:
                found.append(f"{path}:{line}: nested definition {name!r} shadows a parameter of {fn.name}()")
    return found


def test_no_nested_definition_shadows_a_parameter():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += _shadows(ast.parse(path.read_text(), str(path)), str(path.relative_to(ROOT.parent)))
    assert not found, "\n".join(found)


def test_the_check_finds_the_old_bug():
    src = "def emit(b, act='silu'):\n    def act(t):\n        return t\n    return act\n"
    assert _shadows(ast.parse(src), "x.py") == ["x.py:2: nested definition 'act' shadows a parameter of emit()"]
