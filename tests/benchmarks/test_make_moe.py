"""benchmarks/make_moe.py and cflow/models/synthetic.py: the issue-39 model written by streaming, checked on tiny
geometries: the streamed .vflow is compile_file's own output for the same weights, memory stays bounded, the same
seed gives the same bytes, the GGUF twin holds the same values (gguf's reader, cflow's GGUF importer, llama.cpp's
greedy tokens), and the files load and generate (experts in RAM and on disk, the pipeline-native variant too)."""

import hashlib
import json
import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest

import cflow
from benchmarks import make_moe
from cflow.compiler import compile_file, lower
from cflow.ir import build_graph
from cflow.ir.build import weight_shapes
from cflow.layout.quant import DType, QTensor, dequantize, to_gguf_bytes
from cflow.models import synthetic
from cflow.models.synthetic import SyntheticWeights
from cflow.runtime.format import FileReader

TINY = make_moe.geometry("tiny")
PIPE = make_moe.geometry("tiny", pipeline=True)
# Qwen3-MoE's structure with experts that dominate the file, small enough for tracemalloc: 57 MB at Q4
MID = TINY.evolve(name="qwen3_moe_mid_test", vocab_size=512, d_model=256, n_layers=4, n_blocks=4, n_heads=4,
                  n_kv_heads=2, head_dim=64, n_experts=64, top_k=4, expert_dim=512)
PROMPT = [1, 17, 42, 99, 7, 123, 5, 250]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("make_moe")
    out = make_moe.main(["--geometry", "tiny", "--out", str(d), "--gguf", "--no-dd"])
    return d / f"{TINY.name}.vflow", d / f"{TINY.name}.gguf", out


def test_geometries():
    q = make_moe.GEOMETRIES["qwen3-30b-a3b"]
    assert (q.n_layers, q.d_model, q.n_heads, q.n_kv_heads, q.head_dim) == (48, 2048, 32, 4, 128)
    assert (q.n_experts, q.expert_dim, q.top_k, q.vocab_size, q.ffn_dim, q.qk_norm) == (128, 768, 8, 151936, 0, "head")
    assert round(q.n_params() / 1e9, 1) == 30.5 and round(q.n_params(active=True) / 1e9, 2) == 3.35
    s = make_moe.GEOMETRIES["sibling-4g"]
    assert s.evolve(name=q.name, n_layers=48, n_blocks=48) == q  # only the layer count differs
    assert 4.0 * 2**30 <= make_moe.planned_bytes(s) <= 4.1 * 2**30
    assert PIPE.delays == (1, 2) and TINY.delays == (0, 0)


def test_synthetic_weights_scale_and_types():
    w = SyntheticWeights(MID)
    e = w["blocks.0.moe.experts.3.w_gate"]
    assert isinstance(e, QTensor) and e.dtype == DType.Q4 and e.shape == (512, 256)
    x = dequantize(synthetic.synthetic_q4(0, "x", 2048, 2048, 0.02))
    assert abs(float(x.std()) - 0.02) < 0.0005 and abs(float(x.mean())) < 0.0005
    for name, std in (("lm_head", 0.2), ("blocks.1.attn.wq", 0.02), ("blocks.0.moe.experts.3.w_up", 1 / 16),
                      ("blocks.0.moe.experts.3.w_down", (4 / 512) ** 0.5)):  # unit gain, down x sqrt(top_k)
        assert abs(float(dequantize(w[name]).std()) / std - 1) < 0.05, name
    emb, head = w["tok_embeddings"], dequantize(w["lm_head"])  # the embedding points at the next id's head row
    assert emb.dtype == np.float16
    assert np.array_equal(emb, (synthetic.CHAIN_GAIN * np.roll(head, -1, axis=0)).astype(np.float16))
    assert w["blocks.1.moe.router"].dtype == np.float32 and w["blocks.1.attn.q_norm"].shape == (64,)
    assert abs(float(w["norm"].mean()) - 1) < 0.01
    assert list(w) == list(weight_shapes(MID)) and "lm_head" in w and "nope" not in w
    tied = SyntheticWeights(MID.evolve(tie_embeddings=True))["tok_embeddings"]
    assert tied.dtype == np.float16 and abs(float(tied.astype(np.float32).std()) - 0.02) < 0.001


