import pytest
import torch

from cflow.models import PRESETS, from_preset
from cflow.models.checkpoint import load_checkpoint, save_checkpoint


@pytest.mark.parametrize("name", list(PRESETS))
def test_incremental_decode_equals_full_forward(name):
    m = from_preset(name, "tiny")
    ids = torch.randint(0, m.config.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(ids)
        cache: list = []
        parts = [m(ids[:10], cache)] + [m(ids[t : t + 1], cache) for t in range(10, 24)]
    assert torch.allclose(torch.cat(parts), full, atol=1e-5)


def test_delays_change_the_function():
    a, b = from_preset("arch1", "tiny"), from_preset("arch2_4_combined", "tiny")
    b.load_state_dict(a.state_dict())  # same weights, different DAG
    ids = torch.arange(12)
    with torch.no_grad():
        assert not torch.allclose(a(ids), b(ids), atol=1e-4)


def test_expert_delay_flushes_pending_outputs():
    # With de = n_layers - 1 every expert output but the first is flushed before the final norm.
    m = from_preset("arch1", "tiny")
    c = m.config.evolve(expert_delay=3)
    m2 = type(m)(c)
    m2.load_state_dict(m.state_dict())
    with torch.no_grad():
        out = m2(torch.arange(5))
    assert torch.isfinite(out).all()


def test_checkpoint_round_trip(tmp_path):
    m = from_preset("arch5_shared", "tiny", seed=2)
    save_checkpoint(m, tmp_path / "ck", tokenizer_json='{"x": 1}')
    m2 = load_checkpoint(tmp_path / "ck")
    ids = torch.arange(7)
    with torch.no_grad():
        assert torch.equal(m(ids), m2(ids))
    assert (tmp_path / "ck" / "tokenizer.json").read_text() == '{"x": 1}'
