"""GGUF files (llama.cpp) -> IR: `from_gguf(path)`, behind `cflowc model.gguf` and `cflow.compile("model.gguf")`.

Reading. The header (metadata and tensor infos) is parsed here with every length, count, type,
dimension and offset checked against the file before it is used: one `GGUFError` naming the field
and its file offset, never a crash, a hang or an allocation the file size does not bound. The data
section is memory-mapped (numpy.memmap) and each tensor is read only when the compiler asks for it
(lazy weights, one tensor, or one expert's slice, at a time). The PyPI `gguf` package supplies the
type tables, token types and the dequantisers of every other type; its GGUFReader is not used: it
trusts the file (a lying array length loops for as long as the length says) and builds one numpy
object per array element (18 s for a 150k-token vocabulary).

Tensors are kept as the file stores them. Q4_0 and Q8_0 are cflow's Q4 and Q8 block for block (QTensors with the
same bytes); Q4_1, Q5_0, Q5_1, IQ4_NL, the K-quants and IQ4_XS become BlockTensors holding the file's bytes
(layout/blocks.py: a tile layout and kernels of their own); F32, F16 and BF16 become float32 exactly.
graph.meta.source_dtypes says which type each weight keeps under quant "stored" (cflowc's default for a GGUF);
any other type (IQ2_*, IQ3_*, TQ*, ...) is dequantised with `gguf.quants` and can only be compiled with --quant,
which requantises (a type the gguf package cannot dequantise, such as Q8_K, is refused by tensor name). A folded
multiplier (Gemma's embedding scale, Granite's) scales a quantised tensor's fp16 block scales, keeping its codes.
llama.cpp's `llama` architecture stores q/k rows in adjacent-pair RoPE order (convert_hf_to_gguf permutes them):
the inverse permutation is applied (rows, so block types keep their bytes).

Architectures: llama (Llama 1-3, Mistral; rope_freqs / linear / yarn scaling; Mixtral: merged ffn_*_exps expert
tensors), qwen2 (q/k/v biases), qwen2moe (shared gated expert), qwen3 (q/k norms), qwen3moe (same), gemma /
gemma2 / gemma3 (norms stored as 1 + w by the converter; the sqrt(d) embedding scale, soft-caps, sliding-window
pattern and local RoPE base as llama.cpp fixes them), phi3 (fused attn_qkv and gate+up ffn_up split by rows,
partial rotary, longrope factor tensors), olmoe (whole-projection q/k norms, no top-k renormalisation), granite
(embedding / residual / attention / logit scales from the metadata, folded into the weights). Every other
architecture is refused by name with the reason.

Tokenizer: `llama` (SentencePiece) vocabularies become a byte-fallback BPE whose merges follow the
scores, `gpt2` ones a byte-level BPE with the file's merges and the pre-tokeniser regex its
`tokenizer.ggml.pre` names; control / user-defined tokens become added tokens; bos/eos/eot ids and
`tokenizer.chat_template` are kept (graph.meta.tokenizer / chat_template / eos_token_ids).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import numpy as np

from ..errors import CflowError, UnsupportedModelError
from ..ir import Graph, build_graph, verify, weight_shapes
from ..ir.config import ModelConfig
from ..ir.gguf_names import BLOCK_TENSORS, EXPERT_TENSORS, FFN_NORMS, GLOBAL_TENSORS, rope_row_unpermutation
from ..ir.meta import special_tokens
from ..ir.rope import yarn_attention_factor
from ..layout.blocks import BlockTensor, is_block_type
from ..layout.quant import BLOCK, DType, QTensor, bf16_to_f32, dequantize
from .hf_weights import partial_rotary_permutation
from .tensors import LazyWeights

MAGIC = b"GGUF"
MAX_CONTEXT = 4096
MAX_ARRAY = 1 << 22  # elements in one metadata array (vocabularies are ~32k..262k; merges up to ~1M)
MAX_ELEMENTS = 1 << 23  # metadata array elements in the whole file
MAX_KEY = 1 << 16  # bytes of a key or tensor name
MAX_TENSORS = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_DEPTH = 1  # arrays of arrays are refused (llama.cpp reads none)

_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4), 7: ("?", 1),
            10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}

ARCHS = ("llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma", "gemma2", "gemma3", "phi3", "olmoe", "granite")
_PERMUTED = ("llama", "granite")  # llama.cpp's LLAMA_ROPE_TYPE_NORM archs whose converter reorders q/k rows
_REFUSED = {
    "deepseek2": "multi-head latent attention is not modelled",
    "mamba": "state-space models are not modelled",
    "rwkv6": "RWKV is not modelled",
    "bert": "encoder models are not modelled",
    "t5": "encoder-decoder models are not modelled",
}


class GGUFError(CflowError):
    """A GGUF file is malformed, truncated or lies about its own structure (names the field and offset)."""


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CflowError("reading GGUF files needs the 'gguf' package: pip install 'gguf>=0.17'") from None
    return gguf


# --- the header, bounded ------------------------------------------------------------------------
class _Tensor:
    __slots__ = ("name", "dims", "type", "offset", "nbytes", "info_at")

    def __init__(self, name, dims, type_, offset, nbytes, info_at):
        self.name, self.dims, self.type, self.offset, self.nbytes, self.info_at = \
            name, dims, type_, offset, nbytes, info_at

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (GGUF dims are innermost-first)."""
        return tuple(reversed(self.dims))


