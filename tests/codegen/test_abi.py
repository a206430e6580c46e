"""The native ABI is defined once (codegen/abi.py); the emitter and the runtime driver both follow it."""

import re
from pathlib import Path

import numpy as np

from cflow.codegen import abi
from cflow.codegen.step import StepProgram, build_step
from cflow.codegen.target import host_target
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.passes.schedule import Pool
from cflow.runtime.session import Session

ROOT = Path(__file__).resolve().parents[2] / "cflow"


def test_words_fit_their_blocks_on_separate_cache_lines():
    assert max(abi.Param) < abi.PARAM_WORDS
    assert max(abi.BarrierWord) < abi.BARRIER_WORDS and max(abi.CtlWord) < abi.CTL_WORDS
    assert abi.BarrierWord.COUNT * 4 // 64 != abi.BarrierWord.GENERATION * 4 // 64
    assert abi.CtlWord.GO * 4 // 64 != abi.CtlWord.STOP * 4 // 64
    # the finished step's word (written by a worker, polled by the joiner) on a line of its own
    assert abi.CtlWord.DONE * 4 // 64 not in (abi.CtlWord.GO * 4 // 64, abi.CtlWord.STOP * 4 // 64)


def test_no_abi_literals_outside_abi():
    """A bare index into params / ctl / barrier anywhere but abi.py would be a second definition."""
    pat = re.compile(r"\b(params|ctl|barrier|bar)\[\s*\d")
    for path in list((ROOT / "runtime").rglob("*.py")) + list((ROOT / "codegen").rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not pat.search(line), f"{path.relative_to(ROOT)}:{i}: {line.strip()}"


def test_emitter_and_driver_agree(tmp_path):
    path = tmp_path / "m.vflow"
    state = compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4")
    prog = build_step(state, host_target().isa, 64, tmax=64)
    text = str(prog.module)
    for sym in (abi.STEP_SYMBOL, abi.WORKER_SYMBOL, abi.KICK_SYMBOL, abi.JOIN_SYMBOL):
        assert f'define void @"{sym}"' in text
    assert all(isinstance(k.kind, abi.Binding) for k in prog.bindings)
    back = StepProgram.from_meta(text, prog.meta())  # the program cache's round trip
    assert back.bindings == prog.bindings and back.scratch == prog.scratch and back.pool_slots == prog.pool_slots
    with Session(str(path), threads=2, max_seq=64, cache=False) as s:
        assert s.params.size == abi.PARAM_WORDS and s.barrier.size == abi.BARRIER_WORDS
        assert s._pool.ctl.size == abi.CTL_WORDS
        assert set(s.pools) == set(prog.pool_strides) and all(isinstance(p, Pool) for p in s.pools)
        assert s.program.bindings == prog.bindings
        logits = s.step(3)
        assert s.params[abi.Param.TOKEN] == 3 and s.params[abi.Param.POS] == 0
        assert np.isfinite(logits).all()
