"""GGUF import (cflow.frontend.gguf): files written by our exporter and by the `gguf` package read back to the
source's logits; Q4_0/Q8_0 bit-exact; other types requantised with a note; tokenizers converted; bad files
refused with one error naming the field and offset. Every file is written by the test itself."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from cflow.compiler import lower
from cflow.errors import CflowError, UnsupportedModelError
from cflow.frontend import from_torch
from cflow.frontend.gguf import GGUFError, GGUFFile, from_gguf
from cflow.frontend.load import load_graph
from cflow.ir import build_graph, interpret
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.ir.rope import inv_freq
from cflow.layout.quant import QTensor, to_gguf_bytes
from cflow.runtime.format.gguf import export_gguf

from ._gguf import write_gguf, write_hf_gguf
from ._models import hf_logits, hf_model, incremental

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

DENSE = ModelConfig(name="tiny_dense", vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=64, rope_theta=10000.0, norm_eps=1e-5)
KNOBS = DENSE.evolve(name="tiny_knobs", n_heads=2, n_kv_heads=1, head_dim=32, attn_bias=True, tie_embeddings=True,
                     rope_theta=500000.0, norm_eps=1e-6)
IDS = np.random.default_rng(1).integers(0, 256, 20)
BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "cflow" / "data" / "default" / "tokenizer.json"


def _weights(c: ModelConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in weight_shapes(c).items():
        if len(shape) == 1 and not name.endswith((".bq", ".bk", ".bv")):
            out[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            std = 0.5 if name in ("lm_head", "tok_embeddings") else 0.1
            out[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return out


def _graph(c: ModelConfig):
    return build_graph(c, _weights(c), name=c.name)


# --- our exporter, read back ----------------------------------------------------------------------
@pytest.mark.parametrize("config", [DENSE, KNOBS], ids=["dense", "knobs"])
def test_exported_f32_reads_back_to_the_same_model(tmp_path, config):
    g = _graph(config)
    export_gguf(g, tmp_path / "m.gguf")
    back = load_graph(tmp_path / "m.gguf")  # by suffix, through the front door
    assert back.config == config and back.meta.source == "gguf:llama"
    assert np.abs(interpret(back, IDS) - interpret(g, IDS)).max() <= 1e-6  # q/k rows un-permuted
    assert back.meta.eos_token_ids == [2] and json.loads(back.meta.tokenizer)["model"]["type"] == "BPE"


@pytest.mark.parametrize("quant", ["q4", "q8"])
def test_q4_q8_blocks_are_copied_bit_exactly(tmp_path, quant):
    src = lower(_graph(KNOBS), quant).graph
    export_gguf(src, tmp_path / "m.gguf")
    back = from_gguf(tmp_path / "m.gguf")
    mats = [n for n in src.meta.shapes if isinstance(src.weights[n], QTensor)]
    assert len(mats) == 2 * 7 + 1
    for n in mats:
        w = back.weights[n]
        assert isinstance(w, QTensor) and w.dtype == src.weights[n].dtype, n
        assert np.array_equal(to_gguf_bytes(w), to_gguf_bytes(src.weights[n])), n
    again = lower(back, quant).graph  # compiling at the same type passes the blocks through untouched
    for n in mats:
        assert np.array_equal(to_gguf_bytes(again.weights[n]), to_gguf_bytes(src.weights[n])), n
    assert np.abs(interpret(back, IDS) - interpret(src, IDS)).max() <= 1e-6


# --- files written by the gguf package, llama.cpp's way ------------------------------------------------
def _llama3_rope_freqs(c: ModelConfig) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for a Llama 3.1 config: default frequency / scaled frequency."""
    default, _ = inv_freq(c.head_dim, c.rope_theta)
    scaled, _ = inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    return (default.astype(np.float64) / scaled).astype(np.float32)


