"""Phi-3 'longrope' past its original context (max_position_embeddings > original_max_position_embeddings).

transformers picks the factor set per forward call, by that call's length: short factors while the sequence fits in
original_max_position_embeddings, long ones (at every position) beyond. cflow picks once, statically, by the compiled
context (ir/rope.py): short for a context <= the original one, long (with a warning) beyond. So:
  - compiled within the original context, cflow equals transformers at every length it can run;
  - compiled past it, cflow equals transformers on any sequence longer than the original context, and on a shorter
    one it computes what transformers computes for that prefix of a long sequence (long factors), not what
    transformers computes for the short sequence alone (short factors).
"""

import numpy as np
import pytest

from cflow.compiler import compile_file
from cflow.frontend.hf import from_hf_dir, from_hf_module
from cflow.ir import interpret
from cflow.runtime.session import Session
from tests.frontend._models import hf_logits, hf_model, incremental

ORIG, MAX = 16, 64
_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
         "long_factor": [2.0, 3.0, 4.0, 6.0], "original_max_position_embeddings": ORIG}  # no 'factor': MAX / ORIG


def _phi3():
    return hf_model("phi3", max_position_embeddings=MAX, original_max_position_embeddings=ORIG, rope_parameters=_ROPE)


IDS = np.random.default_rng(11).integers(0, 256, 24)


def test_within_the_original_context_short_factors_equal_transformers(recwarn):
    net = _phi3()
    g = from_hf_module(net, max_seq_len=ORIG)
    assert not [w for w in recwarn if "longrope" in str(w.message)]
    ids = IDS[:ORIG]  # up to the boundary: transformers still uses the short factors at length == ORIG
    assert np.abs(incremental(g, ids, 6) - hf_logits(net, ids)).max() <= 1e-4  # prefill 6, decode 10


def test_past_the_original_context_long_factors_at_every_position(tmp_path):
    net = _phi3()
    net.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="longrope uses its long factors at every position for a context of 64"):
        g = from_hf_dir(tmp_path)
    assert g.config.max_seq_len == MAX
    long = hf_logits(net, IDS)  # 24 > ORIG tokens: transformers uses the long factors at every position
    assert np.abs(incremental(g, IDS, 10) - long).max() <= 1e-4  # prefill 10, decode 14 (past ORIG)
    # The documented difference: a 12-token sequence gets the long factors too (== the prefix of the long call),
    # where transformers alone on those 12 tokens would use the short ones.
    short = interpret(g, IDS[:12])
    assert np.abs(short - long[:12]).max() <= 1e-4
    assert np.abs(short - hf_logits(net, IDS[:12])).max() > 1e-2
    compile_file(g, tmp_path / "m.vflow", "f32")  # and the runtime's RoPE tables are the long ones too
    with Session(str(tmp_path / "m.vflow"), threads=2) as s:
        got = np.stack([s.prefill(IDS[:10])] + [s.step(int(t)).copy() for t in IDS[10:]])
    assert np.abs(got - long[9:]).max() <= 1e-4


# transformers keeps the short set in the module's inv_freq buffer until a forward call longer than the
# original context swaps in the long one: a fresh module compiled past its original context must still be read
# (frontend/hf.py's _check_rotary accepts either set; it once refused this).
def test_a_fresh_module_compiles_past_the_original_context():
    net = _phi3()  # never run: its buffer holds the short set
    with pytest.warns(UserWarning, match="longrope uses its long factors"):
        g = from_hf_module(net)
    assert g.config.max_seq_len == MAX
    assert np.abs(interpret(g, IDS) - hf_logits(net, IDS)).max() <= 1e-4  # the long factors, as transformers
