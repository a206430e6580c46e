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


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("warm")
    out = {}
    for preset in ("arch1", "arch4_async_experts"):
        out[preset] = d / f"{preset}.vflow"
        compile_file(load_graph(f"preset:{preset}@tiny"), out[preset], "q4")
    return out


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


# (each case JIT-builds two programs without the cache: a dense model at 1 and 2 threads, the MoE one at 2)
@pytest.mark.parametrize("preset,threads,warm", [("arch1", 1, "32768"), ("arch1", 2, "131072"),
                                                 ("arch4_async_experts", 2, "32768")])
def test_warming_changes_no_logit(files, preset, threads, warm, monkeypatch):
    off, ir_off, w_off = _decode(files[preset], threads, monkeypatch, None)
    on, ir_on, w_on = _decode(files[preset], threads, monkeypatch, warm)
    assert (w_off, w_on) == (DEFAULT_STAGE_WARM, int(warm)) and DEFAULT_STAGE_WARM == 0
    assert "warm.head" in ir_on and "warm.head" not in ir_off  # the prefetch loops are there, or not
    assert np.array_equal(off, on)


@pytest.mark.parametrize("text", ["abc", "-64", "100", str(1 << 30)])
def test_a_bad_warm_size_is_refused(text, monkeypatch):
    monkeypatch.setenv("CFLOW_STAGE_WARM", text)
    with pytest.raises(CodegenError, match="CFLOW_STAGE_WARM"):
        stage_warm_bytes()