class GGUFFile:
    """A validated GGUF header and the memory-mapped file: `meta` (key -> value: int, float, bool, str,
    a numpy array or a list of str), `tensors` (name -> _Tensor, offsets absolute), `data(t)` (the raw bytes)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
        except (OSError, ValueError) as e:
            raise GGUFError(f"{self.path}: cannot open ({e})") from None
        self.pos = 0
        self.meta: dict = {}
        self.meta_at: dict[str, int] = {}
        self.tensors: dict[str, _Tensor] = {}
        self._elements = 0
        self._parse()

    # bounded primitives
    def _fail(self, what: str, at: int, why: str):
        raise GGUFError(f"{self.path}: {what} at offset {at:#x}: {why}")

    def _need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self._fail(what, self.pos, f"needs {n} bytes, but the file ends at {self.size:#x} (truncated or lying)")

    def _scalar(self, code: int, what: str):
        fmt, n = _SCALARS[code]
        self._need(n, what)
        v = struct.unpack_from("<" + fmt, self.mm, self.pos)[0]
        self.pos += n
        return v

    def _str(self, what: str, limit: int | None = None) -> str:
        at = self.pos
        n = self._scalar(10, f"{what} (string length)")
        if limit is not None and n > limit:
            self._fail(what, at, f"string length {n} exceeds the limit of {limit} bytes")
        self._need(n, f"{what} ({n}-byte string)")
        raw = self.mm[self.pos : self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self._fail(what, at, f"string is not UTF-8 ({e.reason} at byte {e.start})")

    def _value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            v = self._scalar(vtype, what)
            return bool(v) if vtype == 7 else v
        if vtype == STRING:
            return self._str(what)
        if vtype != ARRAY:
            self._fail(what, self.pos - 4, f"unknown value type {vtype}")
        at = self.pos
        etype = self._scalar(4, f"{what} (array element type)")
        count = self._scalar(10, f"{what} (array length)")
        if etype == ARRAY and depth >= MAX_DEPTH:
            self._fail(what, at, "arrays of arrays are not supported")
        if etype not in _SCALARS and etype not in (STRING, ARRAY):
            self._fail(what, at, f"unknown array element type {etype}")
        if count > MAX_ARRAY:
            self._fail(what, at, f"array of {count} elements exceeds the limit of {MAX_ARRAY}")
        self._elements += count
        if self._elements > MAX_ELEMENTS:
            self._fail(what, at, f"more than {MAX_ELEMENTS} metadata array elements in the file")
        if etype in _SCALARS:
            n = count * _SCALARS[etype][1]
            self._need(n, f"{what} ({count} x {_TYPE_NAMES[etype]})")
            arr = np.frombuffer(self.mm, dtype=_NP[etype], count=count, offset=self.pos).copy()
            self.pos += n
            return arr.astype(bool) if etype == 7 else arr
        minimum = 8 if etype == STRING else 12
        if count * minimum > self.size - self.pos:
            self._fail(what, at, f"array of {count} {_TYPE_NAMES[etype]}s cannot fit in the "
                                 f"{self.size - self.pos} bytes left")
        return [self._value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]

    def _parse(self) -> None:
        gguf = _gguf()
        self._need(4, "magic")
        if self.mm[0:4] != MAGIC:
            self._fail("magic", 0, f"{bytes(self.mm[0:4])!r} is not b'GGUF' (not a GGUF file)")
        self.pos = 4
        version = self._scalar(4, "version")
        if version not in (2, 3):
            why = "a big-endian GGUF (not supported)" if version & 0xFFFF == 0 else "only versions 2 and 3 are read"
            self._fail("version", 4, f"version {version}: {why}")
        n_tensors = self._scalar(10, "tensor_count")
        n_kv = self._scalar(10, "kv_count")
        if n_tensors > MAX_TENSORS or n_tensors * 24 > self.size:
            self._fail("tensor_count", 8, f"{n_tensors} tensors cannot fit in a {self.size}-byte file")
        if n_kv * 13 > self.size:
            self._fail("kv_count", 16, f"{n_kv} metadata entries cannot fit in a {self.size}-byte file")
        for i in range(n_kv):
            at = self.pos
            key = self._str(f"metadata entry {i} key", MAX_KEY)
            if key in self.meta:
                self._fail(f"metadata key {key!r}", at, "appears twice")
            vtype = self._scalar(4, f"metadata {key!r} type")
            self.meta_at[key] = at
            self.meta[key] = self._value(vtype, f"metadata {key!r}")
        align = self.meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1) or align > 1 << 16:
            self._fail("metadata 'general.alignment'", self.meta_at.get("general.alignment", 0),
                       f"{align!r} is not a power of two up to 65536")
        infos = []
        sizes = gguf.GGML_QUANT_SIZES
        types = {int(t) for t in gguf.GGMLQuantizationType}
        for i in range(n_tensors):
            at = self.pos
            name = self._str(f"tensor info {i} name", MAX_KEY)
            what = f"tensor {name!r}"
            if name in self.tensors or any(name == t[0] for t in infos):
                self._fail(what, at, "name appears twice")
            ndim = self._scalar(4, f"{what} n_dims")
            if not 1 <= ndim <= MAX_DIMS:
                self._fail(what, at, f"n_dims={ndim} out of range 1..{MAX_DIMS}")
            dims = tuple(self._scalar(10, f"{what} dim {k}") for k in range(ndim))
            if any(d < 1 for d in dims):
                self._fail(what, at, f"dims {dims}: every dimension must be >= 1")
            ttype = self._scalar(4, f"{what} type")
            if ttype not in types or gguf.GGMLQuantizationType(ttype) not in sizes:
                self._fail(what, at, f"unknown tensor type {ttype}")
            qt = gguf.GGMLQuantizationType(ttype)
            block, tsize = sizes[qt]
            n = 1
            for d in dims:
                n *= d  # Python ints: no overflow; bounded below by the file size
                if n > self.size * max(1, block):
                    self._fail(what, at, f"dims {dims} hold more elements than a {self.size}-byte file can")
            if dims[0] % block:
                self._fail(what, at, f"dims {dims}: {qt.name} rows must be whole blocks of {block}")
            nbytes = n // block * tsize
            offset = self._scalar(10, f"{what} offset")
            if offset % align:
                self._fail(what, at, f"data offset {offset:#x} is not a multiple of the alignment {align}")
            infos.append((name, dims, qt, offset, nbytes, at))
        data_start = -(-self.pos // align) * align
        spans = []
        for name, dims, qt, offset, nbytes, at in infos:
            start = data_start + offset
            if start + nbytes > self.size:
                self._fail(f"tensor {name!r}", at, f"data [{start:#x}, {start + nbytes:#x}) runs past the end of the "
                                                   f"file at {self.size:#x} (truncated?)")
            spans.append((start, start + nbytes, name, at))
            self.tensors[name] = _Tensor(name, dims, qt, start, nbytes, at)
        spans.sort()
        for (s0, e0, n0, _), (s1, _e1, n1, at1) in zip(spans, spans[1:]):
            if s1 < e0:
                self._fail(f"tensor {n1!r}", at1, f"data at {s1:#x} overlaps tensor {n0!r} [{s0:#x}, {e0:#x})")
        self.data_start = data_start

    # access
    def raw(self, t: _Tensor, start: int = 0, nbytes: int | None = None) -> np.ndarray:
        """uint8 view of (part of) a tensor's bytes (no copy: the file stays mapped)."""
        n = t.nbytes - start if nbytes is None else nbytes
        return np.frombuffer(self.mm, dtype=np.uint8, count=n, offset=t.offset + start)

    def get(self, key: str, kind, default=None, required: bool = False):
        """A metadata value checked to be of `kind` (int, float, str, bool, 'ints', 'floats', 'strs')."""
        if key not in self.meta:
            if required:
                raise GGUFError(f"{self.path}: metadata {key!r} is missing")
            return default
        v, at = self.meta[key], self.meta_at[key]
        ok = {
            int: lambda x: isinstance(x, int) and not isinstance(x, bool),
            float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x),
            str: lambda x: isinstance(x, str),
            bool: lambda x: isinstance(x, bool),
            "ints": lambda x: isinstance(x, np.ndarray) and x.dtype.kind in "iu",
            "floats": lambda x: isinstance(x, np.ndarray) and x.dtype.kind in "iuf",
            "strs": lambda x: isinstance(x, list) and all(isinstance(s, str) for s in x),
        }[kind](v)
        if not ok:
            want = kind.__name__ if isinstance(kind, type) else f"an array of {kind}"
            raise GGUFError(f"{self.path}: metadata {key!r} at offset {at:#x}: expected {want}, got {type(v).__name__}")
        if kind is float:  # stored as float32 (most writers): its shortest decimal, e.g. 1e-05 not 9.99999974e-06
            return float(str(np.float32(v))) if isinstance(v, float) and float(np.float32(v)) == v else float(v)
        return v

    def close(self) -> None:
        if isinstance(self.mm, mmap.mmap):
            try:
                self.mm.close()
            except BufferError:  # a weight view still alive: the mapping goes with it
                pass


