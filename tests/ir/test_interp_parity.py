"""The NumPy interpreter equals PipelineNativeLM: 16-token prefill then 32 decode steps, every preset."""

import numpy as np
import pytest
import torch

from cflow.frontend import from_torch
from cflow.frontend.cflow_dir import from_checkpoint
from cflow.ir import Interpreter, interpret
from cflow.models import PRESETS, from_preset
from cflow.models.checkpoint import save_checkpoint


def _reference(m, ids):
    with torch.no_grad():
        return m(torch.tensor(ids)).numpy()


@pytest.mark.parametrize("name", list(PRESETS))
def test_prefill_and_decode_match_torch(name):
    m = from_preset(name, "tiny")
    ids = np.random.default_rng(5).integers(0, m.config.vocab_size, 48)
    ref = _reference(m, ids)
    it = Interpreter(from_torch(m))
    got = [it.prefill(ids[:16])] + [it.step(int(t))[None] for t in ids[16:]]
    got = np.concatenate(got)
    assert got.shape == ref.shape == (48, m.config.vocab_size)
    assert np.abs(got - ref).max() <= 1e-4


def test_interpret_whole_sequence():
    m = from_preset("arch4_async_experts", "tiny")
    ids = np.arange(20) % m.config.vocab_size
    assert np.abs(interpret(from_torch(m), ids) - _reference(m, ids)).max() <= 1e-4


def test_checkpoint_graph_matches(tmp_path):
    m = from_preset("arch2_4_combined", "tiny", seed=4)
    save_checkpoint(m, tmp_path / "ck")
    ids = np.arange(9)
    assert np.abs(interpret(from_checkpoint(tmp_path / "ck"), ids) - _reference(m, ids)).max() <= 1e-4


def test_context_overflow_is_a_clear_error():
    from cflow.errors import CflowError

    g = from_torch(from_preset("arch1", "tiny"))
    with pytest.raises(CflowError, match="context"):
        interpret(g, np.zeros(200, dtype=np.int64))
