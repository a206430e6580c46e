"""GGUF files whose matrices are random blocks of any GGUF block type (every bit pattern of codes and scales),
with fp16 scales sized so activations stay of order 1: the test files of the block-type kernels."""

from __future__ import annotations

import numpy as np

from cflow.layout.blocks import FORMATS, OWN_TYPES, BlockTensor, e5m3_ceil
from cflow.layout.quant import DType, QTensor, quantize, to_gguf_bytes

# the typical code magnitude of each type (codes minus bias, times the sub-block scale's integer part)
_SPREAD = {DType.Q4_1: 15, DType.Q5_0: 16, DType.Q5_1: 31, DType.IQ4_NL: 127, DType.Q2_K: 3 * 15,
           DType.Q3_K: 4 * 32, DType.Q4_K: 15 * 63, DType.Q5_K: 31 * 63, DType.Q6_K: 32 * 127, DType.IQ4_XS: 127 * 32,
           DType.IQ4_128: 127 * 32, DType.IQ4_192: 127 * 32, DType.Q3_128: 4 * 32, DType.Q3_192: 4 * 32}


def random_blocks(dtype: DType, rows: int, cols: int, rng, std: float) -> BlockTensor:
    """Random block bytes whose weights have a standard deviation near `std` (order of magnitude)."""
    fmt = FORMATS[dtype]
    nb = cols // fmt.qk
    raw = rng.integers(0, 256, (rows, nb, fmt.nbytes), dtype=np.uint8)
    sl = fmt.field_slices()
    d = std / (_SPREAD[dtype] / 2)
    for name in fmt.f16_scales:
        v = (rng.uniform(0.5, 1.5, (rows, nb)) * d * (0.5 if name != "d" else 1.0)).astype(np.float16)
        raw[..., sl[name]] = v.view(np.uint8).reshape(rows, nb, 2)
    if dtype in OWN_TYPES:  # the E5M3 super-block scale, the scales word's top byte
        raw[..., sl["scales"].stop - 1] = e5m3_ceil(rng.uniform(0.5, 1.5, (rows, nb)).astype(np.float32) * d)
    return BlockTensor(dtype, rows, cols, raw.reshape(rows, -1))


def gguf_payload(w) -> tuple[np.ndarray, object]:
    """(bytes or floats, raw GGML type or None) for gguf.GGUFWriter.add_tensor."""
    import gguf

    if isinstance(w, BlockTensor):
        return w.raw, getattr(gguf.GGMLQuantizationType, w.dtype.gguf_name)
    if isinstance(w, QTensor):
        return to_gguf_bytes(w), getattr(gguf.GGMLQuantizationType, w.dtype.gguf_name)
    return np.asarray(w, np.float32), None


def quantised(dtype: DType, rows: int, cols: int, rng, std: float):
    """A [rows, cols] weight of any cflow-executable GGUF type: a BlockTensor, or a QTensor (Q4_0 / Q8_0)."""
    if dtype in FORMATS:
        return random_blocks(dtype, rows, cols, rng, std)
    return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * std, dtype)


def write_llama(path, types: dict, d: int = 256, ffn: int = 512, vocab: int = 512, layers: int = 2, heads: int = 4,
                kv_heads: int = 2, seed: int = 0, tied: bool = True, raw: dict | None = None):
    """A llama GGUF whose matrices have the given types: types maps a role ('token_embd', 'output', 'attn_q',
    'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down') to a DType (Q4/Q8 or a block type);
    norms are f32 near 1. Tokenizer: a small SentencePiece-style vocabulary (add_bos). raw: tensor name -> (bytes,
    GGML type) written instead (any type, e.g. one cflow does not execute)."""
    import gguf

    rng = np.random.default_rng(seed)
    hd = d // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("blocks-test")
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    toks += [f"tok{i}" for i in range(vocab - len(toks))]
    TT = gguf.TokenType
    types_ = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256 + [TT.NORMAL] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([int(t) for t in types_])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def mat(role, rows, cols, std):
        return gguf_payload(quantised(types[role], rows, cols, rng, std)) if role in types else (
            (rng.standard_normal((rows, cols)) * std).astype(np.float32), None)

    def vec(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32), None

    tensors = [("token_embd.weight", mat("token_embd", vocab, d, 1.0))]
    for i in range(layers):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", vec(d)), (p + "ffn_norm.weight", vec(d)),
                    (p + "attn_q.weight", mat("attn_q", heads * hd, d, d ** -0.5)),
                    (p + "attn_k.weight", mat("attn_k", kv_heads * hd, d, d ** -0.5)),
                    (p + "attn_v.weight", mat("attn_v", kv_heads * hd, d, d ** -0.5)),
                    (p + "attn_output.weight", mat("attn_output", d, heads * hd, d ** -0.5)),
                    (p + "ffn_gate.weight", mat("ffn_gate", ffn, d, 2 * d ** -0.5)),
                    (p + "ffn_up.weight", mat("ffn_up", ffn, d, d ** -0.5)),
                    (p + "ffn_down.weight", mat("ffn_down", d, ffn, ffn ** -0.5))]
    tensors.append(("output_norm.weight", vec(d)))
    if not tied:
        tensors.append(("output.weight", mat("output", vocab, d, d ** -0.5)))
    for name, (data, kind) in tensors:
        data, kind = (raw or {}).get(name, (data, kind))
        if kind is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