# --- tensors ---------------------------------------------------------------------------------------
def _qtensor(raw: np.ndarray, rows: int, cols: int, dt: DType) -> QTensor:
    """GGUF Q4_0 / Q8_0 block bytes [rows, nblk * bs] -> QTensor (the inverse of layout.quant.to_gguf_bytes)."""
    nblk = cols // BLOCK
    bs = 18 if dt == DType.Q4 else 34
    b = np.asarray(raw).reshape(rows, nblk, bs)
    scales = np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(rows, nblk)
    if dt == DType.Q4:
        qs = b[..., 2:]
        q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).astype(np.uint8)
    else:
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
    return QTensor(dtype=dt, rows=rows, cols=cols, scales=np.ascontiguousarray(scales), q=np.ascontiguousarray(q))


def _permute_rows(w, perm):
    if perm is None:
        return w
    if isinstance(w, BlockTensor):
        return w.take_rows(perm)
    if isinstance(w, QTensor):
        return QTensor(dtype=w.dtype, rows=w.rows, cols=w.cols, scales=w.scales[perm], q=w.q[perm])
    return np.ascontiguousarray(w[perm])


class _Loader:
    """Loads one IR weight from the file: the whole tensor, expert `e` of a 3-D one, or a block of rows of a fused
    2-D one (Phi-3's attn_qkv and gate+up ffn_up); 1-D weights may be reshaped (the shared-expert gate [d] -> [1, d]);
    rows may be reordered (perm) and a folded scalar multiplied in (scale: Gemma's embedding scale, Granite's
    multipliers; a Q4_0/Q8_0 tensor that is scaled is dequantised first, so it is requantised, not copied)."""

    def __init__(self, f: GGUFFile, t: _Tensor, expert: int | None = None, perm=None, shape=None, rows=None,
                 scale: float = 1.0):
        self.f, self.t, self.expert, self.perm, self.shape, self.rows, self.scale = \
            f, t, expert, perm, shape, rows, scale

    def __call__(self):
        gguf = _gguf()
        f, t = self.f, self.t
        Q = gguf.GGMLQuantizationType
        block, tsize = gguf.GGML_QUANT_SIZES[t.type]
        cols = t.dims[0]
        row_bytes = (cols // block) * tsize
        rows = int(np.prod(t.dims[1:])) if len(t.dims) > 1 else 1
        start = 0
        if self.expert is not None:  # one expert of [E, rows_e, cols]
            rows = t.dims[1]
            start = self.expert * rows * row_bytes
        if self.rows is not None:  # rows [r0, r0 + n) of a fused [rows, cols] tensor
            r0, rows = self.rows
            start += r0 * row_bytes
        raw = f.raw(t, start, rows * row_bytes)
        kept = stored_dtype(t.type)
        if t.type == Q.Q4_0 or t.type == Q.Q8_0:
            w = _qtensor(raw, rows, cols, DType.Q4 if t.type == Q.Q4_0 else DType.Q8)
        elif kept is not None and is_block_type(kept):
            w = BlockTensor(kept, rows, cols, np.array(raw).reshape(rows, -1))
        elif t.type == Q.F32:
            w = raw.view("<f4").reshape(rows, cols).astype(np.float32)
        elif t.type == Q.F16:
            w = raw.view("<f2").reshape(rows, cols).astype(np.float32)
        elif t.type == Q.BF16:
            w = bf16_to_f32(raw.view("<u2")).reshape(rows, cols)
        else:
            try:
                w = np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), t.type), np.float32).reshape(rows, cols)
            except NotImplementedError:
                raise GGUFError(f"{f.path}: tensor {t.name!r}: type {t.type.name} cannot be dequantised by the gguf "
                                "package") from None
        if len(t.dims) == 1 or (self.shape is not None and len(self.shape) == 1):
            w = dequantize(w).reshape(-1)
        if self.scale != 1.0:
            w = _scaled(w, self.scale, f.path, t)
        w = _permute_rows(w, self.perm)
        if self.shape is not None and not isinstance(w, (QTensor, BlockTensor)):
            w = w.reshape(self.shape)
        return w


def _scaled(w, s: float, path: str, t: _Tensor):
    """A folded multiplier: a quantised tensor keeps its type and codes, its fp16 block scales multiplied
    (rounded to fp16: 2^-11 relative, far below the codes' step); a float one is multiplied."""
    if isinstance(w, BlockTensor):
        try:
            return w.scaled(s)
        except ValueError as e:
            raise GGUFError(f"{path}: tensor {t.name!r} at offset {t.info_at:#x}: {e}") from None
    if isinstance(w, QTensor):
        sc = (w.scales.astype(np.float32) * np.float32(s)).astype(np.float16)
        if not np.isfinite(sc).all():
            raise GGUFError(f"{path}: tensor {t.name!r} at offset {t.info_at:#x}: scaling by {s} overflows fp16")
        return QTensor(dtype=w.dtype, rows=w.rows, cols=w.cols, scales=sc, q=w.q)
    return (dequantize(w) * np.float32(s)).astype(np.float32)


def stored_dtype(ggml_type) -> DType | None:
    """The cflow type a GGUF tensor type is kept as (None: a type cflow does not execute, e.g. IQ2_XXS)."""
    name = getattr(ggml_type, "name", str(ggml_type))
    if name in ("F32", "BF16"):  # bf16 widens to f32 exactly
        return DType.F32
    if name == "F16":
        return DType.F16
    try:
        dt = DType.parse(name)
    except ValueError:
        return None
    return dt if dt.quantised else None


# --- architecture -> config ------------------------------------------------------------------------
_GEMMA = ("gemma", "gemma2", "gemma3")
_SWA = {"gemma2": 2, "gemma3": 6}  # llama.cpp's set_swa_pattern(n): layer il slides when il % n < n - 1
_BIG_GEMMA = {"gemma2": 46, "gemma3": 62}  # the 27B layer counts: llama.cpp scales q by 1/sqrt(d / H) there


