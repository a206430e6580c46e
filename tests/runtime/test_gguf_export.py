"""GGUF export (cflow.runtime.format.gguf): metadata, tensor layout, bit-identical Q4_0/Q8_0 blocks, and the
function itself: a NumPy Llama forward that reads the GGUF file the way llama.cpp does (adjacent-pair RoPE
on the permuted Q/K rows) reproduces cflow's interpreter. If llama-cpp-python is installed, llama.cpp's
own greedy tokens on the exported file equal ours."""

import json

import numpy as np
import pytest

from cflow.compiler import lower
from cflow.errors import UnsupportedModelError
from cflow.ir import Interpreter, build_graph, interpret
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.ir.gguf_names import rope_row_permutation
from cflow.layout.quant import QTensor, to_gguf_bytes
from cflow.runtime.format.gguf import export_gguf, synthetic_spm_vocab  # imports gguf lazily

gguf = pytest.importorskip("gguf")

Q = gguf.GGMLQuantizationType
DENSE = ModelConfig(name="tiny_dense", vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
# attention biases, tied embeddings, another rope base and head count: every optional path of the exporter
KNOBS = DENSE.evolve(name="tiny_knobs", n_heads=2, n_kv_heads=1, head_dim=32, attn_bias=True, tie_embeddings=True,
                     rope_theta=500000.0, norm_eps=1e-6)
# Mixtral's shape: every layer an expert bank (softmax router, top 2 of 4, renormalised), no dense FFN
MOE = DENSE.evolve(name="tiny_moe", ffn_dim=0, n_experts=4, top_k=2, expert_dim=64)


def _weights(c: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(c).items():
        if len(shape) == 1 and not name.endswith((".bq", ".bk", ".bv")):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            std = 0.5 if name in ("lm_head", "tok_embeddings") else 0.1  # spread logits: clear greedy margins
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def _lowered(c: ModelConfig, quant: str):
    return lower(build_graph(c, _weights(c), name=c.name), quant)


def _field(r, key):
    return r.fields[key].contents()


def _tensors(r) -> dict:
    return {t.name: t for t in r.tensors}


def _dense(t) -> np.ndarray:
    if t.data.ndim == 1:
        return np.asarray(t.data, dtype=np.float32)
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(*t.data.shape[:-1], -1)


def _rope_pairs(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1). x: [T, heads, hd]."""
    hd = x.shape[-1]
    theta = pos[:, None].astype(np.float64) * base ** (-np.arange(0, hd, 2) / hd)  # [T, hd/2]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def gguf_forward(path, ids) -> np.ndarray:
    """Logits [T, vocab] of a llama-arch GGUF file, computed the way llama.cpp's graph does (f32 throughout)."""
    r = gguf.GGUFReader(path)
    W = {n: _dense(t) for n, t in _tensors(r).items()}
    arch = "llama"
    L, H = int(_field(r, f"{arch}.block_count")), int(_field(r, f"{arch}.attention.head_count"))
    KV = int(_field(r, f"{arch}.attention.head_count_kv"))
    eps = float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
    base, hd = float(_field(r, f"{arch}.rope.freq_base")), int(_field(r, f"{arch}.rope.dimension_count"))

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    ids = np.asarray(ids)
    T, pos = len(ids), np.arange(len(ids))
    x = W["token_embd.weight"][ids].astype(np.float64)
    for i in range(L):
        p = f"blk.{i}."
        h = rms(x, W[p + "attn_norm.weight"])
        q, k, v = (h @ W[p + f"attn_{s}.weight"].T + W.get(p + f"attn_{s}.bias", 0) for s in "qkv")
        q = _rope_pairs(q.reshape(T, H, hd), pos, base)
        k = _rope_pairs(k.reshape(T, KV, hd), pos, base)
        v = v.reshape(T, KV, hd)
        out = np.empty((T, H, hd))
        for hh in range(H):
            kv = hh // (H // KV)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(hd)
            s = np.where(pos[None, :] <= pos[:, None], s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, H * hd) @ W[p + "attn_output.weight"].T
        h = rms(x, W[p + "ffn_norm.weight"])
        if p + "ffn_gate_inp.weight" in W:  # llama.cpp's build_moe_ffn: softmax, top k, renormalised weights
            k = int(_field(r, f"{arch}.expert_used_count"))
            z = h @ W[p + "ffn_gate_inp.weight"].T
            probs = np.exp(z - z.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            moe = np.zeros_like(x)
            for t in range(T):
                top = np.argsort(-probs[t], kind="stable")[:k]
                for e, wt in zip(top, probs[t, top] / probs[t, top].sum()):
                    g = h[t] @ W[p + "ffn_gate_exps.weight"][e].T
                    act = g / (1 + np.exp(-g)) * (h[t] @ W[p + "ffn_up_exps.weight"][e].T)
                    moe[t] += wt * (act @ W[p + "ffn_down_exps.weight"][e].T)
            x = x + moe
            continue
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    head = W.get("output.weight", W["token_embd.weight"])
    return (rms(x, W["output_norm.weight"]) @ head.T).astype(np.float32)


def test_q4_export_metadata_layout_and_bits(tmp_path):
    c = _lowered(DENSE, "q4")
    path = tmp_path / "m.gguf"
    info = export_gguf(c.graph, path)
    assert info["file_type"] == "MOSTLY_Q4_0" and path.stat().st_size == info["file_bytes"]
    assert not [p for p in tmp_path.iterdir() if p.name != "m.gguf"]  # no temporary left behind
    r = gguf.GGUFReader(path)
    meta = {
        "general.architecture": "llama", "llama.context_length": 64, "llama.embedding_length": 64,
        "llama.block_count": 2, "llama.feed_forward_length": 96, "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2, "llama.rope.dimension_count": 16, "llama.vocab_size": 320,
        "general.file_type": int(gguf.LlamaFileType.MOSTLY_Q4_0), "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    for k, v in meta.items():
        assert _field(r, k) == v, k
    assert _field(r, "llama.rope.freq_base") == pytest.approx(10000.0)
    assert _field(r, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    toks = _field(r, "tokenizer.ggml.tokens")
    assert len(toks) == 320 and len(set(toks)) == 320
    assert toks[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and toks[258] == "<0xFF>"
    assert _field(r, "tokenizer.ggml.token_type")[3:259] == [int(gguf.TokenType.BYTE)] * 256

    t = _tensors(r)
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(2):
        expected |= {f"blk.{i}.{n}.weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                     "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(t) == expected
    assert t["token_embd.weight"].tensor_type == Q.F16 and list(t["token_embd.weight"].shape) == [64, 320]
    assert np.array_equal(t["token_embd.weight"].data, c.graph.weights["tok_embeddings"])
    ir_name = {"attn_q": "attn.wq", "attn_k": "attn.wk", "attn_v": "attn.wv", "attn_output": "attn.wo",
               "ffn_gate": "ffn.w_gate", "ffn_up": "ffn.w_up", "ffn_down": "ffn.w_down"}
    for i in range(2):
        for g, n in ir_name.items():
            qt = c.graph.weights[f"blocks.{i}.{n}"]
            assert isinstance(qt, QTensor)
            want = to_gguf_bytes(qt)
            if g == "attn_q":
                want = want[rope_row_permutation(4, 16)]
            elif g == "attn_k":
                want = want[rope_row_permutation(2, 16)]
            got = t[f"blk.{i}.{g}.weight"]
            assert got.tensor_type == Q.Q4_0 and list(got.shape) == [qt.cols, qt.rows]
            assert np.array_equal(got.data, want), (i, g)
        for g in ("attn_norm", "ffn_norm"):
            tt = t[f"blk.{i}.{g}.weight"]
            assert tt.tensor_type == Q.F32 and np.array_equal(tt.data, c.graph.weights[f"blocks.{i}.{g}"])
    assert np.array_equal(t["output.weight"].data, to_gguf_bytes(c.graph.weights["lm_head"]))


@pytest.mark.parametrize("quant, qtype", [("q4", Q.Q4_0), ("q8", Q.Q8_0), ("f16", Q.F16), ("f32", Q.F32)],
                         ids=["q4", "q8", "f16", "f32"])
@pytest.mark.parametrize("config", [DENSE, KNOBS], ids=["dense", "knobs"])
def test_gguf_function_equals_cflow(tmp_path, config, quant, qtype):
    """llama.cpp's reading of the file (adjacent-pair RoPE) computes what cflow computes on the same weights."""
    c = _lowered(config, quant)
    path = tmp_path / "m.gguf"
    export_gguf(c.graph, path)
    t = _tensors(gguf.GGUFReader(path))
    assert t["blk.0.attn_q.weight"].tensor_type == qtype
    assert ("blk.0.attn_q.bias" in t) == config.attn_bias
    assert "output.weight" in t  # quantised graphs stream their own head copy, tied or not
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 12)
    ref = interpret(c.graph, ids)  # f32 activations on the stored (dequantised) weights
    got = gguf_forward(path, ids)
    assert np.abs(got - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


@pytest.mark.parametrize("quant, qtype", [("q4", Q.Q4_0), ("q8", Q.Q8_0), ("f32", Q.F32)], ids=["q4", "q8", "f32"])
def test_moe_export_stacks_experts_bit_identically_and_computes_like_cflow(tmp_path, quant, qtype):
    c = _lowered(MOE, quant)
    path = tmp_path / "m.gguf"
    export_gguf(c.graph, path)
    r = gguf.GGUFReader(path)
    assert (_field(r, "llama.expert_count"), _field(r, "llama.expert_used_count")) == (4, 2)
    assert _field(r, "llama.feed_forward_length") == 64
    t = _tensors(r)
    assert not any(".ffn_gate.weight" in n for n in t)
    for i in range(MOE.n_layers):
        p = f"blocks.{i}.moe"
        inp = t[f"blk.{i}.ffn_gate_inp.weight"]
        assert inp.tensor_type == Q.F32 and np.array_equal(inp.data, c.graph.weights[f"{p}.router"])
        assert np.array_equal(t[f"blk.{i}.ffn_norm.weight"].data, c.graph.weights[f"blocks.{i}.moe_norm"])
        for m, g in (("w_gate", "ffn_gate_exps"), ("w_up", "ffn_up_exps"), ("w_down", "ffn_down_exps")):
            got = t[f"blk.{i}.{g}.weight"]
            rows, cols = c.graph.meta.shapes[f"{p}.experts.0.{m}"]
            assert got.tensor_type == qtype and list(got.shape) == [cols, rows, 4], (i, g)  # GGUF order: ne0 first
            for e in range(4):
                w = c.graph.weights[f"{p}.experts.{e}.{m}"]
                want = to_gguf_bytes(w) if isinstance(w, QTensor) else w
                assert np.array_equal(got.data[e], want), (i, g, e)
    ids = np.random.default_rng(3).integers(0, MOE.vocab_size, 12)
    ref = interpret(c.graph, ids)  # f32 activations on the stored (dequantised) weights
    got = gguf_forward(path, ids)
    assert np.abs(got - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())


def test_unquantised_tied_graph_omits_output(tmp_path):
    g = build_graph(KNOBS, _weights(KNOBS), name="raw")
    export_gguf(g, tmp_path / "m.gguf")
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    t = _tensors(r)
    assert "output.weight" not in t and t["token_embd.weight"].tensor_type == Q.F32
    assert _field(r, "general.file_type") == int(gguf.LlamaFileType.ALL_F32)
    ids = [5, 7, 11, 300, 2]
    assert np.abs(gguf_forward(tmp_path / "m.gguf", ids) - interpret(g, ids)).max() < 1e-3


def test_tokenizer_json_byte_level_bpe(tmp_path):
    from pathlib import Path

    tj = Path(__file__).resolve().parents[2] / "cflow" / "data" / "default" / "tokenizer.json"
    if not tj.exists():
        pytest.skip("no bundled tokenizer.json")
    spec = json.loads(tj.read_text())
    n = len(spec["model"]["vocab"])
    c = _lowered(DENSE.evolve(vocab_size=n + 3), "q4")
    export_gguf(c.graph, tmp_path / "m.gguf", tokenizer_json=str(tj))
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    toks = _field(r, "tokenizer.ggml.tokens")
    assert _field(r, "tokenizer.ggml.model") == "gpt2" and _field(r, "tokenizer.ggml.pre") == "gpt-2"
    assert len(toks) == n + 3 and len(set(toks)) == n + 3  # padded with unique unused tokens
    vocab = spec["model"]["vocab"]
    assert all(toks[i] == t for t, i in vocab.items())
    assert len(_field(r, "tokenizer.ggml.merges")) == len(spec["model"]["merges"])
    assert _field(r, "tokenizer.ggml.token_type")[-1] == int(gguf.TokenType.UNUSED)


def test_synthetic_vocab_is_unique():
    toks, scores, types = synthetic_spm_vocab(32000)
    assert len(toks) == len(set(toks)) == len(scores) == len(types) == 32000


def test_unsupported_models_are_refused(tmp_path):
    from cflow.models import PRESETS

    moe = PRESETS["arch1"]["tiny"]  # a dense FFN and an expert bank in every layer
    with pytest.raises(UnsupportedModelError, match="mixed with dense FFN"):
        export_gguf(build_graph(moe), tmp_path / "moe.gguf")
    with pytest.raises(UnsupportedModelError, match="shared experts"):
        export_gguf(build_graph(MOE.evolve(shared_expert_dim=32)), tmp_path / "sh.gguf")
    with pytest.raises(UnsupportedModelError, match="norm_topk=False"):
        export_gguf(build_graph(MOE.evolve(norm_topk=False)), tmp_path / "nt.gguf")
    with pytest.raises(UnsupportedModelError, match="delays"):
        export_gguf(build_graph(DENSE.evolve(dense_delay=1)), tmp_path / "d.gguf")
    with pytest.raises(UnsupportedModelError, match="weight sharing"):
        export_gguf(build_graph(DENSE.evolve(n_blocks=1)), tmp_path / "s.gguf")
    odd = DENSE.evolve(d_model=48, n_heads=3, n_kv_heads=1)  # rows of 48 inputs: not whole Q4_0 blocks
    with pytest.raises(UnsupportedModelError, match="blocks of 32"):
        export_gguf(_lowered(odd, "q4").graph, tmp_path / "odd.gguf")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("config", [DENSE, MOE], ids=["dense", "moe"])
def test_llama_cpp_greedy_tokens_equal_ours(tmp_path, config):
    llama_cpp = pytest.importorskip("llama_cpp")
    c = _lowered(config, "q4")
    path = tmp_path / "m.gguf"
    export_gguf(c.graph, path)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=1, n_threads_batch=1, logits_all=False,
                          verbose=False)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, config.vocab_size, 10)]
    it = Interpreter(c.graph, act_quant="q8")  # the runtime's arithmetic: int8 activation blocks
    compared = 0
    for pos, tok in enumerate(ids):
        ref = it.step(tok)
        llm.eval([tok])
        got = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)).copy()
        assert np.abs(got - ref).max() <= 0.05 * max(1.0, np.abs(ref).max()), pos
        top2 = np.sort(ref)[-2:]
        # llama.cpp rounds activation scales and the KV cache to fp16: logits differ by ~1-2% of their range,
        # so the greedy choices must agree where the top-2 margin is clearly above that
        if top2[1] - top2[0] > 0.6:
            assert int(got.argmax()) == int(ref.argmax()), pos
            compared += 1
    assert compared >= 3


def test_tokenizer_json_text_sentencepiece(tmp_path):
    """A SentencePiece-style tokenizer.json (Unigram) becomes a "llama" vocabulary with its scores."""
    pieces = [["<unk>", 0.0], ["<s>", 0.0], ["</s>", 0.0]] + [[f"<0x{b:02X}>", 0.0] for b in range(256)]
    pieces += [["\u2581the", -1.5], ["\u2581a", -2.0]]
    spec = {"model": {"type": "Unigram", "unk_id": 0, "vocab": pieces, "byte_fallback": True},
            "added_tokens": [{"id": 1, "content": "<s>", "special": True},
                             {"id": 2, "content": "</s>", "special": True}]}
    c = _lowered(DENSE, "q4")
    export_gguf(c.graph, tmp_path / "m.gguf", tokenizer_json=json.dumps(spec))
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    TT = gguf.TokenType
    assert _field(r, "tokenizer.ggml.model") == "llama"
    toks, types = _field(r, "tokenizer.ggml.tokens"), _field(r, "tokenizer.ggml.token_type")
    assert toks[259:261] == ["\u2581the", "\u2581a"] and len(toks) == DENSE.vocab_size
    assert types[:4] == [int(TT.UNKNOWN), int(TT.CONTROL), int(TT.CONTROL), int(TT.BYTE)]
    assert _field(r, "tokenizer.ggml.scores")[259] == pytest.approx(-1.5)
    assert (_field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")) == (1, 2)


def test_llama_cpp_tokenizes_like_the_exported_tokenizer_json(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizers = pytest.importorskip("tokenizers")
    from pathlib import Path

    tj = Path(__file__).resolve().parents[2] / "cflow" / "data" / "default" / "tokenizer.json"
    if not tj.exists():
        pytest.skip("no bundled tokenizer.json")
    n = len(json.loads(tj.read_text())["model"]["vocab"])
    c = _lowered(DENSE.evolve(vocab_size=n), "q4")
    export_gguf(c.graph, tmp_path / "m.gguf", tokenizer_json=str(tj))
    llm = llama_cpp.Llama(model_path=str(tmp_path / "m.gguf"), n_ctx=64, n_threads=1, verbose=False)
    text = "Once upon a time, a little fox found 3 red apples."
    want = tokenizers.Tokenizer.from_file(str(tj)).encode(text, add_special_tokens=False).ids
    assert llm.tokenize(text.encode(), add_bos=False) == want


def test_direct_and_buffered_exports_are_the_same_file(tmp_path, monkeypatch):
    """The data section written with O_DIRECT (staging buffers of two blocks: most tensors cross one) makes the file
    the gguf package's buffered writes make; where O_DIRECT is refused, those run."""
    from cflow.runtime.format import direct

    monkeypatch.setattr(direct, "BUFFER_BYTES", 2 * 4096)
    g = lower(build_graph(MOE, _weights(MOE)), "q4").graph
    export_gguf(g, tmp_path / "d.gguf")
    monkeypatch.setattr(direct.DirectFile, "open", classmethod(lambda cls, path, start: None))
    export_gguf(g, tmp_path / "b.gguf")
    assert (tmp_path / "d.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def test_a_mix_of_gguf_block_types_exports_their_bytes(tmp_path):
    """A mix (cflowc --bpw's graph: matrices at several GGUF block types) exports each matrix's blocks as they are,
    and llama.cpp's reading computes what cflow computes; a matrix at one of cflow's own types is refused by name."""
    from cflow.layout.quant import DType
    from cflow.passes import mix as M

    g = build_graph(DENSE, _weights(DENSE), name=DENSE.name)
    roles = {"wq": DType.Q4_1, "wk": DType.Q4_1, "wv": DType.Q4_1, "wo": DType.Q5_0, "w_gate": DType.IQ4_NL,
             "w_up": DType.IQ4_NL, "w_down": DType.Q5_1}  # a fused stream (QKV, gate+up) reads one type
    types = {n: roles.get(n.rsplit(".", 1)[-1], DType.Q4) for n in M.matrices(g)}
    q = M.apply_types(g, types, M.column_weights(g, {}))
    c = lower(q, "stored")
    path = tmp_path / "m.gguf"
    export_gguf(c.graph, path)
    t = _tensors(gguf.GGUFReader(path))
    down = c.graph.weights["blocks.1.ffn.w_down"]
    assert t["blk.1.ffn_down.weight"].tensor_type == getattr(Q, down.dtype.gguf_name)
    assert np.array_equal(np.asarray(t["blk.1.ffn_down.weight"].data).reshape(down.raw.shape), down.raw)
    ids = np.random.default_rng(1).integers(0, DENSE.vocab_size, 12)
    ref = interpret(c.graph, ids)
    assert np.abs(gguf_forward(path, ids) - ref).max() <= 1e-3 * max(1.0, np.abs(ref).max())
    wide = DENSE.evolve(name="tiny_wide", d_model=128, ffn_dim=128)
    g = build_graph(wide, _weights(wide), name=wide.name)
    own = {n: DType.IQ4_128 if s[1] % 128 == 0 else DType.Q4 for n, s in g.meta.shapes.items() if n in M.matrices(g)}
    assert DType.IQ4_128 in own.values()
    q = M.apply_types(g, own, M.column_weights(g, {}))
    with pytest.raises(UnsupportedModelError, match="is IQ4_128, a block type of cflow's own"):
        export_gguf(lower(q, "stored").graph, tmp_path / "own.gguf")
    assert not (tmp_path / "own.gguf").exists()
