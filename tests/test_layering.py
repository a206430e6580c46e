"""Data flows one way: importing an early stage must not load a later one (nor torch)."""

import subprocess
import sys

import pytest

CHECKS = {
    "cflow.ir": ("cflow.passes", "cflow.codegen", "cflow.runtime", "cflow.frontend", "torch"),
    "cflow.passes": ("cflow.codegen", "cflow.runtime", "torch"),
    "cflow.models": ("torch",),
}


@pytest.mark.parametrize("mod", list(CHECKS))
def test_no_later_stage_imported(mod):
    code = f"import sys, {mod}; bad = [m for m in {CHECKS[mod]!r} if m in sys.modules]; print(','.join(bad))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"importing {mod} loaded {out}"