class _ArchKeys:
    """The `{arch}.*` metadata keys of a file, read as llama.cpp reads them for that architecture."""

    def __init__(self, f: GGUFFile, arch: str):
        self.f, self.arch = f, arch

    def __call__(self, key: str, kind, default=None, required: bool = False):
        return self.f.get(f"{self.arch}.{key}", kind, default, required)

    def uniform(self, key: str, default=None) -> int | None:
        """An integer key that some converters write per layer: an array must hold one value."""
        f, full = self.f, f"{self.arch}.{key}"
        v = f.meta.get(full, default)
        if isinstance(v, np.ndarray):  # per-layer arrays (some converters): must be uniform
            if v.size == 0 or (v != v[0]).any():
                raise UnsupportedModelError(f"{f.path}: metadata '{full}' differs per layer: not modelled")
            v = int(v[0])
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            raise GGUFError(f"{f.path}: metadata '{full}' at offset {f.meta_at[full]:#x}: expected an integer")
        return v


def _config(f: GGUFFile, arch: str, name: str, max_seq_len: int | None) -> tuple[ModelConfig, dict]:
    """ModelConfig from the metadata, as llama.cpp reads it for `arch`, and the extras the weight plan needs:
    'consumed' (tensors turned into config, e.g. RoPE factors) and 'folds' (scalars folded into the weights)."""
    k = _ArchKeys(f, arch)
    d, L, H, KV, hd = _dims(k)
    kw: dict = {}
    consumed: set = set()
    rope_dim = _rope_dim(k, hd)
    if rope_dim != hd:
        kw["rope_dim"] = rope_dim  # NEOX order, as Hugging Face's: the rows are reordered in the plan
    eps = k("attention.layer_norm_rms_epsilon", float, required=True)
    theta = k("rope.freq_base", float, 10000.0)
    ctx_file = k("context_length", int, MAX_CONTEXT)
    ctx = int(max_seq_len or min(ctx_file, MAX_CONTEXT))
    emb = f.tensors.get("token_embd.weight")
    if emb is None or len(emb.dims) != 2 or emb.dims[0] != d:
        raise GGUFError(f"{f.path}: tensor 'token_embd.weight' missing or not [vocab, {d}]")
    scaling = _rope_scaling(k, rope_dim, ctx, consumed)
    if scaling is not None:
        kw["rope_scaling"] = scaling
    kw.update(_ffn(k, L))
    kw.update(_variants(k, hd))
    kw.update(_windows(f, arch, L, ctx, theta, "rope_scaling" in kw))
    folds = _folds(k, d, L, H, hd)
    try:
        c = ModelConfig(name=name, vocab_size=emb.dims[1], d_model=d, n_layers=L, n_heads=H, n_kv_heads=KV,
                        head_dim=hd, rope_theta=theta, norm_eps=eps, max_seq_len=ctx,
                        tie_embeddings="output.weight" not in f.tensors,
                        attn_bias="blk.0.attn_q.bias" in f.tensors, **kw)
    except CflowError as e:
        raise GGUFError(f"{f.path}: the metadata does not describe a valid model: {e}") from None
    return c, {"consumed": consumed, "folds": folds}