def test_chain_embedding_across_row_chunks(monkeypatch):
    """The embedding's rows are the head's next rows across the head's row chunks and at the wrap."""
    monkeypatch.setattr(synthetic, "ROW_CHUNK_WEIGHTS", 7 * 256)  # 7-row chunks of a 512 x 256 head
    w = SyntheticWeights(MID)
    emb, head = w["tok_embeddings"], dequantize(w["lm_head"])
    assert np.array_equal(emb, (synthetic.CHAIN_GAIN * np.roll(head, -1, axis=0)).astype(np.float16))


@pytest.mark.parametrize("chunk", [None, 7 * 256])
def test_native_steps_draw_numpys_values(monkeypatch, chunk):
    """Every tensor drawn with make_moe's native loops (codegen/pcg64.py, codegen/half.py) equals NumPy's, bit for
    bit (one row chunk per matrix, and 7-row chunks: the embedding's wrap and partial chunks)."""
    if chunk:
        monkeypatch.setattr(synthetic, "ROW_CHUNK_WEIGHTS", chunk)
    a, b = SyntheticWeights(MID), SyntheticWeights(MID, steps=make_moe.native_steps())
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, QTensor):
            assert np.array_equal(x.q, y.q) and np.array_equal(x.scales.view(np.uint16), y.scales.view(np.uint16))
        else:
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), name


def test_deterministic_and_independent_of_order():
    a, b = SyntheticWeights(MID), SyntheticWeights(MID)
    x = a["blocks.2.moe.experts.7.w_down"]
    a["lm_head"], a["tok_embeddings"]  # other lookups in between change nothing
    for y in (a["blocks.2.moe.experts.7.w_down"], b["blocks.2.moe.experts.7.w_down"]):
        assert np.array_equal(x.q, y.q) and np.array_equal(x.scales, y.scales)
    assert not np.array_equal(x.q, SyntheticWeights(MID, seed=1)["blocks.2.moe.experts.7.w_down"].q)
    assert not np.array_equal(x.q, a["blocks.2.moe.experts.6.w_down"].q)


def test_streamed_file_is_compile_file_of_the_materialised_weights(tmp_path):
    """The streamed file is byte for byte what compile_file writes from a dict of the same tensors, for the baseline
    and the pipeline-native variant; the same seed writes the same bytes again, another seed other bytes."""
    for cfg in (TINY, PIPE):
        streamed = tmp_path / f"{cfg.name}.vflow"
        make_moe.write_vflow(cfg, streamed)
        w = SyntheticWeights(cfg)
        eager = {n: w[n] for n in w}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compile_file(build_graph(cfg, eager, name=cfg.name), tmp_path / "eager.vflow", "q4")
        assert streamed.read_bytes() == (tmp_path / "eager.vflow").read_bytes()
        again = tmp_path / "again" / f"{cfg.name}.vflow"
        again.parent.mkdir(exist_ok=True)
        make_moe.write_vflow(cfg, again)
        assert again.read_bytes() == streamed.read_bytes()
    make_moe.write_vflow(TINY, tmp_path / "seed1.vflow", seed=1)
    assert (tmp_path / "seed1.vflow").read_bytes() != (tmp_path / f"{TINY.name}.vflow").read_bytes()


# sha256 (first 16 hex digits) of every tensor's (name, crc, size) in file order, and of the GGUF's tensor data:
# the bytes the writer wrote before it packed in parallel threads, pinned so a faster writer stays the same writer
PINNED = {"qwen3_moe_tiny": "f684bd3de43beeb8", "qwen3_moe_tiny_dd1de2": "c4981f582d2ccb5b",
          "gguf": "0abaf13eab16fc88", "chunked": "4f73f1723781ae77", "chunked_gguf": "d6ee10bfc7b24ed3"}


