"""Each gate activation through every body on every ISA path, with activations of order 1.

Random models at default init hide a wrong activation: logits are nearly flat and a SiLU computed where tanh-GELU
was meant moves them by less than a loose tolerance. Here the FFN weights are scaled so the gate pre-activations
are of order 1..4, where the two functions differ by up to 0.2; the prompt (19 tokens, one block) is longer than
every token group (8 on AVX-512, 4 on AVX-VNNI and AVX2), so it runs full groups of the multi-token kernel and
its tail; and the kernels are built for each ISA path this host can run (CFLOW_FEATURES / CFLOW_CPU), not only
its best one.
The test first shows that it can see the difference: the interpreter with the other activation is off by far
more than the tolerance.
"""

import attrs
import numpy as np
import pytest
import torch

from cflow.codegen.target import ISA
from cflow.compiler import compile_file
from cflow.frontend import from_torch
from cflow.ir import Interpreter
from cflow.runtime.session import Session
from tests._isa import isa_env, isa_target
from tests.frontend._models import hf_model

FAMILIES = {"llama": "silu", "gemma": "gelu_tanh"}
# Float weights: only the summation order differs from the interpreter, so the tolerance is tight (relative to the
# logits' spread) and a wrong activation (0.2-0.5 of it) is far outside. The integer kernels' gate (the same code
# after the tile-row sums) is checked against NumPy on every ISA in tests/codegen/test_matmat.py: here an int8
# rounding flip would blur the comparison.
TOL = {"f32": 1e-4, "f16": 1e-4}


def _strong(family):
    """The family's tiny model with FFN weights scaled by 3: gate pre-activations of order 1..4."""
    net = hf_model(family)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "mlp" in name and p.ndim == 2:
                p.mul_(3.0)
    return net


# family x weight type x ISA path as a Latin square: on every path each activation runs (one family each) and each
# weight type runs (one family each), and each family runs each weight type on two paths. The gate's code is the
# same for both float weight types (it follows the tile-row sums), and each path's f16 and f32 kernels are each
# other's only through the loads, so the square reaches every (path, activation) and (path, weight type) pair
# with half the programs to JIT of the full cube (one whole prefill program per cell: ~2-5 s of CPU).
SQUARE = [(family, quant, path) for i, path in enumerate(ISA) for j, family in enumerate(FAMILIES)
          for quant in [list(TOL)[(i + j) % 2]]]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(family, quant) -> (its CompiledModel, its file), compiled on first use."""
    done = {}

    def get(family, quant):
        if family not in done:
            g = from_torch(_strong(family))
            assert g.config.activation == FAMILIES[family]
            done[family] = (g, tmp_path_factory.mktemp(family))
        if (family, quant) not in done:
            g, d = done[family]
            done[family, quant] = (compile_file(g, d / f"{quant}.vflow", quant), d / f"{quant}.vflow")
        return done[family, quant]

    return get


def _other(graph):
    """The same graph with the other gate activation on every FFN node."""
    other = "silu" if graph.config.activation == "gelu_tanh" else "gelu_tanh"
    g = graph.copy()
    for n in list(g.nodes()):
        if hasattr(n, "act"):
            g.replace(attrs.evolve(n, act=other))
    return g


@pytest.mark.parametrize("family, quant, path", SQUARE, ids=[f"{f}-{q}-{p}" for f, q, p in SQUARE])
def test_activation_on_every_path(compiled, family, quant, path, monkeypatch):
    if isa_target(path) is None:
        pytest.skip(f"this host cannot run the {path} kernels")
    for var, value in isa_env(path).items():
        monkeypatch.setenv(var, value)
    c, file = compiled(family, quant)
    ids = np.random.default_rng(11).integers(0, c.graph.config.vocab_size, 19 + 4)
    ref = Interpreter(c.graph).prefill(ids)
    bad = Interpreter(_other(c.graph)).prefill(ids)
    scale = float(ref.std())
    assert np.abs(bad - ref).max() > 1000 * TOL[quant] * scale  # the test can tell the two activations apart
    with Session(str(file), threads=2, prefill_block=19, kv="f32") as s:
        assert s.target.isa == path, (s.target.describe(), path)
        prompt = s.prefill(ids[:19], all_logits=True)  # every position: the full token groups' own outputs too
        got = np.stack([s.step(int(t)).copy() for t in ids[19:]])  # then the decode body
    assert np.abs(prompt - ref[:19]).max() <= TOL[quant] * scale, (family, quant, path)
    assert np.abs(got - ref[19:]).max() <= TOL[quant] * scale, (family, quant, path)
