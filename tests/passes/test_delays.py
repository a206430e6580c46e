"""Delay rewrites (TVM style: before / expected, compared as printed IR)."""

import numpy as np
import pytest

from cflow.errors import PassError
from cflow.frontend import from_torch
from cflow.ir import build_graph, interpret
from cflow.models import PRESETS, from_preset, get_preset
from cflow.passes.delays import DelayRewriteWarning, dense_delay, expert_delay, routing_point, set_delays
from cflow.passes.manager import DumpIR, PassContext, Pipeline, PrintAfter, graph_pass


def body(g):
    return str(g).splitlines()[1:]  # drop the header (name, trained delays)


@pytest.mark.parametrize("size", ["tiny", "114m"])
def test_arch1_rewritten_equals_arch2_4_combined(size):
    before = build_graph(get_preset("arch1", size))
    expected = build_graph(get_preset("arch2_4_combined", size))
    with pytest.warns(DelayRewriteWarning, match="changes the model's function"):
        after = Pipeline([dense_delay(1), expert_delay(2)])(before)
    assert body(after) == body(expected)
    assert after.meta.delays == (1, 2)
    assert body(before) == body(build_graph(get_preset("arch1", size)))  # input untouched


def test_arch1_to_arch4_and_back():
    a1, a4 = build_graph(get_preset("arch1", "tiny")), build_graph(get_preset("arch4_async_experts", "tiny"))
    assert body(Pipeline([expert_delay(2), routing_point("pre")])(a1)) == body(a4)
    assert body(Pipeline([expert_delay(0), routing_point("post")])(a4)) == body(a1)


@pytest.mark.parametrize("name", list(PRESETS))
def test_rewriting_to_own_delays_is_a_noop(name, recwarn):
    g = build_graph(get_preset(name, "tiny"))
    c = g.config
    out = Pipeline(set_delays(c.dense_delay, c.expert_delay, c.routing))(g)
    assert str(out) == str(g)
    assert not [w for w in recwarn if issubclass(w.category, DelayRewriteWarning)]


def test_rewritten_graph_computes_the_delayed_model():
    m1, m2 = from_preset("arch1", "tiny"), from_preset("arch2_4_combined", "tiny")
    m2.load_state_dict(m1.state_dict())
    g = Pipeline(set_delays(1, 2))(from_torch(m1))
    import torch

    ids = np.arange(11)
    with torch.no_grad():
        ref = m2(torch.tensor(ids)).numpy()
    assert np.abs(interpret(g, ids) - ref).max() <= 1e-4


def test_out_of_range_delay():
    with pytest.raises(PassError, match="dense_delay.*0..3"):
        dense_delay(4)(build_graph(get_preset("arch1", "tiny")))


def test_pass_manager_requires_and_instruments(tmp_path):
    seen = []

    @graph_pass(name="needs_delays", requires=("expert_delay",))
    def needs(g, ctx):
        return g

    g = build_graph(get_preset("arch1", "tiny"))
    with pytest.raises(PassError, match="requires expert_delay"):
        needs(g)
    ctx = PassContext(instruments=(PrintAfter(("expert_delay",), write=seen.append), DumpIR(tmp_path)))
    out = Pipeline([expert_delay(0), needs], name="p")(g, ctx)
    assert out.meta.passes == ("expert_delay", "needs_delays")
    assert seen and seen[0].startswith("; IR after expert_delay")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_expert_delay.ir", "02_needs_delays.ir", "03_p.ir"]


def test_disabled_pass_is_skipped():
    g = build_graph(get_preset("arch1", "tiny"))
    out = Pipeline([dense_delay(1)])(g, PassContext(disabled=("dense_delay",)))
    assert out.meta.delays == (0, 0)