def _vflow_digest(path) -> str:
    with FileReader(path) as r:
        return hashlib.sha256("".join(f"{t.name}:{t.crc:08x}:{t.nbytes};" for t in r.tensors).encode()).hexdigest()[:16]


def _gguf_digest(path) -> str:
    gguf = pytest.importorskip("gguf")
    h = hashlib.sha256()
    for t in gguf.GGUFReader(path).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()[:16]


def test_bytes_are_pinned(tiny_files, tmp_path, monkeypatch):
    """The files' tensors are the pinned bytes: the baseline, the pipeline variant, the GGUF twin, and (row chunks
    of 7 rows, one tile-row per packing band: the embedding's chunks filled by parallel threads, every band
    boundary crossed) a chunked variant of the tiny model and its twin."""
    vpath, gpath, _ = tiny_files
    assert _vflow_digest(vpath) == PINNED[TINY.name]
    assert _gguf_digest(gpath) == PINNED["gguf"]
    make_moe.write_vflow(PIPE, tmp_path / "pipe.vflow")
    assert _vflow_digest(tmp_path / "pipe.vflow") == PINNED[PIPE.name]
    from cflow.layout import tile

    monkeypatch.setattr(synthetic, "ROW_CHUNK_WEIGHTS", 7 * TINY.d_model)
    monkeypatch.setattr(tile, "PACK_BAND_BYTES", 1)
    make_moe.write_vflow(TINY, tmp_path / "chunked.vflow")
    assert _vflow_digest(tmp_path / "chunked.vflow") == PINNED["chunked"]
    make_moe.write_gguf(TINY, tmp_path / "chunked.gguf")
    assert _gguf_digest(tmp_path / "chunked.gguf") == PINNED["chunked_gguf"]


