"""The delay passes on the Hugging Face families issue 12 added: each rewrite warns that it changes the function,
the rewritten IR verifies, and the native runtime (a file compiled with delays=(dd, de)) equals the interpreter on
the rewritten graph. Three layers, so that dd=1 and de=2 both fit (delays range over 0..n_layers-1)."""

import warnings

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend import from_torch
from cflow.ir import Interpreter, interpret, verify
from cflow.passes.delays import DelayRewriteWarning, dense_delay, expert_delay, set_delays
from cflow.passes.manager import Pipeline
from cflow.runtime.session import Session
from tests._shared import SMALL_TILE
from tests.frontend._models import hf_model

# family -> the delays it can take: a dense delay moves a dense FFN's input, an expert delay an MoE output, so a
# dense-only family takes only dd, an MoE-only one (OLMoE) only de, one with both kinds of layer (Qwen3-MoE) both.
DELAYS = {"qwen3": (1, 0), "phi3": (1, 0), "gemma2": (1, 0), "granite": (1, 0), "olmoe": (0, 2), "qwen3_moe": (1, 2)}


def _run(it_or_session, ids, k):
    if isinstance(it_or_session, Interpreter):
        return np.concatenate([it_or_session.prefill(ids[:k])[-1:]] + [it_or_session.step(int(t))[None]
                                                                        for t in ids[k:]])
    return np.stack([it_or_session.prefill(ids[:k])] + [it_or_session.step(int(t)).copy() for t in ids[k:]])


@pytest.mark.parametrize("family", list(DELAYS))
def test_delayed_family_runtime_matches_interpreter(tmp_path, family):
    dd, de = DELAYS[family]
    g = from_torch(hf_model(family, num_hidden_layers=3))
    with pytest.warns(DelayRewriteWarning, match="changes the model's function"):
        out = Pipeline(set_delays(dd, de))(g)
    verify(out)
    assert out.meta.delays == (dd, de) and out.config.delays == (dd, de)
    ids = np.random.default_rng(8).integers(0, g.config.vocab_size, 18 + 6)
    ref = _run(Interpreter(out), ids, 18)
    changed = np.abs(ref - _run(Interpreter(g), ids, 18)).max()
    path = tmp_path / "m.vflow"
    with pytest.warns(DelayRewriteWarning, match="changes the model's function"):
        # the path the user takes (cflow.compile(m, delays=...)), with 32-row tiles: the delays are the subject
        c = compile_file(g, path, "f32", SMALL_TILE, delays=(dd, de))
    assert c.graph.meta.delays == (dd, de)
    # a prompt of 18 in blocks of 9: full token groups of the multi-token kernels on every ISA (8 or 4) and tails
    with Session(str(path), threads=2, prefill_block=9) as s:
        assert tuple(s.header["delays"]) == (dd, de)
        got = _run(s, ids, 18)
    err = np.abs(got - ref).max()
    assert err <= 1e-4 * max(1.0, float(np.abs(ref).max()))
    # and the runtime computes the rewritten function, not the original one: the rewrite moved the logits by far
    # more than the runtime's error (least on Granite, whose residual multiplier of 0.22 damps it: ~1e-3)
    assert changed > 10 * err


@pytest.mark.parametrize("family, rewrite", [("qwen3", expert_delay(2)), ("olmoe", dense_delay(1))],
                         ids=["dense-only:expert_delay", "moe-only:dense_delay"])
def test_delay_of_a_kind_the_family_lacks_leaves_the_function(family, rewrite):
    """An expert delay on a model without experts (or a dense delay without dense FFNs) has nothing to move: it is
    accepted, the IR verifies and computes exactly what the model did (only the recorded delays change)."""
    g = from_torch(hf_model(family, num_hidden_layers=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DelayRewriteWarning)
        out = Pipeline([rewrite])(g)
    verify(out)
    ids = np.random.default_rng(9).integers(0, g.config.vocab_size, 10)
    assert np.array_equal(interpret(out, ids), interpret(g, ids))
