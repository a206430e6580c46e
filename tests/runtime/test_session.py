"""The compiled runtime equals the NumPy interpreter on the same quantised weights.

F32/F16: float summation order only (<= 1e-4). Q4/Q8: the interpreter emulates the kernels' int8
activation blocks (act_quant='q8'); a rare rounding flip of one activation code (its input differs in
the last float bit) moves logits by ~1e-3, hence 1e-2 there. 1 and 2 threads are bit-identical.
"""

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.models import PRESETS
from cflow.runtime.session import Session

TOL = {"f32": 1e-4, "f16": 1e-4, "q8": 1e-2, "q4": 1e-2}


def compiled(tmp_path, name, quant, layout="vflow"):
    path = tmp_path / f"{name}_{quant}.{layout}"
    c = compile_file(load_graph(f"preset:{name}@tiny"), path, quant)
    return c, path


@pytest.mark.parametrize("quant", ["f32", "q4"])
@pytest.mark.parametrize("name", list(PRESETS))
def test_runtime_matches_interpreter(tmp_path, name, quant):
    c, path = compiled(tmp_path, name, quant)
    ids = np.random.default_rng(7).integers(0, c.graph.config.vocab_size, 16 + 64)
    outs, ref = {}, None
    for threads in (1, 2):
        # blocks of 16, tests/runtime/test_prefill.py's (its q4 programs are these): the prompt is one full block
        s = Session(str(path), threads=threads, prefill_block=16)
        if ref is None:  # the twin with the model's KV cache type (kv='auto': f16 for q4, f32 for f32)
            it = Interpreter(c.graph, act_quant="q8" if quant in ("q4", "q8") else None, kv=s.kv_dtype)
            ref = np.concatenate([it.prefill(ids[:16])[-1:]] + [it.step(int(t))[None] for t in ids[16:]])
        got = [s.prefill(ids[:16])] + [s.step(int(t)).copy() for t in ids[16:]]
        s.close()
        outs[threads] = np.stack(got)
    assert np.array_equal(outs[1], outs[2]), "1 and 2 threads must give identical logits"
    assert np.abs(outs[1] - ref).max() <= TOL[quant]


@pytest.mark.parametrize("quant", ["q8", "f16"])
def test_other_dtypes(tmp_path, quant):
    c, path = compiled(tmp_path, "arch2_4_combined", quant)
    ids = np.arange(20) % 256
    s = Session(str(path), threads=2, prefill_block=16)  # a full block and a tail; test_prefill's f16 program
    ref = Interpreter(c.graph, act_quant="q8" if quant == "q8" else None, kv=s.kv_dtype).prefill(ids)[-1]
    assert np.abs(s.prefill(ids) - ref).max() <= TOL[quant]


def test_cflow_and_vflow_decode_identically(tmp_path):
    _, pv = compiled(tmp_path, "arch4_async_experts", "q4", "vflow")
    _, pc = compiled(tmp_path, "arch4_async_experts", "q4", "cflow")
    ids = [5, 9, 200, 3, 3, 7]
    a, b = Session(str(pv), threads=1), Session(str(pc), threads=1)
    assert np.array_equal(a.prefill(ids), b.prefill(ids))


def test_context_limit_is_a_clear_error(tmp_path):
    from cflow.errors import RuntimeFault

    _, path = compiled(tmp_path, "arch1", "q4")
    s = Session(str(path), threads=1, max_seq=8, prefill_block=1)  # (the check comes before any call)
    with pytest.raises(RuntimeFault, match="does not fit the context"):
        s.prefill(list(range(9)))
    with pytest.raises(RuntimeFault, match="out of range"):
        s.step(10_000)