CASES = {  # case -> (GGUF arch, HF family, its overrides)
    "llama": ("llama", "llama3", {}),
    "mixtral": ("llama", "mixtral", {}),  # llama.cpp writes Mixtral as 'llama' with merged ffn_*_exps tensors
    "qwen2": ("qwen2", "qwen2", {}),
    "qwen2moe": ("qwen2moe", "qwen2_moe", {"mlp_only_layers": []}),
    "qwen3": ("qwen3", "qwen3", {}),
    "qwen3moe": ("qwen3moe", "qwen3_moe", {"mlp_only_layers": []}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_package_files_match_transformers(tmp_path, case):
    arch, family, over = CASES[case]
    m = hf_model(family, **over)
    g = from_torch(m)
    c = g.config
    extra, meta = {}, {}
    if c.rope_scaling:  # Llama 3.x: the scaling travels as rope_freqs.weight, as llama.cpp writes it
        extra["rope_freqs.weight"] = (_llama3_rope_freqs(c), None)
    if arch == "qwen3moe":
        meta["add_expert_weights_norm"] = True
    write_gguf(g, tmp_path / "m.gguf", arch, extra_tensors=extra, metadata=meta)
    back = from_gguf(tmp_path / "m.gguf")
    assert back.config.evolve(rope_scaling=None) == c.evolve(name=back.config.name, rope_scaling=None)
    ref = hf_logits(m, IDS)
    assert np.abs(interpret(back, IDS) - ref).max() <= 1e-4
    assert np.abs(incremental(back, IDS, 7) - ref).max() <= 1e-4


# Hugging Face models written the way convert_hf_to_gguf.py writes each architecture (tests/frontend/_gguf.py:
# write_hf_gguf), read back against transformers. Overrides keep each model inside what llama.cpp reads from a file:
# Gemma 2/3 scale q by 1/sqrt(head_dim) below the 27B layer counts (query_pre_attn_scalar is not in the file), Gemma
# 3's sliding layers are five of every six (6 layers: one global), Phi-3's longrope has a consistent original context.
_PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
              "long_factor": [2.0, 3.0, 4.0, 6.0], "original_max_position_embeddings": 32}
HF_CASES = {  # case -> (GGUF arch, HF family, overrides, context to compile for)
    "gemma": ("gemma", "gemma", {}, None),
    "gemma2": ("gemma2", "gemma2", {"query_pre_attn_scalar": 16}, None),
    "gemma3": ("gemma3", "gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                                    "sliding_window_pattern": 6}, None),
    "phi3": ("phi3", "phi3", {"original_max_position_embeddings": 32, "rope_parameters": _PHI3_ROPE}, 32),
    "olmoe": ("olmoe", "olmoe", {}, None),
    "granite": ("granite", "granite", {}, None),
    "llama_linear": ("llama", "llama_linear", {}, None),  # rope.scaling.type linear
    "qwen2_yarn": ("qwen2", "qwen2_yarn", {}, None),  # rope.scaling.type yarn
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_models_written_as_llama_cpp_does_match_transformers(tmp_path, case):
    arch, family, over, ctx = HF_CASES[case]
    m = hf_model(family, **over)
    write_hf_gguf(m, tmp_path / "m.gguf", arch)
    back = from_gguf(tmp_path / "m.gguf", max_seq_len=ctx)
    assert back.meta.source == f"gguf:{arch}"
    want = from_torch(m).config.evolve(max_seq_len=ctx or 128)
    # transformers' yarn `truncate` default is ir/rope.py's (llama.cpp's floor/ceil) too; attention factors are
    # float32 metadata
    got_sc, sc = dict(back.config.rope_scaling or ()), dict(want.rope_scaling or ())
    sc.pop("truncate", None)
    if "attention_factor" in sc:
        assert abs(got_sc["attention_factor"] - sc["attention_factor"]) <= 1e-6
        sc["attention_factor"] = got_sc["attention_factor"]
    assert back.config == want.evolve(name=back.config.name, rope_scaling=sc or None)
    ref = hf_logits(m, IDS)
    assert np.abs(interpret(back, IDS) - ref).max() <= 1e-4
    assert np.abs(incremental(back, IDS, 7) - ref).max() <= 1e-4


def test_phi3_past_its_original_context_uses_the_long_factors(tmp_path):
    """Compiled for 128 > 32 tokens: the long factors (llama.cpp's choice for that context), which transformers
    uses on a sequence longer than 32; a warning says so."""
    arch, family, over, _ = HF_CASES["phi3"]
    m = hf_model(family, **over)
    write_hf_gguf(m, tmp_path / "m.gguf", arch)
    with pytest.warns(UserWarning, match="long factors"):
        back = from_gguf(tmp_path / "m.gguf")
    ids = np.random.default_rng(2).integers(0, 256, 40)
    assert back.config.max_seq_len == 128
    assert np.abs(interpret(back, ids) - hf_logits(m, ids)).max() <= 1e-4


def test_fused_phi3_rows_are_copied_bit_exactly_from_q8_0(tmp_path):
    """attn_qkv / ffn_up hold several IR weights: each is a block of whole rows, so Q8_0 rows are copied, not
    requantised; Granite's folded multipliers scale its tensors' fp16 block scales (the codes are kept)."""
    arch, family, over, ctx = HF_CASES["phi3"]
    write_hf_gguf(hf_model(family, **over), tmp_path / "m.gguf", arch, qtype=Q.Q8_0)
    back = from_gguf(tmp_path / "m.gguf", max_seq_len=ctx)
    r = GGUFFile(tmp_path / "m.gguf")
    qkv, up = r.tensors["blk.0.attn_qkv.weight"], r.tensors["blk.0.ffn_up.weight"]
    rows = gguf.quants.dequantize(r.raw(qkv).reshape(qkv.shape[0], -1), Q.Q8_0)
    wv = back.weights["blocks.0.attn.wv"]
    assert isinstance(wv, QTensor) and np.array_equal(wv.dequantize(), rows[96:128])
    gu = gguf.quants.dequantize(r.raw(up).reshape(up.shape[0], -1), Q.Q8_0)
    assert np.array_equal(back.weights["blocks.0.ffn.w_up"].dequantize(), gu[96:])
    assert np.array_equal(back.weights["blocks.0.ffn.w_gate"].dequantize(), gu[:96])
    write_hf_gguf(hf_model("granite"), tmp_path / "g.gguf", "granite", qtype=Q.Q8_0)
    g = from_gguf(tmp_path / "g.gguf")
    assert isinstance(g.weights["blocks.0.attn.wk"], QTensor)  # unscaled: copied
    wo = g.weights["blocks.0.attn.wo"]  # * residual_scale: the same codes, the scales multiplied (fp16-rounded)
    src = GGUFFile(tmp_path / "g.gguf").tensors["blk.0.attn_output.weight"]
    raw = GGUFFile(tmp_path / "g.gguf").raw(src).reshape(src.shape[0], -1)
    assert isinstance(wo, QTensor) and np.array_equal(wo.q.view(np.uint8).reshape(src.shape[0], -1, 32),
                                                      raw.reshape(src.shape[0], -1, 34)[..., 2:])
    want = gguf.quants.dequantize(raw, Q.Q8_0) * np.float32(0.22)
    assert np.abs(wo.dequantize() - want).max() <= 2**-10 * np.abs(want).max()


def test_other_types_are_kept_as_stored_and_bf16_is_exact(tmp_path):
    """A Q5_0 file's matrices come in as BlockTensors with the file's bytes (no note on import); compiling with
    --quant requantises them with one warning; BF16 widens to f32 exactly."""
    from cflow.layout.blocks import BlockTensor
    from cflow.passes.pipeline import lower
    from cflow.passes.quantize import RequantiseWarning

    g = _graph(DENSE)
    write_gguf(g, tmp_path / "m.gguf", "llama", qtype=Q.Q5_0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = from_gguf(tmp_path / "m.gguf")
    r = GGUFFile(tmp_path / "m.gguf")
    t = r.tensors["blk.0.ffn_up.weight"]
    w = back.weights["blocks.0.ffn.w_up"]
    assert isinstance(w, BlockTensor) and np.array_equal(w.raw, r.raw(t).reshape(t.shape[0], -1))
    assert np.array_equal(w.dequantize(), gguf.quants.dequantize(r.raw(t).reshape(t.shape[0], -1), Q.Q5_0))
    assert back.meta.source_dtypes["blocks.0.ffn.w_up"].gguf_name == "Q5_0"
    with pytest.warns(RequantiseWarning, match="Q5_0 are requantised to q4"):
        lower(back, "q4")
    # BF16 -> f32 exactly
    g2 = _graph(DENSE)
    emb = g2.weights["tok_embeddings"]
    bf = (emb.view(np.uint32) >> 16).astype(np.uint16)
    write_gguf(g2, tmp_path / "b.gguf", "llama", drop=("token_embd.weight",),
               extra_tensors={"token_embd.weight": (bf.view(np.uint8).reshape(emb.shape[0], -1), Q.BF16)})
    back2 = from_gguf(tmp_path / "b.gguf")
    assert np.array_equal(back2.weights["tok_embeddings"], (bf.astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("case", ["mixtral", "qwen3", "gemma3", "phi3"])
@pytest.mark.filterwarnings("ignore:.*longrope uses its long factors")
def test_gguf_compiles_and_the_native_runtime_equals_the_interpreter(tmp_path, case):
    """The user's path for a GGUF: cflow.compile("m.gguf") (a .vflow written and loaded), f32 logits == the
    interpreter's on the imported graph."""
    import cflow

    if case in HF_CASES:  # Gemma 3 (windows, local RoPE base, q/k norms), Phi-3 (fused rows, partial longrope)
        arch, family, over, _ = HF_CASES[case]
        write_hf_gguf(hf_model(family, **over), tmp_path / "m.gguf", arch)
    else:
        arch, family, over = CASES[case]
        write_gguf(from_torch(hf_model(family, **over)), tmp_path / "m.gguf", arch)
    back = from_gguf(tmp_path / "m.gguf")
    with cflow.compile(str(tmp_path / "m.gguf"), quant="f32", threads=2) as lm:
        got = np.stack([lm.session.step(int(t)).copy() for t in IDS])
    assert np.abs(got - interpret(back, IDS)).max() <= 1e-4


def test_f16_tensors_become_f32_exactly(tmp_path):
    g = _graph(DENSE)
    write_gguf(g, tmp_path / "h.gguf", "llama", qtype=Q.F16)
    r = GGUFFile(tmp_path / "h.gguf")
    assert r.tensors["blk.0.ffn_up.weight"].type == Q.F16
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no requantisation note
        back = from_gguf(tmp_path / "h.gguf")
    for n in ("blocks.0.ffn.w_up", "blocks.1.attn.wo", "lm_head"):
        assert np.array_equal(back.weights[n], g.weights[n].astype(np.float16).astype(np.float32)), n


def test_q8_k_has_no_dequantiser_and_is_refused_by_tensor(tmp_path):
    c = DENSE.evolve(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256)
    blocks = np.zeros((c.vocab_size, 292), np.uint8)  # Q8_K: f32 d, 256 int8 codes, 16 int16 block sums
    write_gguf(_graph(c), tmp_path / "k.gguf", "llama", drop=("output.weight",),
               extra_tensors={"output.weight": (blocks, Q.Q8_K)})
    with pytest.raises(UnsupportedModelError, match="tensor 'output.weight' .* stored as Q8_K, which the gguf package "
                                                    "cannot dequantise"):
        from_gguf(tmp_path / "k.gguf")


def test_k_quant_tensor_is_kept_and_equals_the_gguf_dequantiser(tmp_path):
    """A Q6_K head (random but valid blocks: any codes, finite scales) is kept as its bytes; its values are
    gguf.quants's."""
    c = DENSE.evolve(d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=256)
    g = _graph(c)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (c.vocab_size, 210), dtype=np.uint8)
    blocks[:, 192:208] = rng.integers(-30, 30, (c.vocab_size, 16)).astype(np.int8).view(np.uint8)  # scales
    blocks[:, 208:210] = np.full((c.vocab_size, 1), 0.001, np.float16).view(np.uint8)  # d
    write_gguf(g, tmp_path / "k.gguf", "llama", drop=("output.weight",),
               extra_tensors={"output.weight": (blocks, Q.Q6_K)})
    back = from_gguf(tmp_path / "k.gguf")
    want = gguf.quants.dequantize(blocks, Q.Q6_K).reshape(c.vocab_size, 256)
    assert np.array_equal(back.weights["lm_head"].raw, blocks)
    assert np.array_equal(back.weights["lm_head"].dequantize(), want)


# --- tokenizers and chat templates -------------------------------------------------------------------
TEXTS = ["Once upon a time, a little fox found 3 red apples.", "  two  spaces\nand a newline", "émigré naïve 😀",
         "<s>special?</s> it's 12345 dogs"]


@pytest.mark.skipif(not BUNDLED_TOKENIZER.exists(), reason="no bundled tokenizer.json")
def test_byte_level_bpe_round_trips(tmp_path):
    from tokenizers import Tokenizer

    spec = json.loads(BUNDLED_TOKENIZER.read_text())
    n = len(spec["model"]["vocab"]) + len(spec.get("added_tokens", []))
    g = _graph(DENSE.evolve(vocab_size=max(n, 320)))
    export_gguf(g, tmp_path / "m.gguf", tokenizer_json=str(BUNDLED_TOKENIZER))
    back = from_gguf(tmp_path / "m.gguf")
    ours, theirs = Tokenizer.from_str(back.meta.tokenizer), Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    for t in TEXTS:
        ids = theirs.encode(t, add_special_tokens=False).ids
        assert ours.encode(t, add_special_tokens=False).ids == ids, t
        assert ours.decode(ids) == theirs.decode(ids)


def _spm_reference(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece tokenisation: merge the adjacent pair whose union is the highest-scored vocabulary
    piece (leftmost on ties) until none is; pieces left outside the vocabulary become their UTF-8 byte tokens."""
    vocab = {t: i for i, t in enumerate(tokens)}
    syms = list("\u2581" + text.replace(" ", "\u2581"))
    while True:
        best = None
        for i in range(len(syms) - 1):
            j = vocab.get(syms[i] + syms[i + 1])
            if j is not None and (best is None or scores[j] > scores[best[1]]):
                best = (i, j)
        if best is None:
            break
        i = best[0]
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        out += [vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
    return out


def test_sentencepiece_vocabulary_tokenises_like_llama_cpp(tmp_path):
    from tokenizers import Tokenizer

    TT = gguf.TokenType
    pieces = ["\u2581", "o", "n", "c", "e", "u", "p", "a", "t", "i", "m", "\u2581o", "\u2581on", "on", "ce",
              "\u2581once", "up", "\u2581up", "\u2581a", "\u2581t", "ti", "me", "\u2581time", "\u2581ti", "im", "pon",
              "\u2581upon"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256 + [TT.NORMAL] * len(pieces)
    c = DENSE.evolve(vocab_size=len(tokens))
    write_gguf(_graph(c), tmp_path / "s.gguf", "llama", tokenizer=("llama", tokens, scores, [int(t) for t in types],
                                                                   None),
               chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    back = from_gguf(tmp_path / "s.gguf")
    tok = Tokenizer.from_str(back.meta.tokenizer)
    for text in ["once upon a time", "time upon once", "no match é", "up up a"]:
        assert tok.encode(text, add_special_tokens=False).ids == _spm_reference(text, tokens, scores), text
        assert tok.decode(_spm_reference(text, tokens, scores)) == text
    assert tok.encode("<s>once", add_special_tokens=False).ids[0] == 1  # control tokens are special
    assert back.meta.chat_template == {"template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                       "bos_token": "<s>", "eos_token": "</s>"}
    assert back.meta.eos_token_ids == [2]


def _llama_cpp_pieces(text: str, regexes: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex in turn splits every piece so far into its matches and the
    text between them."""
    import regex

    pieces = [text]
    for rx in regexes:
        out = []
        for p in pieces:
            at = 0
            for m in regex.finditer(rx, p):
                if m.start() > at:
                    out.append(p[at : m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                at = m.end()
            if at < len(p):
                out.append(p[at:])
        pieces = out
    return pieces


_DEFAULT_REGEXES = [r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                    r"\p{N}+", r"[0-9][0-9][0-9]"]  # llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_DEFAULT


def test_pre_tokenizer_default_is_llama_cpp_default_not_gpt2(tmp_path):
    """tokenizer.ggml.pre 'default' (or absent) is llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes in
    turn (punctuation runs, GPT-2's, digit runs, digits in threes), not GPT-2's one; an unknown name (which
    llama.cpp refuses) warns and takes the same."""
    pytest.importorskip("regex")
    from tokenizers import Tokenizer
    from tokenizers.pre_tokenizers import ByteLevel

    byte_chars = list(ByteLevel.alphabet())
    tokens = sorted(byte_chars)
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    g = _graph(DENSE.evolve(vocab_size=len(tokens)))
    b2u = {b: c for b, c in enumerate(_bytes_to_unicode())}
    texts = TEXTS + ["it's 12345 dogs!!, ok", "$5+3=8 ~x|y <a>", "1234567 émigré"]
    for pre, warns in (("default", False), (None, False), ("no-such-pre", True)):
        path = tmp_path / f"{pre}.gguf"
        write_gguf(g, path, "llama", tokenizer=("gpt2", tokens, None, types, []), pre=pre)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            tok = Tokenizer.from_str(from_gguf(path).meta.tokenizer)
        assert any("tokenizer.ggml.pre='no-such-pre'" in str(x.message) for x in w) == warns
        for text in texts:
            got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
            want = ["".join(b2u[b] for b in p.encode()) for p in _llama_cpp_pieces(text, _DEFAULT_REGEXES)]
            assert got == want, (pre, text)
    assert _llama_cpp_pieces("it's 12345 dogs!!, ok", _DEFAULT_REGEXES) == \
        ["it", "'", "s", " ", "123", "45", " dogs", "!!,", " ok"]


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


# --- the front door ---------------------------------------------------------------------------------
def test_cflowc_compiles_a_gguf_and_the_runtime_runs_it(tmp_path):
    import cflow
    from cflow.cli import cflowc_main

    src = lower(_graph(DENSE), "q8").graph
    export_gguf(src, tmp_path / "m.gguf")
    assert cflowc_main([str(tmp_path / "m.gguf"), "-o", str(tmp_path / "m.vflow"), "--quant", "q8"]) == 0
    m = cflow.load(tmp_path / "m.vflow", threads=1)
    from cflow.ir import Interpreter

    it = Interpreter(src, act_quant="q8", kv=m.kv)  # the model's KV cache type (kv='auto': f16 for q8)
    ids = [int(i) for i in IDS[:12]]
    assert np.abs(m.logits(ids) - it.run(ids)[-1]).max() <= 1e-3
    m.close()


# --- bad input -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "good.gguf"
    g = _graph(DENSE)
    export_gguf(g, p)
    return p


def _patch(src: Path, dst: Path, at: int, fmt: str, value) -> Path:
    blob = bytearray(src.read_bytes())
    struct.pack_into("<" + fmt, blob, at, value)
    dst.write_bytes(bytes(blob))
    return dst


def _string_len_at(f: GGUFFile, key: str) -> int:
    return f.meta_at[key]  # a key's entry starts with its length


def _lies(good: Path):
    f = GGUFFile(good)
    t = f.tensors["blk.0.attn_q.weight"]
    name_len = len(t.name.encode())
    dims_at = t.info_at + 8 + name_len + 4  # name (u64 length + bytes), n_dims
    type_at = dims_at + 8 * len(t.dims)
    off_at = type_at + 4
    tokens_at = f.meta_at["tokenizer.ggml.tokens"]
    tokens_count_at = tokens_at + 8 + len(b"tokenizer.ggml.tokens") + 4 + 4
    return [
        ("tensor_count", 8, "Q", 1 << 40, "tensor_count"),
        ("kv_count", 16, "Q", 1 << 40, "kv_count"),
        ("key length past EOF", 24, "Q", 1 << 50, "metadata entry 0 key"),
        ("value type", f.meta_at["general.architecture"] + 8 + len(b"general.architecture"), "I", 77,
         "unknown value type"),
        ("array length", tokens_count_at, "Q", 1 << 30, "tokenizer.ggml.tokens"),
        ("n_dims", dims_at - 4, "I", 9, "n_dims=9"),
        ("dim", dims_at + 8, "Q", 1 << 40, "dims"),
        ("dims overflow", dims_at, "Q", (1 << 64) - 32, "dims"),
        ("tensor type", type_at, "I", 999, "unknown tensor type 999"),
        ("offset past EOF", off_at, "Q", 1 << 40, "runs past the end"),
        ("offset misaligned", off_at, "Q", t.offset - f.data_start + 4, "alignment"),
        ("overlap", off_at, "Q", f.tensors["token_embd.weight"].offset - f.data_start, "overlaps"),
        ("version", 4, "I", 7, "version 7"),
        ("magic", 0, "I", 0x12345678, "not a GGUF file"),
    ]


def test_lying_headers_are_refused_by_field_and_offset(tmp_path, good_file):
    for what, at, fmt, value, needle in _lies(good_file):
        bad = _patch(good_file, tmp_path / "bad.gguf", at, fmt, value)
        with pytest.raises(GGUFError) as e:
            from_gguf(bad)
        msg = str(e.value)
        assert needle in msg and "offset 0x" in msg and "\n" not in msg, (what, msg)


def test_truncated_files_are_refused(tmp_path, good_file):
    blob = good_file.read_bytes()
    f = GGUFFile(good_file)
    cuts = [0, 3, 10, 30, f.meta_at["tokenizer.ggml.tokens"] + 5, f.data_start - 1, f.data_start + 10, len(blob) - 1]
    for n in cuts:
        (tmp_path / "t.gguf").write_bytes(blob[:n])
        with pytest.raises(GGUFError, match="offset 0x"):
            from_gguf(tmp_path / "t.gguf")


REFUSED = {"deepseek2": "multi-head latent attention is not modelled", "mamba": "state-space models",
           "rwkv6": "RWKV is not modelled", "bert": "encoder models", "t5": "encoder-decoder models"}


@pytest.mark.parametrize("arch", list(REFUSED))
def test_architectures_the_ir_does_not_model_are_refused_by_name(tmp_path, arch):
    write_gguf(_graph(DENSE), tmp_path / "a.gguf", arch)
    with pytest.raises(UnsupportedModelError, match=f"architecture '{arch}': {REFUSED[arch]}"):
        from_gguf(tmp_path / "a.gguf")


def test_llama_cpp_family_conventions_that_do_not_fit_are_named(tmp_path):
    m = hf_model("granite")
    write_hf_gguf(m, tmp_path / "g.gguf", "granite", metadata={"add_bool": ("granite.rope.scaling.finetuned", False)})
    with pytest.raises(UnsupportedModelError, match="rope.scaling.finetuned'=false: attention without RoPE"):
        from_gguf(tmp_path / "g.gguf")
    arch, family, over, _ = HF_CASES["phi3"]
    write_hf_gguf(hf_model(family, **over), tmp_path / "p.gguf", arch, drop=("rope_factors_short.weight",))
    with pytest.raises(GGUFError, match="only one of rope_factors_long.weight / rope_factors_short.weight"):
        from_gguf(tmp_path / "p.gguf")
    # partial rotary in llama's adjacent-pair row order: named, not guessed
    write_gguf(_graph(DENSE), tmp_path / "r.gguf", "llama", metadata={"add_uint32": ("llama.rope.dimension_count", 8)})
    with pytest.raises(UnsupportedModelError, match="partial rotary embeddings in 'llama'"):
        from_gguf(tmp_path / "r.gguf")


def test_gemma2_without_window_metadata_takes_llama_cpp_defaults(tmp_path):
    """llama.cpp's Gemma 2 defaults when the keys are absent: window 4096 (no window at a 128-token context),
    soft-caps 50 / 30."""
    m = hf_model("gemma2", query_pre_attn_scalar=16)
    write_hf_gguf(m, tmp_path / "g.gguf", "gemma2")
    f = GGUFFile(tmp_path / "g.gguf")
    assert f.meta["gemma2.attention.sliding_window"] == 8
    from cflow.frontend import gguf as G

    f.meta = {k: v for k, v in f.meta.items() if "softcapping" not in k and "sliding_window" not in k}
    c, _ = G._config(f, "gemma2", "g", None)
    assert (c.sliding_window, c.attn_softcap, c.final_softcap) == (0, 50.0, 30.0)


def test_unknown_architecture_and_bad_metadata_are_named(tmp_path):
    g = _graph(DENSE)
    write_gguf(g, tmp_path / "b.gguf", "falcon")
    with pytest.raises(UnsupportedModelError, match="architecture 'falcon' is not supported by the GGUF importer"):
        from_gguf(tmp_path / "b.gguf")
    write_gguf(g, tmp_path / "c.gguf", "llama", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(GGUFError, match="no tensor for weight 'blocks.1.ffn.w_up'"):
        from_gguf(tmp_path / "c.gguf")
    write_gguf(g, tmp_path / "d.gguf", "llama", extra_tensors={"blk.0.attn_sinks.weight": (np.ones(4, np.float32),
                                                                                          None)})
    with pytest.raises(UnsupportedModelError, match="tensor 'blk.0.attn_sinks.weight'"):
        from_gguf(tmp_path / "d.gguf")


def test_cflowc_on_a_bad_gguf_writes_nothing(tmp_path, good_file, capsys):
    from cflow.cli import cflowc_main

    bad = _patch(good_file, tmp_path / "bad.gguf", 8, "Q", 1 << 40)
    assert cflowc_main([str(bad), "-o", str(tmp_path / "out.vflow")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tensor_count" in err and err.count("\n") == 1
    assert not (tmp_path / "out.vflow").exists()
    with pytest.raises(CflowError):
        load_graph(bad)