def _dims(k: _ArchKeys) -> tuple[int, int, int, int, int]:
    """(d_model, layers, heads, kv heads, head dim), each bounded."""
    f, arch = k.f, k.arch
    d = k("embedding_length", int, required=True)
    L = k("block_count", int, required=True)
    H = k.uniform("attention.head_count")
    if H is None:
        raise GGUFError(f"{f.path}: metadata '{arch}.attention.head_count' is missing")
    KV = k.uniform("attention.head_count_kv", H)
    for key, v in (("embedding_length", d), ("block_count", L), ("attention.head_count", H),
                   ("attention.head_count_kv", KV)):
        if not 1 <= v <= 1 << 20:
            raise GGUFError(f"{f.path}: metadata '{arch}.{key}'={v} out of range 1..{1 << 20}")
    hd = k("attention.key_length", int, d // H)
    if k("attention.value_length", int, hd) != hd:
        raise UnsupportedModelError(f"{f.path}: '{arch}.attention.value_length' != key_length: not modelled")
    return d, L, H, KV, hd


def _rope_dim(k: _ArchKeys, hd: int) -> int:
    """The rotated dimensions of a head (partial rotary below hd), and the RoPE the IR cannot model refused."""
    f, arch = k.f, k.arch
    rope_dim = k("rope.dimension_count", int, hd)
    if rope_dim != hd:
        if arch in _PERMUTED:
            raise UnsupportedModelError(f"{f.path}: '{arch}.rope.dimension_count'={rope_dim} < head dim {hd}: partial "
                                        f"rotary embeddings in {arch!r}'s adjacent-pair row order are not read")
        if not (2 <= rope_dim < hd and rope_dim % 2 == 0):
            raise GGUFError(f"{f.path}: metadata '{arch}.rope.dimension_count'={rope_dim}: expected an even count "
                            f"up to the head dim {hd}")
    if arch == "granite" and f.get("granite.rope.scaling.finetuned", bool, True) is False:
        raise UnsupportedModelError(f"{f.path}: 'granite.rope.scaling.finetuned'=false: attention without RoPE is "
                                    "not modelled")
    return rope_dim


def _rope_scaling(k: _ArchKeys, rope_dim: int, ctx: int, consumed: set) -> dict | None:
    """The config's rope_scaling: from `{arch}.rope.scaling.*` (linear, yarn), or from factor tensors (Llama 3.1's
    rope_freqs, Phi-3's long/short factors: longrope), which are added to `consumed`; None: unscaled."""
    f, arch = k.f, k.arch
    scaling = None
    stype = k("rope.scaling.type", str, "none")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": k("rope.scaling.factor", float, required=True)}
    elif stype == "yarn":
        factor = k("rope.scaling.factor", float, required=True)
        orig = k("rope.scaling.original_context_length", int, required=True)
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
                   "attention_factor": k("rope.scaling.attn_factor", float, yarn_attention_factor(factor)),
                   "beta_fast": k("rope.scaling.yarn_beta_fast", float, 32.0),
                   "beta_slow": k("rope.scaling.yarn_beta_slow", float, 1.0)}
    elif stype != "none":
        raise UnsupportedModelError(f"{f.path}: '{arch}.rope.scaling.type'={stype!r} is not modelled "
                                    "(none, linear, yarn)")

    def factors(t: _Tensor) -> list[float]:
        if t.dims != (rope_dim // 2,):
            raise GGUFError(f"{f.path}: tensor {t.name!r} at offset {t.info_at:#x}: dims {t.dims}, expected "
                            f"({rope_dim // 2},)")
        out = [float(x) for x in np.asarray(_Loader(f, t)(), np.float64).reshape(-1)]
        if not all(x > 0 and np.isfinite(x) for x in out):
            raise GGUFError(f"{f.path}: tensor {t.name!r}: factors must be positive")
        consumed.add(t.name)
        return out

    rf = f.tensors.get("rope_freqs.weight")
    long_, short = f.tensors.get("rope_factors_long.weight"), f.tensors.get("rope_factors_short.weight")
    if (rf is not None or long_ is not None or short is not None) and scaling is not None:
        raise UnsupportedModelError(f"{f.path}: RoPE factor tensors together with '{arch}.rope.scaling.type'")
    if rf is not None:  # Llama 3.1+: per-frequency divisors, i.e. longrope with one factor set and no attention factor
        fs = factors(rf)
        scaling = {"rope_type": "longrope", "short_factor": fs, "long_factor": fs,
                   "original_max_position_embeddings": max(ctx, 1), "attention_factor": 1.0}
    elif long_ is not None or short is not None:  # Phi-3 longrope: short factors up to the original context
        if long_ is None or short is None:
            raise GGUFError(f"{f.path}: only one of rope_factors_long.weight / rope_factors_short.weight")
        orig = k("rope.scaling.original_context_length", int, required=True)
        scaling = {"rope_type": "longrope", "short_factor": factors(short), "long_factor": factors(long_),
                   "original_max_position_embeddings": orig,
                   "attention_factor": k("rope.scaling.attn_factor", float, 1.0)}
        if ctx > orig:
            warnings.warn(f"{f.path}: longrope uses its long factors at every position for a context of {ctx} > "
                          f"{orig} tokens, as llama.cpp does (transformers uses the short ones for shorter "
                          f"sequences; compile with max_seq_len <= {orig} for them)", stacklevel=4)
    return scaling


def _ffn(k: _ArchKeys, L: int) -> dict:
    """Config fields of the feed-forward blocks: which layers are dense and which expert banks (found by their
    tensors), the widths, the expert count, top-k, its renormalisation and the shared expert."""
    f, arch = k.f, k.arch
    kw: dict = {}
    fused_up = arch == "phi3"  # Phi-3's ffn_up holds the gate rows, then the up rows (llama.cpp's SWIGLU split)
    dense = [i + 1 for i in range(L) if f"blk.{i}.ffn_gate.weight" in f.tensors
             or (fused_up and f"blk.{i}.ffn_up.weight" in f.tensors)]
    moe = [i + 1 for i in range(L) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    both = sorted(set(dense) & set(moe))
    if both:
        raise UnsupportedModelError(f"{f.path}: block {both[0] - 1} has both a dense FFN and experts: not modelled")
    missing = sorted(set(range(1, L + 1)) - set(dense) - set(moe))
    if missing:
        raise GGUFError(f"{f.path}: block {missing[0] - 1} has no feed-forward tensors (blk.{missing[0] - 1}.ffn_gate "
                        "or ffn_gate_inp)")
    if not moe:
        kw["ffn_dim"] = k("feed_forward_length", int, required=True)
        return kw
    if arch not in ("llama", "qwen2moe", "qwen3moe", "olmoe"):
        raise UnsupportedModelError(f"{f.path}: architecture {arch!r} with expert tensors is not modelled")
    E = k("expert_count", int, required=True)
    # Mixtral ('llama' with experts) and OLMoE: convert_hf_to_gguf writes the experts' width as
    # feed_forward_length and no expert_feed_forward_length; llama.cpp renormalises Mixtral's top-k weights
    # (as transformers does), never OLMoE's (its graph passes norm_w = false whatever the metadata says)
    width_is_ff = arch in ("llama", "olmoe")
    if arch == "llama" and dense:
        raise UnsupportedModelError(f"{f.path}: architecture 'llama' mixing dense and expert blocks is not "
                                    "modelled")
    edim = k("expert_feed_forward_length", int, None)
    if edim is None:
        edim = k("feed_forward_length" if width_is_ff else "expert_feed_forward_length", int, required=True)
    norm_topk = False if arch == "olmoe" else f.get(f"{arch}.expert_weights_norm", bool, arch in ("llama",
                                                                                                 "qwen3moe"))
    kw.update(n_experts=E, top_k=k("expert_used_count", int, required=True), expert_dim=edim, norm_topk=norm_topk)
    shexp = k("expert_shared_feed_forward_length", int, 0)
    if "blk.0.ffn_gate_shexp.weight" in f.tensors:
        kw.update(shared_expert_dim=shexp or f.tensors["blk.0.ffn_gate_shexp.weight"].dims[1],
                  shared_expert_gate="blk.0.ffn_gate_inp_shexp.weight" in f.tensors)
    if dense:
        kw.update(ffn_dim=k("feed_forward_length", int, required=True), dense_layers=dense, moe_layers=moe)
    return kw


def _variants(k: _ArchKeys, hd: int) -> dict:
    """Config fields of the per-family variants: q/k norms (found by their tensors) and Gemma's activation, sandwich
    norms and soft-caps."""
    f, arch = k.f, k.arch
    kw: dict = {}
    if "blk.0.attn_q_norm.weight" in f.tensors:
        qn = f.tensors["blk.0.attn_q_norm.weight"]
        kw["qk_norm"] = "head" if qn.dims == (hd,) else "proj"
    # Gemma: GeGLU (ggml_gelu is the tanh approximation), norms already stored as 1 + w by the converter,
    # the embedding scaled by sqrt(d) in the graph, Gemma 2/3 sandwich norms, soft-caps and sliding windows
    if arch in _GEMMA:
        kw["activation"] = "gelu_tanh"
    if arch in ("gemma2", "gemma3"):
        kw["post_norms"] = True
    if arch == "gemma2":  # llama.cpp's defaults when the keys are absent
        kw.update(attn_softcap=k("attn_logit_softcapping", float, 50.0),
                  final_softcap=k("final_logit_softcapping", float, 30.0))
    elif arch == "gemma3":
        kw["final_softcap"] = k("final_logit_softcapping", float, 0.0)
    return kw


def _folds(k: _ArchKeys, d: int, L: int, H: int, hd: int) -> dict:
    """Scalars folded into the weights: Gemma's sqrt(d) embedding scale (and the 27B's query scale), Granite's
    embedding, residual, logit and attention multipliers."""
    f, arch = k.f, k.arch
    folds = {"embed": 1.0, "logit": 1.0, "residual": 1.0, "q": 1.0}
    if arch in _GEMMA:
        folds["embed"] = float(np.sqrt(np.float32(d)))
        if L == _BIG_GEMMA.get(arch):
            folds["q"] = float(np.sqrt(hd / (d / H)))
    elif arch == "granite":  # convert_hf_to_gguf renames the *_multiplier fields to *_scale; 0 or absent = none
        folds["embed"] = k("embedding_scale", float, 0.0) or 1.0
        folds["residual"] = k("residual_scale", float, 0.0) or 1.0
        logit = k("logit_scale", float, required=True)
        if not logit > 0:
            raise GGUFError(f"{f.path}: metadata 'granite.logit_scale'={logit}: expected > 0")
        folds["logit"] = 1.0 / logit
        attn = k("attention.scale", float, 0.0)
        if attn:
            folds["q"] = attn * float(np.sqrt(hd))
    return folds


def _windows(f: GGUFFile, arch: str, L: int, ctx: int, theta: float, scaled: bool) -> dict:
    """Sliding-window fields as llama.cpp sets them: Gemma 2 every other layer (window 4096 when the key is
    absent), Gemma 3 five of every six with RoPE base 10000 and no scaling there, Phi-3 every layer (llama.cpp
    turns Phi's window off; transformers applies it, and so do we). `{arch}.attention.sliding_window_pattern`
    (a period or per-layer flags) overrides the pattern. Other architectures: llama.cpp reads no window."""
    if arch not in ("gemma2", "gemma3", "phi3"):
        return {}
    window = f.get(f"{arch}.attention.sliding_window", int, 4096 if arch == "gemma2" else 0)
    if not window:
        return {}
    pattern = f.meta.get(f"{arch}.attention.sliding_window_pattern", _SWA.get(arch, 0))
    if isinstance(pattern, np.ndarray) and pattern.dtype == bool and len(pattern) == L:
        sliding = [i + 1 for i in range(L) if pattern[i]]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        sliding = [i + 1 for i in range(L) if pattern == 0 or i % pattern < pattern - 1]
    else:
        raise GGUFError(f"{f.path}: metadata '{arch}.attention.sliding_window_pattern': expected a period or "
                        f"{L} per-layer flags")
    if not sliding:
        return {}
    kw: dict = {}
    layers = None if len(sliding) == L else sliding
    if window < ctx:
        kw.update(sliding_window=window, sliding_layers=layers)
    if arch == "gemma3":
        local = f.get("gemma3.rope.freq_base_swa", float, 10000.0)
        if local != theta or scaled:  # the sliding layers turn at their own base, unscaled
            kw.update(sliding_window=window, sliding_layers=layers, local_rope_theta=local)
    return kw


# GGUF tensor in blk.N -> IR weight in blocks.N (ffn_norm.weight, which names either norm, is read by the layer's kind)
_BLOCK = {g: ir for ir, g in BLOCK_TENSORS.items() if ir not in FFN_NORMS}
_EXPERTS = {g: role for role, g in EXPERT_TENSORS.items()}  # stacked GGUF tensor -> the expert matrix it holds
_RESIDUAL = ("attn.wo", "ffn.w_down", "moe.shared.w_down")  # the branch outputs Granite's residual_scale multiplies


def _plan(f: GGUFFile, c: ModelConfig, arch: str, extra: dict) -> dict:
    shapes = weight_shapes(c)
    plan: dict = {}
    used = set(extra["consumed"])
    folds = extra["folds"]
    hd = c.head_dim
    if arch in _PERMUTED:
        perm_q, perm_k = rope_row_unpermutation(c.n_heads, hd), rope_row_unpermutation(c.n_kv_heads, hd)
        perm_qn = perm_kn = None
    elif c.rope_dim != hd:  # partial rotary (Phi-4-mini): the rotated pairs first in each half, as ir/rope.py wants
        head = partial_rotary_permutation(hd, c.rope_dim)
        perm_q = (np.arange(c.n_heads)[:, None] * hd + head[None, :]).reshape(-1)
        perm_k = (np.arange(c.n_kv_heads)[:, None] * hd + head[None, :]).reshape(-1)
        perm_qn, perm_kn = (head, head) if c.qk_norm == "head" else (perm_q, perm_k)
    else:
        perm_q = perm_k = perm_qn = perm_kn = None
    q_scale = 1.0 if c.qk_norm else folds["q"]  # with q normalised, the scale goes on the q norm
    scales = {"tok_embeddings": folds["embed"],
              "norm": folds["logit"] / (folds["embed"] if c.tie_embeddings else 1.0)}
    perms = {"attn.wq": perm_q, "attn.bq": perm_q, "attn.wk": perm_k, "attn.bk": perm_k,
             "attn.q_norm": perm_qn, "attn.k_norm": perm_kn}

    def add(ir: str, t: _Tensor, expert=None, perm=None, rows=None, scale=1.0) -> None:
        if ir not in shapes:
            return  # left unused: named below as not modelled for this architecture
        want = tuple(shapes[ir])
        got = t.shape[1:] if expert is not None else ((rows[1],) + t.shape[1:] if rows is not None else t.shape)
        if tuple(got) != want and not (ir.endswith("shared_gate") and tuple(got) == want[1:]):
            raise GGUFError(f"{f.path}: tensor {t.name!r} at offset {t.info_at:#x}: shape {tuple(got)}, the metadata "
                            f"implies {want}")
        plan[ir] = _Loader(f, t, expert, perm, want if ir.endswith("shared_gate") else None, rows, scale)
        used.add(t.name)

    def role_scale(role: str) -> float:
        if role in ("attn.wq", "attn.bq"):
            return q_scale
        if role == "attn.q_norm":
            return folds["q"]
        return folds["residual"] if role in _RESIDUAL else 1.0

    for ir, gname in GLOBAL_TENSORS.items():
        if gname in f.tensors and (ir != "lm_head" or not c.tie_embeddings):
            add(ir, f.tensors[gname], scale=scales.get(ir, 1.0))
    q_rows, kv_rows = c.n_heads * hd, c.n_kv_heads * hd
    for i in range(c.n_layers):
        moe_layer = c.has_moe(i + 1)
        qkv = f.tensors.get(f"blk.{i}.attn_qkv.weight")
        if qkv is not None:  # Phi-3: q, k, v rows stacked
            if qkv.dims != (c.d_model, q_rows + 2 * kv_rows):
                raise GGUFError(f"{f.path}: tensor {qkv.name!r} at offset {qkv.info_at:#x}: dims {qkv.dims}, the "
                                f"metadata implies {(c.d_model, q_rows + 2 * kv_rows)}")
            for role, r0, n in (("attn.wq", 0, q_rows), ("attn.wk", q_rows, kv_rows),
                                ("attn.wv", q_rows + kv_rows, kv_rows)):
                add(f"blocks.{i}.{role}", qkv, rows=(r0, n), perm=perms.get(role), scale=role_scale(role))
        up = f.tensors.get(f"blk.{i}.ffn_up.weight")
        fused_up = arch == "phi3" and up is not None and f"blk.{i}.ffn_gate.weight" not in f.tensors
        for suffix, role in _BLOCK.items():
            t = f.tensors.get(f"blk.{i}.{suffix}")
            if t is None or (fused_up and suffix == "ffn_up.weight"):
                continue
            add(f"blocks.{i}.{role}", t, perm=perms.get(role), scale=role_scale(role))
        if fused_up:
            I = c.ffn_dim
            if up.dims != (c.d_model, 2 * I):
                raise GGUFError(f"{f.path}: tensor {up.name!r} at offset {up.info_at:#x}: dims {up.dims}, the "
                                f"metadata implies {(c.d_model, 2 * I)} (gate rows, then up rows)")
            add(f"blocks.{i}.ffn.w_gate", up, rows=(0, I))
            add(f"blocks.{i}.ffn.w_up", up, rows=(I, I))
        ffn_norm = "moe_norm" if moe_layer else "ffn_norm"
        norm = f.tensors.get(f"blk.{i}.{BLOCK_TENSORS[ffn_norm]}")
        if norm is not None:
            add(f"blocks.{i}.{ffn_norm}", norm)
        for suffix, role in _EXPERTS.items():
            t = f.tensors.get(f"blk.{i}.{suffix}")
            if t is None:
                continue
            if len(t.dims) != 3 or t.dims[2] != c.n_experts:
                raise GGUFError(f"{f.path}: tensor {t.name!r} at offset {t.info_at:#x}: dims {t.dims}, expected "
                                f"3 dims with {c.n_experts} experts")
            for e in range(c.n_experts):
                add(f"blocks.{i}.moe.experts.{e}.{role}", t, expert=e,
                    scale=folds["residual"] if role == "w_down" else 1.0)
    left = [n for n in f.tensors if n not in used]
    if left:
        t = f.tensors[left[0]]
        raise UnsupportedModelError(f"{f.path}: tensor {t.name!r} (info at offset {t.info_at:#x}) is not modelled "
                                    f"by the IR for architecture {arch!r} ({len(left)} unused)")
    missing = sorted(set(shapes) - set(plan))
    if missing:
        raise GGUFError(f"{f.path}: no tensor for weight {missing[0]!r} (expected its llama.cpp name)")
    return plan


def _check_types(f: GGUFFile, plan: dict) -> None:
    """Refuse, before anything is compiled, a tensor type the gguf package cannot dequantise (Q8_K: llama.cpp's
    intermediate type for activations, which its tools never store in a file, has no dequantiser there)."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    seen: dict = {}  # type -> whether it dequantises
    for ld in plan.values():
        t = ld.t
        if t.type in (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q8_0):
            continue
        if t.type not in seen:
            block, tsize = gguf.GGML_QUANT_SIZES[t.type]
            try:  # one all-zero block: every type decodes it (to zeros) if it decodes anything
                gguf.quants.dequantize(np.zeros((1, tsize), np.uint8), t.type)
                seen[t.type] = True
            except NotImplementedError:
                seen[t.type] = False
        if not seen[t.type]:
            raise UnsupportedModelError(f"{f.path}: tensor {t.name!r} (info at offset {t.info_at:#x}) is stored as "
                                        f"{t.type.name}, which the gguf package cannot dequantise")


def source_types(f: GGUFFile, plan: dict) -> tuple[dict, dict]:
    """(IR weight -> the cflow type it is kept as, IR weight -> a note naming its tensor, offset and type): what
    quant 'stored' keeps, and what it names when a type cannot be kept (passes/quantize.py)."""
    kept, notes = {}, {}
    for ir_name, ld in plan.items():
        t = ld.t
        notes[ir_name] = f"tensor {t.name!r} (info at offset {t.info_at:#x}) of {f.path} is stored as {t.type.name}"
        dt = stored_dtype(t.type)
        if dt is not None:
            kept[ir_name] = dt
    return kept, notes


# --- tokenizer ---------------------------------------------------------------------------------------
# Pre-tokeniser regexes, as llama.cpp's llm_tokenizer_bpe applies them: each regex in turn splits every piece the
# previous one left (matches and the text between them both kept: tokenizers' Split "Isolated").
_REGEX = {
    "gpt2": [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"],
    "llama3": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
    "qwen2": [r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+"],
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT (tokenizer.ggml.pre "default", or absent): punctuation runs first, then GPT-2's
    # regex, then digit runs, then digits in threes from the left (so "12345" -> "123", "45", "!!," one piece)
    "default": [r"[\p{P}\$\+<=>\^~\|]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"\p{N}+", r"[0-9][0-9][0-9]"],
    # LLAMA_VOCAB_PRE_TYPE_STARCODER and the names llama.cpp maps to it (SmolLM among them): single digits first
    "starcoder": [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"],
}
# tokenizer.ggml.pre -> the regex list above, as llama.cpp's llama_vocab::impl::load maps the names it knows
_PRE = {"default": "default", "gpt-2": "gpt2", "gpt2": "gpt2", "phi-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2",
        "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
        "falcon3": "llama3", "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "stablelm2": "qwen2", "megrez": "qwen2",
        "smollm": "starcoder", "starcoder": "starcoder", "refact": "starcoder", "command-r": "starcoder",
        "codeshell": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder"}
# The pre-tokenisers after which llama.cpp adds BOS by default (a BPE vocabulary otherwise adds none; a
# SentencePiece one always does), before tokenizer.ggml.add_bos_token, which wins when present.
_PRE_ADDS_BOS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "tekken", "chameleon")


def _added(i: int, text: str, special: bool) -> dict:
    return {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special}


def special_tokens_from_gguf(f: GGUFFile, model: str | None, n: int) -> dict | None:
    """BOS / EOS and whether prompts carry them, as llama.cpp decides (llama_vocab::impl::load): a SentencePiece
    ('llama') vocabulary adds BOS (id 1 unless the file names one), a BPE ('gpt2') one only after the pre-tokenisers
    in _PRE_ADDS_BOS; tokenizer.ggml.add_bos_token / add_eos_token win when present."""
    if model not in ("llama", "gpt2"):
        return None
    pre = f.get("tokenizer.ggml.pre", str, "default")
    bos = f.get("tokenizer.ggml.bos_token_id", int, 1 if model == "llama" else None)
    eos = f.get("tokenizer.ggml.eos_token_id", int, 2 if model == "llama" else None)
    add_bos = f.get("tokenizer.ggml.add_bos_token", bool)
    add_eos = f.get("tokenizer.ggml.add_eos_token", bool)
    source = ("tokenizer.ggml.add_bos_token" if add_bos is not None else
              f"llama.cpp's default for a {model!r} vocabulary" + (f" with pre-tokeniser {pre!r}" if model == "gpt2"
                                                                  else ""))
    if add_bos is None:
        add_bos = model == "llama" or pre in _PRE_ADDS_BOS
    if bos is not None and not 0 <= bos < n:
        bos = None
    if eos is not None and not 0 <= eos < n:
        eos = None
    return special_tokens(bos, eos, bool(add_bos), bool(add_eos), source=source)


def tokenizer_from_gguf(f: GGUFFile) -> tuple[str | None, dict | None, list[int]]:
    """(tokenizer.json text, chat template dict, eos ids) from the file's tokenizer.ggml.* metadata."""
    TT = _gguf().TokenType
    model = f.get("tokenizer.ggml.model", str)
    tokens = f.get("tokenizer.ggml.tokens", "strs")
    template = f.get("tokenizer.chat_template", str)
    bos = f.get("tokenizer.ggml.bos_token_id", int)
    eos_ids = [v for v in (f.get(f"tokenizer.ggml.{k}_token_id", int) for k in ("eos", "eot", "eom")) if v is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    if model is None or tokens is None:
        chat = {"template": template, "bos_token": None, "eos_token": None} if template else None
        return None, chat, eos_ids
    n = len(tokens)
    bad = [i for i in eos_ids + ([bos] if bos is not None else []) if not 0 <= i < n]
    if bad:
        raise GGUFError(f"{f.path}: special token id {bad[0]} out of range 0..{n - 1}")
    types = f.get("tokenizer.ggml.token_type", "ints")
    if types is None:
        types = np.full(n, int(TT.NORMAL))
    if len(types) != n:
        raise GGUFError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    unk = f.get("tokenizer.ggml.unknown_token_id", int)
    added, vocab = [], {}
    for i, (t, ty) in enumerate(zip(tokens, types.tolist())):
        if ty in (int(TT.CONTROL), int(TT.USER_DEFINED)) or (ty == int(TT.UNKNOWN) and model == "llama"):
            added.append(_added(i, t, ty != int(TT.USER_DEFINED)))
        vocab.setdefault(t, i)
    if len(vocab) != n:
        warnings.warn(f"{f.path}: {n - len(vocab)} duplicate token strings; the later ids decode only", stacklevel=3)
    if model == "llama":
        scores = f.get("tokenizer.ggml.scores", "floats")
        if scores is None or len(scores) != n:
            raise GGUFError(f"{f.path}: a 'llama' vocabulary needs tokenizer.ggml.scores for every token")
        normal = {t: float(s) for t, s, ty in zip(tokens, scores.tolist(), types.tolist())
                  if ty in (int(TT.NORMAL), int(TT.USER_DEFINED), int(TT.UNUSED))}
        merges = []
        for piece, score in normal.items():  # as transformers' SentencePieceExtractor: every split of a piece
            if len(piece) > 256:  # no merge builds a piece this long (bounds the work a hostile vocabulary costs)
                continue
            local = [(piece[:j], piece[j:]) for j in range(1, len(piece))
                     if piece[:j] in normal and piece[j:] in normal]
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
            merges += [(score, -len(merges) - k, m) for k, m in enumerate(local)]
        merges.sort(key=lambda x: (x[0], x[1]), reverse=True)
        prefix = f.get("tokenizer.ggml.add_space_prefix", bool, True)
        unk_text = tokens[unk] if unk is not None and 0 <= unk < n else None
        tj = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": ([{"type": "Prepend", "prepend": "\u2581"}] if prefix
                                                               else []) + [
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])},
            "model": {"type": "BPE", "dropout": None, "unk_token": unk_text, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": [list(m) for _, _, m in merges]},
        }
    elif model == "gpt2":
        raw = f.get("tokenizer.ggml.merges", "strs") or []
        merges = []
        for j, m in enumerate(raw):
            parts = m.split(" ")
            if len(parts) != 2:
                raise GGUFError(f"{f.path}: tokenizer.ggml.merges[{j}]={m!r} is not two tokens")
            merges.append(parts)
        pre = f.get("tokenizer.ggml.pre", str, "default")  # absent: llama.cpp warns and uses "default"
        regex = _PRE.get(pre)
        if regex is None:
            at = f.meta_at.get("tokenizer.ggml.pre", 0)
            warnings.warn(f"{f.path}: tokenizer.ggml.pre={pre!r} (metadata at offset {at:#x}) is not known here: "
                          "pre-tokenising with llama.cpp's 'default' regexes, so token ids may differ from the "
                          "model's own; give its tokenizer.json with --tokenizer for exact ids", stacklevel=3)
            regex = "default"
        tj = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                *[{"type": "Split", "pattern": {"Regex": rx}, "behavior": "Isolated", "invert": False}
                  for rx in _REGEX[regex]],
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": regex == "llama3", "vocab": vocab, "merges": merges},
        }
    else:
        raise UnsupportedModelError(f"{f.path}: tokenizer.ggml.model={model!r} is not converted (llama, gpt2); "
                                    "give a tokenizer.json with --tokenizer")
    chat = None
    if template:
        chat = {"template": template, "bos_token": tokens[bos] if bos is not None else None,
                "eos_token": tokens[eos_ids[0]] if eos_ids else None}
    return json.dumps(tj, ensure_ascii=False), chat, eos_ids


