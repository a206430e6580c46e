"""GGUF files compiled as stored, the user's path: `cflow.compile("m.gguf")` keeps every tensor's type, the file holds
the GGUF's bytes (none padded), and the runtime equals the interpreter's twin (blocks.matvec_twin) on the stored
weights through both bodies (a prompt in blocks longer than every token group, then decode).

Per-position agreement is to float rounding except where an int8 activation code flips on a rounding boundary
(summation order): most positions are bit-for-bit or 1e-4 close, the rest within a few percent, and the greedy
choice agrees wherever the twin's top-2 margin is clear.
"""

import re

import numpy as np
import pytest

import cflow
from cflow.ir import Interpreter
from cflow.layout import blocks as B
from cflow.layout.quant import DType
from tests.runtime._gguf_blocks import write_llama

pytest.importorskip("gguf")

ROLES = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _compile(path):
    """What cflow.compile / cflowc do with a GGUF (stored types, a tile dividing every width), without loading."""
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.passes.quantize import default_quant, fit_tile

    g = load_graph(str(path))
    out = str(path) + ".vflow"
    compile_file(g, out, default_quant(g), fit_tile(g), tokenizer=g.meta.tokenizer)
    return out


def _check(path, prompt: int = 20, steps: int = 6, block: int = 9, activations: str = "q8"):
    with cflow.load(_compile(path), threads=2, kv="f32", prefill_block=block, activations=activations) as m:
        assert m.session.header["quant"] == "stored"
        ids = list(np.random.default_rng(1).integers(3, m.config.vocab_size, prompt + steps))
        got = np.concatenate([m.session.prefill(ids[:prompt], all_logits=True)]
                             + [m.session.step(int(t))[None].copy() for t in ids[prompt:]])
        ref = Interpreter(m.ir, act_quant=activations).prefill(ids)
    err = np.abs(got - ref).max(axis=1) / ref.std()
    # two-plane codes sit on a 256x finer grid: a 1-ulp difference upstream flips one 256x as often, by 1/256 as much
    assert np.median(err) <= (1e-4 if activations == "q8" else 5e-4) and err.max() <= 0.1, err
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.1 * ref.std()
    assert np.array_equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    return m


