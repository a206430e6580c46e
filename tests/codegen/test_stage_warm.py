"""Warming the next stage's weights before a barrier (codegen/step.py: _Emitter.warm_stream) is schedule only.

With CFLOW_STAGE_WARM=N (off by default: no gain measured), every stage that is followed by a dense weight stream
ends with prefetches of this thread's first N bytes of it; nothing else changes, so a model decodes bit-identically
with it off, on, or at another size, at 1 and 2 threads, dense and MoE (the experts' stages warm nothing: which
experts run is known only after routing).
"""

import numpy as np
import pytest

from cflow.codegen.step import DEFAULT_STAGE_WARM, stage_warm_bytes
from cflow.compiler import compile_file
from cflow.errors import CodegenError
from cflow.frontend.load import load_graph
from cflow.runtime.session import Session


@pytest.fixture(scope="module", params=["arch1", "arch2_4_combined", "arch4_async_experts"])
def path(request, tmp_path_factory):
    p = tmp_path_factory.mktemp("warm") / f"{request.param}.vflow"
    compile_file(load_graph(f"preset:{request.param}@tiny"), p, "q4")
    return p


def _decode(path, threads: int, monkeypatch, warm: str | None):
    if warm is None:
        monkeypatch.delenv("CFLOW_STAGE_WARM", raising=False)
    else:
        monkeypatch.setenv("CFLOW_STAGE_WARM", warm)
    with Session(str(path), threads=threads, cache=False) as s:
        ir_text = s.program.module if isinstance(s.program.module, str) else str(s.program.module)
        out = [s.prefill([5, 9, 2, 7]).copy()]
        for _ in range(6):
            out.append(s.step(int(np.argmax(out[-1]))).copy())
        return np.stack(out), ir_text, s.warm


@pytest.mark.parametrize("threads", [1, 2])
def test_warming_changes_no_logit(path, threads, monkeypatch):
    off, ir_off, w_off = _decode(path, threads, monkeypatch, None)
    on, ir_on, w_on = _decode(path, threads, monkeypatch, "32768")
    big, _, w_big = _decode(path, threads, monkeypatch, "131072")
    assert (w_off, w_on, w_big) == (DEFAULT_STAGE_WARM, 32768, 131072) and DEFAULT_STAGE_WARM == 0
    assert "warm.head" in ir_on and "warm.head" not in ir_off  # the prefetch loops are there, or not
    assert np.array_equal(off, on) and np.array_equal(off, big)


@pytest.mark.parametrize("text", ["abc", "-64", "100", str(1 << 30)])
def test_a_bad_warm_size_is_refused(text, monkeypatch):
    monkeypatch.setenv("CFLOW_STAGE_WARM", text)
    with pytest.raises(CodegenError, match="CFLOW_STAGE_WARM"):
        stage_warm_bytes()
