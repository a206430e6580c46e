"""cflow's own block types (IQ4_128, IQ4_192, Q3_128, Q3_192: layout/blocks.py) through a whole model, the
user's path: a float model's matrices quantised to them (passes/mix.apply_types, as `cflowc --bpw` writes a mix),
compiled to a file, loaded with cflow.load, against the interpreter's twin on the same stored weights (prompt blocks
longer than every token group, then decode)."""

import numpy as np
import pytest

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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the other types' fp16 scales overflow on such values (threads)
def test_values_beyond_the_range_or_not_finite_are_refused_and_a_mix_passes_the_type_by():
    """The 8-bit super-block scale reaches 7.5: a matrix with larger values (|x| above 960 at Q3, 30,480 at IQ4) is
    refused by name, not clipped; a mix measuring it leaves the own types out for that matrix; shapes a type cannot
    take are refused when the types are applied."""
    from cflow.errors import CflowError
    from cflow.layout import quantize_blocks as QB
    from cflow.layout.quantize_blocks import quantize_weighted

    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    for dt in OWN_TYPES:
        cols = 192 if dt in (DType.IQ4_192, DType.Q3_192) else 128
        assert quantize_weighted(x[:, :cols] * 100, dt).dequantize().any()
        with pytest.raises(ValueError, match="beyond its 8-bit super-block scale's range"):
            quantize_weighted(x[:, :cols] * 1e4, dt)
        edge = x[:, :cols].copy()  # one value just inside the range, the rest small: held, not refused
        edge[0, 0] = -0.99 * QB.own_limit(dt)
        assert abs(quantize_weighted(edge, dt).dequantize()[0, 0] - edge[0, 0]) < 0.05 * abs(edge[0, 0])
        bad = x[:, :cols].copy()
        bad[1, 3] = np.nan
        with pytest.raises(ValueError, match="finite values only"):
            quantize_weighted(bad, dt)
    g = load_graph(str(default_model_dir()))
    big = "blocks.0.ffn.w_down"
    g.weights = {**g.weights, big: np.asarray(g.weights[big], np.float32) * 1e7}
    errs = M.measure(g, M.column_weights(g, {}), sample_rows=16)
    assert not set(errs[big]) & set(OWN_TYPES) and DType.Q4 in errs[big]
    assert set(errs["blocks.0.attn.wo"]) & set(OWN_TYPES)
    with pytest.raises(CflowError, match=r"blocks.0.attn.wq: 128 inputs per row are not whole IQ4_192 blocks"):
        M.apply_types(g, {"blocks.0.attn.wq": DType.IQ4_192}, {})
