"""Write tests/golden/tiny_q4.vflow and tiny_q4.json: a small model file of the format as it is today.

    python tests/golden/make_golden_vflow.py        # only when deliberately adding a new golden file

tests/runtime/test_golden.py loads the committed file on every run, so a change that stops files written
by an earlier cflow from loading is noticed. Never regenerate the committed file to make that test pass:
either keep old files loading, or bump PLAN_VERSION / VERSION (cflow/runtime/format/spec.py), keep the old
golden file as one that must fail with "recompile with cflowc", and add a new one next to it.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from cflow.compiler import compile_file  # noqa: E402
from cflow.ir import Interpreter, build_graph  # noqa: E402
from cflow.ir.build import weight_shapes  # noqa: E402
from cflow.ir.config import ModelConfig  # noqa: E402

# Experts, both delays, grouped-query attention, an untied head: the plan's every section is exercised.
CONFIG = ModelConfig(name="golden_tiny", vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                     head_dim=16, ffn_dim=32, n_experts=2, top_k=1, expert_dim=32, max_seq_len=32,
                     dense_delay=1, expert_delay=1)
PROMPT = [1, 5, 9, 2, 63]


def main() -> None:
    rng = np.random.default_rng(2026)
    weights = {n: (0.3 * rng.standard_normal(s)).astype(np.float32) if len(s) > 1 else
               (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in weight_shapes(CONFIG).items()}
    g = build_graph(CONFIG, weights)
    path = os.path.join(HERE, "tiny_q4.vflow")
    state = compile_file(g, path, "q4", (16, 32), None, "vflow", None, [0])
    ref = Interpreter(state.graph, act_quant="q8").run(PROMPT)[-1]  # the stored (quantised) weights
    with open(os.path.join(HERE, "tiny_q4.json"), "w") as f:
        json.dump({"prompt": PROMPT, "tile": [16, 32], "quant": "q4",
                   "interpreter_logits": [round(float(x), 7) for x in ref]}, f, indent=1)
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
