import json

import pytest

from cflow.ir import build_graph
from cflow.models import PRESETS, get_preset
from cflow.passes.analysis import analyze


def test_arch1_is_strictly_sequential():
    a = analyze(build_graph(get_preset("arch1", "114m")))
    assert a.critical_bytes == a.sequential_bytes
    assert f"{a.reduction:.2f}" == "1.00"
    assert a.table().splitlines()[-1] == "critical-path reduction: 1.00x"


@pytest.mark.parametrize("name", list(PRESETS))
def test_bounds_and_only_topk_experts(name):
    g = build_graph(get_preset(name, "114m"))
    a = analyze(g, "q4")
    assert 0 < a.critical_bytes <= a.sequential_bytes
    c = g.config
    moe = [op for op in a.ops if op["kind"] == "experts"]
    assert len(moe) == c.n_layers  # arch5's shared blocks count once per execution
    assert moe[0]["bytes"] == c.top_k * 3 * c.d_model * c.expert_dim * 18 // 32


def test_delays_shorten_the_path():
    a1 = analyze(build_graph(get_preset("arch1", "114m")))
    a2 = analyze(build_graph(get_preset("arch2_4_combined", "114m")))
    assert a2.sequential_bytes == a1.sequential_bytes
    assert a2.critical_bytes < a1.critical_bytes


def test_json_lets_anyone_recompute_the_path():
    a = analyze(build_graph(get_preset("arch2_4_combined", "114m")))
    d = json.loads(a.to_json())
    ops = {o["name"]: o for o in d["ops"]}
    best = {}
    for o in d["ops"]:  # already in topological order
        best[o["name"]] = o["bytes"] + max((best[i] for i in o["inputs"] if i in best), default=0)
    assert max(best.values()) == d["critical_bytes"]
    assert sum(o["bytes"] for o in ops.values()) == d["sequential_bytes"]
    assert abs(d["reduction"] - d["sequential_bytes"] / d["critical_bytes"]) < 1e-6


def test_quant_scales_bytes():
    g = build_graph(get_preset("arch1", "tiny"))
    assert analyze(g, "f32").sequential_bytes > analyze(g, "q8").sequential_bytes > analyze(g, "q4").sequential_bytes