def _write_peak(cfg, path) -> int:
    tracemalloc.start()
    try:
        make_moe.write_vflow(cfg, path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _bound(cfg) -> tuple[int, int]:
    """(the peak the writer may reach, the model's bytes): three tensors at a time (util.prefetch_map with
    emit.PACK_WORKERS = 2: two packed ahead, one being written) and what emit.PACK_AHEAD lets it queue beyond them
    (packed bytes, plus the last one's generated form), each its generated form plus its packed bytes, plus
    the plan's tables (the header JSON, the packing plan and schedule objects, the tensor table: ~2.5 KB per tensor
    measured, 4 KB allowed), 1 MiB of Python objects and the two staging buffers of the O_DIRECT writes (a fixed
    2 x direct.BUFFER_BYTES, whatever the model)."""
    from cflow.runtime.format import direct

    plan = lower(build_graph(cfg, None), "q4")

    def io_bytes(t):  # the generated inputs (Q4: 1 byte per code + fp16 scales; else the array) + the output
        inputs = 0
        for shape, dt in zip(t.part_shapes, (plan.graph.meta.weight_dtypes[p] for p in t.parts)):
            n = int(np.prod(shape))
            inputs += n + n // 16 if dt == DType.Q4 else n * (2 if dt == DType.F16 else 4)
        return inputs + t.nbytes

    from cflow.runtime import emit

    largest = sorted((io_bytes(t) for t in plan.tensors.values()), reverse=True)
    staging = 2 * (direct.BUFFER_BYTES + 4096)
    return (sum(largest[:4]) + emit.PACK_AHEAD + 4096 * len(plan.tensors) + (1 << 20) + staging,
            sum(t.nbytes for t in plan.tensors.values()))


def test_memory_is_bounded_by_a_few_tensors(tmp_path, monkeypatch):
    """The writer's peak (tracemalloc) stays under the bound of a few tensors, far below the model; experts twice
    as wide (a file twice as large, as many tensors) raise it by no more than their larger tensors. (Staging
    buffers of 256 KiB, not 8 MiB: a fixed cost, which on this 57 MB model would hide the tensors' share.)"""
    from cflow.runtime import emit
    from cflow.runtime.format import direct

    monkeypatch.setattr(direct, "BUFFER_BYTES", 256 << 10)
    monkeypatch.setattr(emit, "PACK_AHEAD", 1 << 20)  # (64 MiB would queue this whole model)
    bound, model = _bound(MID)
    peak = _write_peak(MID, tmp_path / "mid.vflow")
    assert (tmp_path / "mid.vflow").stat().st_size > model
    assert peak < bound < model / 8, (peak, bound, model)
    wide = MID.evolve(name="qwen3_moe_mid_test_wide", expert_dim=1024)
    wide_bound, wide_model = _bound(wide)
    wide_peak = _write_peak(wide, tmp_path / "wide.vflow")
    assert wide_model > 1.8 * model and wide_peak < wide_bound
    assert wide_peak - peak < wide_bound - bound + (256 << 10) + emit.PACK_AHEAD, (peak, wide_peak, bound, wide_bound)


def test_gguf_twin_holds_the_same_values(tiny_files):
    """Read back with the gguf package: every Q4_0 tensor is the same blocks as the QTensor cflow packed (an expert
    stack expert by expert), dequantised equal; the f16 embedding and f32 norms, q/k norms and routers equal."""
    gguf = pytest.importorskip("gguf")
    _, gpath, _ = tiny_files
    r = gguf.GGUFReader(gpath)
    meta = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("tokenizer.ggml.")}
    assert meta["general.architecture"] == "qwen3moe" and meta["qwen3moe.expert_feed_forward_length"] == 64
    assert meta["qwen3moe.expert_count"] == 8 and meta["qwen3moe.expert_used_count"] == 2
    w, names = SyntheticWeights(TINY), {t.name: t for t in r.tensors}
    Q = gguf.GGMLQuantizationType
    checked = 0
    for i in range(TINY.n_layers):
        for m, g in (("w_gate", "ffn_gate_exps"), ("w_up", "ffn_up_exps"), ("w_down", "ffn_down_exps")):
            t = names[f"blk.{i}.{g}.weight"]
            assert t.tensor_type == Q.Q4_0
            shape = w[f"blocks.{i}.moe.experts.0.{m}"].shape
            vals = gguf.quants.dequantize(t.data, t.tensor_type).reshape(TINY.n_experts, *shape)
            for e in range(TINY.n_experts):
                ours = w[f"blocks.{i}.moe.experts.{e}.{m}"]
                assert np.array_equal(np.asarray(t.data[e]).reshape(-1), to_gguf_bytes(ours).reshape(-1))
                assert np.array_equal(vals[e], dequantize(ours))
                checked += 1
        for ir, g in (("attn.wq", "attn_q"), ("attn.wk", "attn_k"), ("attn.wv", "attn_v"), ("attn.wo", "attn_output")):
            t = names[f"blk.{i}.{g}.weight"]
            assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type), dequantize(w[f"blocks.{i}.{ir}"]))
        for ir, g in (("attn.q_norm", "attn_q_norm"), ("attn.k_norm", "attn_k_norm"), ("attn_norm", "attn_norm"),
                      ("moe_norm", "ffn_norm"), ("moe.router", "ffn_gate_inp")):
            assert np.array_equal(np.asarray(names[f"blk.{i}.{g}.weight"].data), w[f"blocks.{i}.{ir}"])
    assert checked == 3 * TINY.n_layers * TINY.n_experts
    assert np.array_equal(np.asarray(names["token_embd.weight"].data), w["tok_embeddings"])
    head = names["output.weight"]
    assert np.array_equal(gguf.quants.dequantize(head.data, head.tensor_type), dequantize(w["lm_head"]))


