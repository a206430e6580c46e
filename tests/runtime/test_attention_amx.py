"""kv='bf16' attention on the AMX tile unit (codegen/attention.py:attention with bf16_unit 'amx',
Target.bf16_unit).

Host-independent: which unit a target picks (CFLOW_FEATURES can take the tile unit or AVX512_BF16 away), which
geometries the tile path takes (attention.amx_fits, attention.core_unit, the same unit in the tuning key), that
the emitted core holds TDPBF16PS exactly then, and that NaN in the cache past the position and in the scratch
changes nothing (on whatever unit the host has). On a host with AMX-BF16 (and Linux's permission for the tile
state) the compiled model itself: close to the VDPBF16PS core and to the interpreter's kv='bf16' twin (the same
exact products and f32 sums, taken in the tile unit's order), bit-identical across prompt blocks, thread counts
and decode, at positions either side of its 16-position K blocks and 32-position V chunks, with a sliding window,
soft-capped scores and biases."""

import numpy as np
import pytest
from llvmlite import ir

import cflow
from cflow.codegen import attention as A
from cflow.codegen.target import host_target
from cflow.compiler import compile_file
from cflow.ir import Attention, Interpreter, build_graph
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.runtime.session import Session
from tests._shared import SMALL_TILE

AMX = host_target().bf16_unit == "amx"
needs_amx = pytest.mark.skipif(not AMX, reason="this host has no AMX-BF16 tile unit (or Linux refused its state)")


def _model(tmp_path, name, **kw):
    c = ModelConfig(name=name, vocab_size=96, n_layers=2, ffn_dim=96, max_seq_len=96, **kw)
    rng = np.random.default_rng(len(name))
    w = {n: ((1 + 0.1 * rng.standard_normal(s)) if len(s) == 1 else
             rng.standard_normal(s) * (1.0 if n == "tok_embeddings" else s[-1] ** -0.5)).astype(np.float32)
         for n, s in weight_shapes(c).items()}
    p = tmp_path / f"{name}.vflow"
    compile_file(build_graph(c, w, name=name), p, "q8", SMALL_TILE)  # the attention core is the subject here
    return p


GEOMETRIES = {  # rep query heads per kv head x head_dim: 4 x 32, 2 x 64, 16 x 32 (every tile row), 1 x 64
    "gqa4_hd32": dict(d_model=128, n_heads=4, n_kv_heads=1),
    "gqa2_hd64": dict(d_model=128, n_heads=4, n_kv_heads=2, head_dim=64),
    "gqa16_hd32": dict(d_model=128, n_heads=16, n_kv_heads=1, head_dim=32),
    "mha_hd64_bias": dict(d_model=128, n_heads=2, n_kv_heads=2, attn_bias=True),
    "window_cap": dict(d_model=128, n_heads=4, n_kv_heads=2, sliding_window=19, attn_softcap=30.0),
}


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def model(request, tmp_path_factory):
    return _model(tmp_path_factory.mktemp("amx"), request.param, **GEOMETRIES[request.param])


def test_the_unit_follows_the_features(monkeypatch):
    t = host_target()
    assert t.bf16_unit in ("amx", "dpbf16", "")
    assert host_target(features="-amx-bf16").bf16_unit in ("dpbf16", "")
    assert host_target(features="-avx512bf16").bf16_unit == ""  # the tile path needs the vector unit's bf16 too
    assert host_target(cpu="x86-64").bf16_unit == ""
    if t.bf16_unit == "amx":
        monkeypatch.setenv("CFLOW_FEATURES", "-amx-tile")
        assert host_target().bf16_unit == "dpbf16"


@pytest.mark.parametrize("rep, hd, block, fits", [(8, 64, 16, True), (4, 32, 16, True), (16, 64, 16, True),
                                                  (17, 64, 16, False), (8, 128, 16, False), (8, 16, 16, False),
                                                  (8, 64, 8, False)])
def test_the_tile_path_takes_the_geometries_it_fits(rep, hd, block, fits):
    assert A.amx_fits(rep, hd, block) == fits
    n = Attention(name="attn.1", inputs=("x",), prefix="layers.1.attn", dim=rep * hd, n_heads=rep, n_kv_heads=1,
                  head_dim=hd, rope_theta=10000.0)
    m = ir.Module(name="t")
    A.attention(m, n, (0, rep * hd, rep * hd + hd), "avx512vnni", "bf16", 4 * block if block == 16 else 8, "amx")
    text = str(m)
    assert ("llvm.x86.tdpbf16ps" in text) == fits and ("llvm.x86.tilerelease" in text) == fits
    assert ("avx512bf16.dpbf16ps" in text) != fits  # otherwise VDPBF16PS


