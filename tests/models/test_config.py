import pytest

from cflow.errors import ConfigError
from cflow.models import PRESETS, ModelConfig, from_preset, get_preset

BASE = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48,
            n_experts=4, top_k=2, expert_dim=16)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(n_heads=3), "n_kv_heads"),  # kv heads must divide heads
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(dense_delay=-1), "dense_delay"),
        (dict(expert_delay=4), "expert_delay"),  # delays >= n_layers
        (dict(routing="sideways"), "routing"),
        (dict(n_blocks=3), "n_blocks"),
        (dict(d_model=0), "d_model"),
        (dict(head_dim=7), "head_dim"),
        (dict(moe_layers=(9,)), "moe_layers"),
    ],
)
def test_invalid_config_names_field(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**BASE, **change})


def test_error_states_allowed_range():
    with pytest.raises(ConfigError, match=r"0\.\.3"):
        ModelConfig(**{**BASE, "expert_delay": 7})


def test_unknown_preset_and_size():
    with pytest.raises(ConfigError, match="arch9"):
        get_preset("arch9")
    with pytest.raises(ConfigError, match="huge"):
        get_preset("arch1", "huge")


def test_dict_round_trip():
    c = PRESETS["arch5_shared"]["tiny"]
    assert ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="bogus"):
        ModelConfig.from_dict({**c.to_dict(), "bogus": 1})


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_torch(name):
    m = from_preset(name, "tiny")
    assert sum(p.numel() for p in m.parameters()) == m.config.n_params()


def test_presets_share_geometry_and_differ_in_dag():
    geo = {k: v for k, v in PRESETS["arch1"]["114m"].to_dict().items()
           if k not in ("name", "dense_delay", "expert_delay", "routing", "n_blocks")}
    for name, sizes in PRESETS.items():
        d = sizes["114m"].to_dict()
        assert {k: d[k] for k in geo} == geo, name
    c = PRESETS["arch1"]["114m"]
    assert (c.d_model, c.n_layers, c.n_experts, c.top_k) == (512, 6, 8, 2)
    assert 110e6 < c.n_params() < 118e6  # ~114M, the paper's screening size


def test_from_preset_is_deterministic():
    a, b = from_preset("arch2_4_combined", "tiny", seed=3), from_preset("arch2_4_combined", "tiny", seed=3)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and (va == vb).all()


def test_evolve_keeps_unshared_models_unshared():
    c = get_preset("arch1", "tiny")
    assert c.evolve(n_layers=2).n_blocks == 2
    shared = get_preset("arch5_shared", "tiny")
    assert shared.evolve(n_layers=6).n_blocks == shared.n_blocks