TYPES = [DType.Q4, DType.Q8, *(d for d in B.FORMATS if d not in B.OWN_TYPES)]  # GGUF holds cflow's own types not
# The roles a type can hold on its own: the embedding (tied head), the QKV stream, the output projection, the fused
# gate+up and the down projection. Three models hold every type at least once, each type in one role: a model's JIT
# costs about the same whatever its types, and each type's kernels are checked on every ISA path in
# tests/codegen/test_blockdot.py (the embedding lookup included), so one model per type repeated that work.
GROUPS = (("token_embd",), ("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
MIXES = [tuple(TYPES[(k * len(GROUPS) + j) % len(TYPES)] for j in range(len(GROUPS)))
         for k in range(-(-len(TYPES) // len(GROUPS)))]


def test_the_mixes_hold_every_type():
    assert {dt for mix in MIXES for dt in mix} == set(TYPES)


@pytest.mark.parametrize("mix", MIXES, ids=["-".join(d.gguf_name for d in mix) for mix in MIXES])
def test_every_type_compiles_as_stored_and_runs(tmp_path, mix):
    """Decode body only (prefill_block 1): each type's mat-mat equals its mat-vec bit for bit
    (tests/codegen/test_blockdot.py), and the mixed model below runs both bodies."""
    path = write_llama(tmp_path / "m.gguf", {role: dt for group, dt in zip(GROUPS, mix) for role in group}, layers=1)
    m = _check(path, prompt=8, steps=4, block=1)
    tensors = m.session.run_state.tensors
    assert {t.dtype for n, t in tensors.items() if t.form.is_tiled} == set(mix)
    assert tensors["tok_embeddings"].dtype == mix[0]
    assert "lm_head" not in tensors and tensors["tok_embeddings"].form.is_tiled  # one embedding, shared by the head


def test_a_k_quant_mix_like_llama_cpp_q4_k_m(tmp_path):
    """Q4_K with Q6_K v and down, a Q8_0 embedding and an untied Q6_K head; the QKV stream of mixed parts."""
    types = {**dict.fromkeys(ROLES, DType.Q4_K), "attn_v": DType.Q6_K, "ffn_down": DType.Q6_K,
             "token_embd": DType.Q8, "output": DType.Q6_K}
    path = write_llama(tmp_path / "m.gguf", types, tied=False)
    m = _check(path)
    t = m.session.run_state.tensors["blocks.0.attn.wqkv"]
    assert t.part_dtypes == (DType.Q4_K, DType.Q4_K, DType.Q6_K)
    assert m.session.run_state.tensors["lm_head"].dtype == DType.Q6_K


def test_the_file_holds_the_gguf_bytes(tmp_path):
    """A model whose widths are not multiples of 256 (Q5_0 rows of 640 inputs beside Q4_K rows of 1280): the tile
    chosen divides every width, so the compiled weights are the GGUF's tensor bytes, none added."""
    from cflow.frontend.gguf import GGUFFile

    types = {**dict.fromkeys(ROLES, DType.Q5_0), "ffn_down": DType.Q4_K}
    path = write_llama(tmp_path / "m.gguf", types, d=640, ffn=1280, heads=5, kv_heads=1)
    f = GGUFFile(path)
    gguf_bytes = sum(t.nbytes for t in f.tensors.values() if len(t.dims) == 2)
    m = _check(path, prompt=12, steps=2)
    s = m.session
    assert 640 % s.header["tile"][1] == 0 and 1280 % s.header["tile"][1] == 0
    stored = sum(e.nbytes for e in s.reader.tensors if len(e.shape) == 2)
    assert stored == gguf_bytes


def test_quant_flag_requantises_with_a_warning(tmp_path):
    from cflow.passes.quantize import RequantiseWarning

    path = write_llama(tmp_path / "m.gguf", dict.fromkeys(ROLES, DType.Q4_K))
    with pytest.warns(RequantiseWarning, match="Q4_K are requantised to q8"):
        m = cflow.compile(str(path), quant="q8")
    assert m.session.header["quant"] == "q8"
    m.close()


def test_a_type_not_executed_is_refused_by_tensor_and_offset(tmp_path):
    """IQ2_XXS (not executed as stored): named with its tensor, its info offset and what to do; --quant q8 compiles
    it (dequantised by gguf.quants, requantised)."""
    import gguf

    from cflow.errors import CflowError
    from cflow.frontend.load import load_graph
    from cflow.passes.pipeline import lower

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (512, 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 weights (d first)
    blocks[:, 0:2] = np.full((512, 1), 1e-3, np.float16).view(np.uint8)
    write_llama(tmp_path / "x.gguf", dict.fromkeys(ROLES, DType.Q4_K),
                raw={"blk.0.ffn_up.weight": (blocks, gguf.GGMLQuantizationType.IQ2_XXS)})
    g = load_graph(str(tmp_path / "x.gguf"))
    with pytest.raises(CflowError, match=r"tensor 'blk.0.ffn_up.weight' \(info at offset 0x[0-9a-f]+\) of .*x.gguf is "
                                         r"stored as IQ2_XXS, a type cflow does not execute as stored: compile with "
                                         r"--quant q8"):
        lower(g, "stored")
    with pytest.warns(UserWarning, match="requantised to q8"):
        lower(g, "q8")


def test_two_plane_activations_follow_the_twin(tmp_path):
    """activations='q8x2' through both bodies: two int8 planes where every reader of an activation is a 32-input type
    (a Q4_1 output projection, IQ4_NL gate+up, a Q4_0 down, the Q8_0 head), one where a K-quant reads it too (the
    QKV stream of Q5_0 q/k and a Q6_K v): the runtime equals Interpreter(act_quant='q8x2')."""
    types = {"token_embd": DType.Q8, "attn_q": DType.Q5_0, "attn_k": DType.Q5_0, "attn_v": DType.Q6_K,
             "attn_output": DType.Q4_1, "ffn_gate": DType.IQ4_NL, "ffn_up": DType.IQ4_NL, "ffn_down": DType.Q4}
    m = _check(write_llama(tmp_path / "m.gguf", types, layers=1), activations="q8x2")
    assert m.session.program.scratch.act_planes == 2
    names = re.findall(r"define internal void @\"?(?:mv|mm)_([a-z0-9_]+?)_\d+_128_256_[01](_p2)?\"?\(",
                       str(m.session.program.module))
    assert set(names) == {("q5_0", ""), ("q6_k", ""), *((t, "_p2") for t in ("q4_1", "iq4_nl", "q4", "q8"))}
