"""NativeStep on its own: built once, bound once, then stepped; the pointer table holds what bind() was given.

A Session drives the same object (Session.native), so the step run by hand here must give the session's logits
bit for bit."""

import ctypes

import numpy as np
import pytest

from cflow.codegen.abi import Binding, Param
from cflow.compiler import compile_file
from cflow.errors import RuntimeFault
from cflow.frontend.load import load_graph
from cflow.passes.pipeline import plan_from_header
from cflow.runtime.format import FileReader
from cflow.runtime.native_step import NativeStep
from cflow.runtime.session import Session

MAX_SEQ = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("native") / "arch1.vflow")
    compile_file(load_graph("preset:arch1@tiny"), path, "q4")
    return path


def _native(path, threads):
    reader = FileReader(path)
    state = plan_from_header(reader.header, path)
    step = NativeStep(state, reader.header, max_seq=MAX_SEQ, tmax=1, kv="f32", n_slots=1, threads=threads)
    return reader, step


def _decode(step, token, pos):
    step.params[Param.TOKEN], step.params[Param.POS] = token, pos
    step.run()
    return step.logits_view.copy()


@pytest.mark.parametrize("threads", [1, 2])
def test_build_bind_step_twice_as_the_session(tiny, threads):
    reader, step = _native(tiny, threads)
    with step:
        assert step.ptrs is None and step.workers is None
        with pytest.raises(RuntimeFault, match="before its buffers were bound"):
            step.run()
        step.bind(reader.tensor)
        assert (step.workers is not None) == (threads > 1)
        got = [_decode(step, 3, 0), _decode(step, 5, 1)]
        with pytest.raises(RuntimeFault, match="already bound"):
            step.bind(reader.tensor)
    assert step.workers is None  # closed
    with Session(tiny, threads=threads, max_seq=MAX_SEQ, prefill_block=1, kv="f32") as s:
        assert s.program.bindings == step.program.bindings and s._pool is s.native.workers
        want = [s.step(3).copy(), s.step(5).copy()]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not np.array_equal(got[0], got[1])  # the second step saw the first's KV entries


def test_pointer_table_holds_what_bind_was_given(tiny):
    reader, step = _native(tiny, 1)
    later = next(k.name for k in step.program.bindings if k.kind == Binding.TENSOR)
    with step:
        step.bind(lambda name: None if name == later else reader.tensor(name))
        for i, key in enumerate(step.program.bindings):
            if key.kind == Binding.TENSOR:
                assert step.ptr_index[key.name] == i
                want = None if key.name == later else reader.tensor(key.name).ctypes.data
                assert step.ptrs[i] == want  # ctypes reads a NULL entry back as None
        kv = step.program.bindings.index(next(k for k in step.program.bindings if k.kind == Binding.KV))
        assert step.ptrs[kv] == step.kv.ctypes.data
        addr = reader.tensor(later).ctypes.data
        step.point(later, addr)
        assert step.ptrs[step.ptr_index[later]] == addr
        assert ctypes.cast(step.args[0], ctypes.c_void_p).value == ctypes.addressof(step.ptrs)
