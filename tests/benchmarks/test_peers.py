"""benchmarks.peers helpers that need neither llama.cpp nor ONNX Runtime GenAI (no timing asserted)."""

import numpy as np
import pytest

from benchmarks import peers
from benchmarks.common import models, timing


@pytest.mark.parametrize("loads, attempts, kept", [([0.0], 1, 0.0), ([0.5, 0.3, 0.05], 3, 0.05),
                                                    ([0.5, 0.2, 0.3], 3, 0.2), ([0.4, 0.08, 0.0], 2, 0.08)])
def test_measure_quiet_repeats_while_loaded(monkeypatch, loads, attempts, kept):
    seq = iter(loads)
    calls = []

    def fake(fn):
        calls.append(1)
        return fn(), next(seq)

    monkeypatch.setattr(timing, "busy_fraction", fake)
    v, busy, n = timing.measure_quiet(lambda: len(calls), threshold=0.10, retries=2)
    assert (busy, n, len(calls)) == (kept, attempts, attempts)
    assert v == loads.index(kept) + 1


class _FakeSession:
    """Logits peaked at token (13 * position + 5) % V (position = tokens seen), runner-up 1 below."""

    V = 50

    def reset(self):
        self.pos = 0

    def _logits(self):
        lg = np.zeros(self.V, np.float32)
        lg[(13 * self.pos + 5) % self.V] = 2.0
        lg[(13 * self.pos + 6) % self.V] = 1.0
        return lg

    def prefill(self, ids):
        self.pos = len(ids)
        return self._logits()

    def step(self, t):
        self.pos += 1
        return self._logits()


class _FakeLlama:
    """The same rule, except at position `flip`, where it picks the runner-up."""

    def __init__(self, flip):
        self.flip, self.pos = flip, 0

    def reset(self):
        self.pos = 0

    def eval(self, ids):
        self.pos += len(ids)

    def next(self):
        return (13 * self.pos + (6 if self.pos == self.flip else 5)) % _FakeSession.V


def test_greedy_agreement_counts(monkeypatch):
    monkeypatch.setattr(peers, "llama_next", lambda llm: llm.next())
    m = type("M", (), {"session": _FakeSession()})()
    prompt = [3, 4]
    a = peers.greedy_agreement(m, _FakeLlama(flip=len(prompt) + 4), prompt, steps=20)
    assert a["cflow_tokens"] == [(13 * (len(prompt) + i) + 5) % 50 for i in range(20)]
    assert (a["prefix_agree"], a["total_agree"], a["forced_agree"]) == (4, 19, 19)
    assert a["margin_at_divergence"] == 1.0 and a["forced_disagree_margins"] == [1.0]
    b = peers.greedy_agreement(m, _FakeLlama(flip=-1), prompt, steps=20)
    assert (b["prefix_agree"], b["total_agree"], b["margin_at_divergence"]) == (20, 20, None)


def test_ort_bytes_per_token_counts_matmulnbits(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    n, k, block = 64, 128, 32
    inits = [numpy_helper.from_array(np.zeros((n, k // block, block // 2), np.uint8), "B"),
             numpy_helper.from_array(np.zeros((n, k // block), np.float32), "S"),
             numpy_helper.from_array(np.zeros((n, k // block // 2), np.uint8), "Z"),
             numpy_helper.from_array(np.zeros((n, 16), np.float32), "W"),
             numpy_helper.from_array(np.zeros((1000, k), np.float32), "E")]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"]),
             helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                              block_size=block),
             helper.make_node("MatMul", ["y", "W"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 16])], initializer=inits)
    onnx.save(helper.make_model(g), str(tmp_path / "model.onnx"))
    got = peers.ort_genai_bytes_per_token(str(tmp_path))
    assert got["matmulnbits_nodes"] == 1
    assert (got["int4_weights"], got["scales"], got["zero_points"]) == (n * k // 2, n * k // block * 4, n * 2)
    assert got["float_matmul_weights"] == n * 16 * 4
    assert got["total"] == n * k // 2 + n * k // block * 4 + n * 2 + n * 16 * 4  # the embedding is not counted


def test_interp_check_compares_steps_with_one_prefill():
    """interp_check: the runtime's per-step logits against the interpreter's prefill of the same ids, on the
    lowered Q4 graph; here the "runtime" is a second interpreter stepping token by token (same arithmetic)."""
    from cflow.compiler import lower
    from cflow.ir import Interpreter, build_graph
    from cflow.ir.config import ModelConfig

    cfg = ModelConfig(name="tiny_interp", vocab_size=64, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1,
                      n_experts=4, top_k=2, expert_dim=64, max_seq_len=16)
    c = lower(build_graph(cfg, models.LazyWeights(cfg), name=cfg.name), "q4")

    class Stepper:
        def reset(self):
            self.it = Interpreter(c.graph, act_quant="q8", cache_weights=False)

        def prefill(self, ids):
            return self.it.prefill(ids)[-1]

        def step(self, t):
            return self.it.step(t)

    class M:
        session = Stepper()

    ck = peers.interp_check(M(), c, [3, 9, 27, 17, 51])
    assert ck["positions"] == 5 and ck["argmax_agree"] == 5 and ck["max_abs_diff"] < 1e-3 * max(ck["logit_std"], 1)