def test_cflow_reads_the_twin_back_to_the_same_tensors(tiny_files, tmp_path):
    """cflow's own GGUF importer (qwen3moe) compiles the twin, kept as stored, to the very tensors of the .vflow."""
    pytest.importorskip("gguf")
    from cflow.frontend.gguf import from_gguf

    vpath, gpath, _ = tiny_files
    g = from_gguf(gpath)
    assert g.config.evolve(name=TINY.name) == TINY
    compile_file(g, tmp_path / "back.vflow", "stored", tile=(128, 256))
    with FileReader(tmp_path / "back.vflow") as a, FileReader(vpath) as b:
        assert sorted(e.name for e in a.tensors) == sorted(e.name for e in b.tensors)
        for e in b.tensors:
            assert np.array_equal(a.tensor(e.name), b.tensor(e.name)), e.name


def test_loads_and_generates(tiny_files, tmp_path):
    vpath, _, _ = tiny_files
    with cflow.load(vpath, threads=1) as m:
        ram = m.generate(PROMPT, max_new_tokens=6, stop=False)
    with cflow.load(vpath, threads=1, experts="disk", expert_cache_mb=0.25) as m:  # 5 of 24 experts
        assert m.generate(PROMPT, max_new_tokens=6, stop=False) == ram
        assert m.expert_stats.misses > 0
    pipe = tmp_path / "pipe.vflow"
    make_moe.write_vflow(PIPE, pipe)
    with cflow.load(pipe, threads=1) as m:
        assert m.config.delays == (1, 2)
        pipe_ram = m.generate(PROMPT, max_new_tokens=6, stop=False)
    with cflow.load(pipe, threads=1, experts="disk", expert_cache_mb=0.5) as m:  # a window of 2 layers
        assert m.generate(PROMPT, max_new_tokens=6, stop=False) == pipe_ram


LLAMA = """
import json, sys
from benchmarks.common.peers import llama_open, llama_greedy
llm = llama_open(sys.argv[1], 1, n_ctx=64, extra_bufts=False)
print(json.dumps(llama_greedy(llm, json.loads(sys.argv[2]), int(sys.argv[3]))))
"""


def test_llama_cpp_greedy_tokens_equal_cflow(tiny_files):
    """llama.cpp (its own process: its AMX buffer type dies with SIGILL on some VMs, so extra buffer types are off)
    reads the twin as qwen3moe and decodes the same greedy tokens as cflow does from the .vflow in RAM: the synthetic
    model counts (each token's embedding points at the next id's head row), with a margin no rounding can flip."""
    pytest.importorskip("llama_cpp")
    vpath, gpath, _ = tiny_files
    with cflow.load(vpath, threads=1) as m:
        ours = m.generate(PROMPT, max_new_tokens=12, stop=False)
    p = subprocess.run([sys.executable, "-c", LLAMA, str(gpath), json.dumps(PROMPT), "12"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == list(ours) == list(range(251, 263))


def test_probe_measures_the_activation_scale():
    r = make_moe.main(["--geometry", "tiny", "--probe"])
    assert len(r["layers"]) == TINY.n_layers and r["argmax"] == PROMPT[-1] + 1 and r["top2_margin"] > 5
    assert 1.5 < r["embedding"] < 2.5 and all(0.2 < x["moe"] < 2 and x["residual"] < 5 for x in r["layers"])


def test_cli_refuses_a_gguf_of_the_pipeline_variant(tmp_path):
    with pytest.raises(SystemExit):
        make_moe.main(["--geometry", "tiny", "--out", str(tmp_path), "--gguf", "--pipeline"])


def test_plain_write_baselines(tmp_path):
    """The disk's write speed both ways (buffered, O_DIRECT in whole blocks), the scratch file removed."""
    for direct in (False, True):
        r = make_moe.dd_write(str(tmp_path), (3 << 20) + 5, direct)
        assert r["bytes"] == (3 << 20) + 5 and r["mb_s"] > 0 and r["direct"] is direct
    assert not list(tmp_path.iterdir())