@needs_amx
def test_tile_core_equals_the_vector_core_and_the_twin(model, monkeypatch):
    ids = list(np.random.default_rng(5).integers(0, 96, 61))  # crosses 16- and 32-position chunks
    runs = {}
    for feats in ("", "-amx-bf16"):
        monkeypatch.setenv("CFLOW_FEATURES", feats)
        # decode-only programs: the core is one per-token function that a prompt block calls too
        # (codegen/attention.py); the next test compares the bodies
        with cflow.load(model, threads=2, kv="bf16", prefill_block=1) as m:
            s = m.session
            text = s.program.module if isinstance(s.program.module, str) else str(s.program.module)
            assert ("llvm.x86.tdpbf16ps" in text) == (feats == "")
            logits = [s.prefill(ids).copy()]
            for _ in range(6):
                logits.append(s.step(int(np.argmax(logits[-1]))).copy())
            runs[feats] = logits
            it = Interpreter(m.ir, act_quant="q8", kv="bf16")
    ref = [it.prefill(ids)[-1]]
    for g in runs[""][:-1]:
        ref.append(it.step(int(np.argmax(g))))
    scale = max(1.0, float(np.abs(ref[0]).max()))
    for a, b, r in zip(runs[""], runs["-amx-bf16"], ref):
        assert np.isfinite(a).all()
        # Mostly ~1e-7 of the scale apart (the order of f32 sums); up to ~0.7% where a softmax weight rounds to the
        # neighbouring bf16 and the int8 activations downstream carry that on, as far as either is from the twin.
        assert np.abs(a - b).max() <= 2e-2 * scale
        assert np.abs(a - r).max() <= 2e-2 * scale


@needs_amx
def test_tile_core_is_bit_identical_across_blocks_threads_and_decode(model):
    ids = list(np.random.default_rng(6).integers(0, 96, 47))
    want = None
    # blocks of 1 (the program the test above built), 16 (two full calls and a tail: the next test's program) and
    # the default (the whole prompt in one call); each block size is a program of its own to JIT
    for block, threads in ((1, 1), (16, 2), (64, 1)):
        with Session(str(model), threads=threads, prefill_block=block, kv="bf16") as s:
            got = [s.prefill(ids).copy()]
            for _ in range(4):
                got.append(s.step(int(np.argmax(got[-1]))).copy())
        if want is None:
            want = got
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (block, threads)


def test_nan_past_the_position_never_reaches_the_core(model):
    """On every host (the tile core on an AMX host, else VDPBF16PS or its emulation): NaN in the cache past the
    position and in the whole scratch (the scores, the tile core's weights past the scan) changes nothing."""
    ids = list(np.random.default_rng(7).integers(0, 96, 33))
    with Session(str(model), threads=2, prefill_block=16, kv="bf16") as s:  # the program of the test above
        want = [s.prefill(ids).copy()] + [s.step(3).copy() for _ in range(3)]
        s.kv.view(np.uint16)[:] = 0xFFFF  # NaN everywhere
        s.scratch.view(np.uint32)[:] = 0x7FC00000  # a quiet NaN in every float of the scratch
        s.reset()
        got = [s.prefill(ids).copy()] + [s.step(3).copy() for _ in range(3)]
    assert all(np.isfinite(g).all() and np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("max_seq, unit", [(64, "amx"), (4096, "amx"), (24, "dpbf16"), (8, "dpbf16")])
def test_the_core_and_its_tuning_key_agree_on_the_unit(max_seq, unit):
    """One rule (attention.core_unit) for the emitted core and the tuning key: a cache whose K blocks are not 16
    positions (max_seq not a multiple of 16) runs VDPBF16PS on an AMX host, and looks up that core's entry."""
    from types import SimpleNamespace

    from cflow.codegen import attn_tune

    amx_host = SimpleNamespace(bf16_unit="amx")
    assert A.core_unit("bf16", "amx", 8, 64, max_seq) == unit
    assert attn_tune.host_unit((32, 4, 64), "bf16", amx_host, max_seq) == unit
    assert attn_tune.host_unit((32, 4, 64), "f16", amx_host, max_seq) == ""
    assert attn_tune.attention_key(32, 4, 64, "bf16", unit).endswith(":amx") == (unit == "amx")
    assert A.core_unit("bf16", "dpbf16", 8, 64, max_seq) == "dpbf16" and A.core_unit("bf16", "", 8, 64, 64) == ""
    n = Attention(name="attn.1", inputs=("x",), prefix="layers.1.attn", dim=8 * 64, n_heads=8, n_kv_heads=1,
                  head_dim=64, rope_theta=10000.0)
    m = ir.Module(name="t")
    A.attention(m, n, (0, 512, 576), "avx512vnni", "bf16", max_seq, "amx")
    assert ("llvm.x86.tdpbf16ps" in str(m)) == (unit == "amx")


@needs_amx
def test_cflow_load_uses_the_tile_unit_through_the_public_api(model):
    with cflow.load(model, threads=1, kv="bf16") as m:
        text = m.session.program.module
        text = text if isinstance(text, str) else str(text)
        assert "llvm.x86.tdpbf16ps" in text
        assert np.isfinite(m.logits([1, 2, 3, 4, 5])).all()
