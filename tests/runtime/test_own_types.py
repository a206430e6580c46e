"""cflow's own block types (IQ4_128, IQ4_192, Q3_128, Q3_192: layout/blocks.py) through a whole model, the
user's path: a float model's matrices quantised to them (passes/mix.apply_types, as `cflowc --bpw` writes a mix),
compiled to a file, loaded with cflow.load, against the interpreter's twin on the same stored weights (prompt blocks
longer than every token group, then decode)."""

import numpy as np

import cflow
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.layout.blocks import OWN_TYPES
from cflow.layout.quant import DType
from cflow.models.bundled import default_model_dir
from cflow.passes import mix as M
from cflow.passes.quantize import STORED, fit_tile


def test_own_types_run_as_their_twin(tmp_path):
    g = load_graph(str(default_model_dir()))
    # the bundled model is 128, 192 and 256 wide: a 192-input type where a row takes it, a 128-input one elsewhere;
    # the 4-bit code book in even layers and the embedding, 3-bit codes in odd layers (a fused stream: one type)
    def own(n):
        q3 = n.startswith("blocks.") and int(n.split(".")[1]) % 2 == 1
        if g.meta.shapes[n][1] % 128:
            return DType.Q3_192 if q3 else DType.IQ4_192
        return DType.Q3_128 if q3 else DType.IQ4_128

    types = {n: own(n) for n in M.matrices(g)}
    assert set(types.values()) == set(OWN_TYPES)
    q = M.apply_types(g, types, M.column_weights(g, {}))
    out = str(tmp_path / "own.vflow")
    compile_file(q, out, STORED, fit_tile(q), tokenizer=g.meta.tokenizer)
    with cflow.load(out, threads=2, kv="f32", prefill_block=9) as m:
        tensors = m.session.run_state.tensors
        assert {t.dtype for t in tensors.values() if t.form.is_tiled} == set(OWN_TYPES)
        ids = list(np.random.default_rng(1).integers(3, m.config.vocab_size, 26))
        got = np.concatenate([m.session.prefill(ids[:20], all_logits=True)]
                             + [m.session.step(int(t))[None].copy() for t in ids[20:]])
        ref = Interpreter(m.ir, act_quant="q8").prefill(ids)
    err = np.abs(got - ref).max(axis=1) / ref.std()
    assert np.median(err) <= 1e-4 and err.max() <= 0.1, err
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1 * ref.std()
    assert np.array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
