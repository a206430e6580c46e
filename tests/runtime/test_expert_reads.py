"""A prompt block reads each chosen expert once, however many of its tokens chose it; decode reads it per token.

A profiling build counts, per layer and expert, the tile-rows every mat-vec / mat-mat call over that expert's
matrices reads (codegen/moe.py:count_expert_rows; each thread adds its share, atomically). After one block of
T prompt tokens, an expert any token chose must show exactly one pass (all its tile-rows once) of gate_up and of
down, an expert nobody chose none; token by token, one pass per token that chose it. Which tokens chose what is
the interpreter's routing on the same weights.
"""

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.passes.pack import expert_tensor
from cflow.runtime.session import Session, resolve_kv
from tests._shared import SMALL_TILE

T = 24


@pytest.fixture(scope="module", params=["arch1", "arch4_async_experts"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("reads") / f"{request.param}.vflow"
    # 32-row tiles (tests/_shared.py): the reads are counted in tile-rows, whatever their height
    c = compile_file(load_graph(f"preset:{request.param}@tiny"), path, "q4", SMALL_TILE)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, c.graph.config.vocab_size, T)]
    it = Interpreter(c.graph, act_quant="q8", kv=resolve_kv("auto", "q4"))  # the routes the sessions below take
    it.prefill(ids)
    choices = {}  # layer -> experts chosen by each token [T][k]
    for n in c.graph.nodes():
        if n.kind == "router":
            choices[n.layer] = np.asarray(it.values[n.name][1]).reshape(T, -1)
    return path, ids, choices


def _passes(s, layer: int, which: int) -> np.ndarray:
    """Whole passes over each expert's matrix (gate_up 0, down 1) the counters show for a layer."""
    bank = next(n for n in s.compiled.graph.nodes() if n.kind == "experts" and n.layer == layer)
    rows = s.compiled.tensors[expert_tensor(bank.prefix, 0, ("w_gate_up", "w_down")[which])].layout.n_tile_rows
    got = s.expert_rows[layer, :, which]
    assert (got % rows == 0).all(), "a pass that did not cover every tile-row once"
    return got // rows


@pytest.mark.parametrize("threads", [1, 2])
def test_a_block_reads_each_chosen_expert_once(model, threads):
    path, ids, choices = model
    with Session(str(path), threads=threads, profile=True, prefill_block=T) as s:
        s.prefill(ids)
        assert s.tmax == T
        for layer, chose in choices.items():
            want = np.zeros(s.config.n_experts, np.int64)
            want[np.unique(chose)] = 1
            assert (want == 0).any() or len(np.unique(chose)) == s.config.n_experts
            for which in (0, 1):
                assert np.array_equal(_passes(s, layer, which), want), (layer, which)


def test_token_by_token_reads_an_expert_per_token_that_chose_it(model):
    path, ids, choices = model
    with Session(str(path), threads=2, profile=True, prefill_block=1) as s:
        s.prefill(ids)
        for layer, chose in choices.items():
            want = np.bincount(chose.reshape(-1), minlength=s.config.n_experts)
            for which in (0, 1):
                assert np.array_equal(_passes(s, layer, which), want), (layer, which)
