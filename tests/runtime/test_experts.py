"""Only the router's top-k experts are touched: every other expert's pointer is NULL, and the step survives.

Runs in a subprocess, so a touch of an unchosen expert (a NULL dereference) fails the test instead of
the test run.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import ctypes, sys
    import numpy as np
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.ir import Interpreter
    from cflow.runtime.session import Session

    name, path = sys.argv[1], sys.argv[2]
    c = compile_file(load_graph(f"preset:{name}@tiny"), path, "q4")
    s = Session(path, threads=2)
    it = Interpreter(c.graph, act_quant="q8", kv=s.kv_dtype)  # the model's KV cache type (auto: f16 for q4)
    ref = it.prefill([17])[-1]
    chosen = {}  # weight block -> experts routed there for this token
    for n in c.graph.nodes():
        if n.kind == "router":
            block = int(n.weight.split(".")[1])
            chosen.setdefault(block, set()).update(int(e) for e in it.values[n.name][1][0])
    nulled = 0
    for i, key in enumerate(s.program.bindings):
        if key.kind == "tensor" and ".experts." in key.name:
            block, e = int(key.name.split(".")[1]), int(key.name.split(".")[4])
            if e not in chosen[block]:
                s.ptrs[i] = None
                nulled += 1
    got = s.step(17)
    assert nulled > 0
    print(nulled, float(np.abs(got - ref).max()))
''')


@pytest.mark.parametrize("name", ["arch1", "arch4_async_experts", "arch5_shared"])
def test_unchosen_experts_are_never_read(tmp_path, name):
    r = subprocess.run([sys.executable, "-c", SCRIPT, name, str(tmp_path / "m.vflow")], capture_output=True, text=True)
    assert r.returncode == 0, f"step crashed or failed (rc={r.returncode}): {r.stderr[-2000:]}"
    nulled, diff = r.stdout.split()
    assert int(nulled) > 0 and float(diff) <= 1e-2