# --- the front door -----------------------------------------------------------------------------------
def is_gguf(path) -> bool:
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def from_gguf(path, name: str | None = None, max_seq_len: int | None = None) -> Graph:
    """A GGUF file -> verified Graph whose weights are read lazily from the mapped file."""
    f = GGUFFile(path)
    arch = f.get("general.architecture", str, required=True)
    if arch in _REFUSED:
        raise UnsupportedModelError(f"{f.path}: architecture {arch!r}: {_REFUSED[arch]}")
    if arch not in ARCHS:
        raise UnsupportedModelError(f"{f.path}: architecture {arch!r} is not supported by the GGUF importer "
                                    f"(supported: {', '.join(ARCHS)})")
    name = name or f.get("general.name", str) or Path(f.path).stem
    config, extra = _config(f, arch, name, max_seq_len)
    plan = _plan(f, config, arch, extra)
    _check_types(f, plan)
    tok, chat, eos = tokenizer_from_gguf(f)
    specials = special_tokens_from_gguf(f, f.get("tokenizer.ggml.model", str), len(f.meta.get(
        "tokenizer.ggml.tokens") or ())) if tok is not None else None
    g = build_graph(config, None, name=config.name)
    g.weights = LazyWeights(plan)
    g.meta.tokenizer, g.meta.chat_template, g.meta.eos_token_ids = tok, chat, eos
    g.meta.special_tokens = specials
    g.meta.source_dtypes, g.meta.source_notes = source_types(f, plan)
    g.meta.source = f"gguf:{arch}"
    return verify(g)
