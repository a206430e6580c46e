"""The KV cache's element type (load(kv=...)): f16 halves the cache, equals the interpreter's kv='f16' twin, keeps
prefill, decode and thread counts bit-identical, and stays close to f32; long prompts cross many 16-lane
chunks of the vectorised attention core (codegen/attention.py:attention). The default, kv='auto', is f16 for Q4 / Q8
weights and f32 for f16 / f32 weights (runtime.session.resolve_kv), in the API, the CLI and the server alike."""

import numpy as np
import pytest

import cflow
from cflow.codegen.attention import kv_layout
from cflow.compiler import compile_file
from cflow.frontend.load import load_graph
from cflow.ir import Interpreter
from cflow.runtime.session import Session
from tests._shared import SMALL_TILE


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("kv") / "a.vflow"
    # 32-row tiles (tests/_shared.py): the cache is the subject; ~20 programs of this model, each in ~0.75x the time
    compile_file(load_graph("preset:arch2_4_combined@tiny"), p, "q4", SMALL_TILE)
    return p


def _greedy(s, ids, steps=6):
    logits = [s.prefill(ids).copy()]
    for _ in range(steps):
        logits.append(s.step(int(np.argmax(logits[-1]))).copy())
    return logits


def test_f16_cache_is_half_the_bytes_and_reported(path):
    with Session(str(path), threads=1, kv="f32") as a, Session(str(path), threads=1, kv="f16") as b:
        assert b.kv.nbytes * 2 == a.kv.nbytes
        big = [k for k in a.memory_parts() if k.startswith("the KV cache")][0]
        assert b.memory_parts()[big] * 2 == a.memory_parts()[big]


def test_f16_cache_equals_its_interpreter_twin(path):
    ids = list(np.random.default_rng(1).integers(0, 256, 120))  # 8 chunks of 16 scores
    with cflow.load(path, threads=2, kv="f16") as m:
        got = m.logits(ids)
        ref16 = Interpreter(m.ir, act_quant="q8", kv="f16").prefill(ids)[-1]
        ref32 = Interpreter(m.ir, act_quant="q8").prefill(ids)[-1]
    assert np.abs(got - ref16).max() < 2e-2  # int8 activations, as the f32 tests
    assert int(np.argmax(got)) == int(np.argmax(ref16))
    assert np.abs(ref16 - ref32).max() < 5e-2  # half-precision K/V moves the logits little


@pytest.mark.parametrize("kv", ["f16", "bf16"])
def test_half_cache_holds_its_twins_values_to_one_ulp(path, kv):
    """Why the runtime and its f16 twin can differ by ~1e-2 on a rare step while the f32 cache agrees to ~1e-5: a
    K/V value the runtime computes in another summation order than NumPy differs in its last f32 bits, and when it
    lies next to a half-precision rounding boundary the two round to neighbouring halves (one f16 ulp, 2^-11
    relative). Int8 activation rounding downstream can carry that on. So the invariant is on the cache itself:
    every element equal to the twin's or one ulp away, and only a few of them away. bf16 (2^-8 relative ulp), in
    its own pair layout (attention.kv_layout): the same for the first layer; later layers' K/V can move by a few ulps
    where an earlier layer's bf16 query or weights rounded the other way (so only the share away is bounded)."""
    from cflow.layout.quant import bf16_bits

    ids = list(np.random.default_rng(1).integers(0, 256, 120))
    with cflow.load(path, threads=1, kv=kv) as m:
        s = m.session
        s.prefill(ids)
        it = Interpreter(m.ir, act_quant="q8", kv=kv)
        it.prefill(ids)
        cfg = s.compiled.graph.config
        per = s.program.kv_floats_per_layer
        cache = s.kv.view(np.int16)[: 2 * cfg.n_layers * per].reshape(cfg.n_layers, 2, per)  # slot 0
        k_at, v_at = kv_layout(s.max_seq, cfg.n_kv_heads, cfg.head_dim, kv)  # the runtime's layout
        sg, gg, dg = np.meshgrid(np.arange(len(ids)), np.arange(cfg.n_kv_heads), np.arange(cfg.head_dim),
                                 indexing="ij")
        at = (k_at(sg, gg, dg), v_at(sg, gg, dg))  # [position, kv head, dim] -> offset
        layers = {n.name: n.layer for n in s.compiled.graph.nodes() if n.name in it.kv}
        assert len(layers) == cfg.n_layers
        away = total = 0
        for name, layer in layers.items():
            for which, ref in enumerate(it.kv[name]):
                bits = ref.astype(np.float16).view(np.int16) if kv == "f16" else bf16_bits(ref).view(np.int16)
                want = bits.reshape(len(ids), cfg.n_kv_heads, cfg.head_dim)
                got = cache[layer - 1, which][at[which]]
                ulps = np.abs(want.astype(np.int32) - got.astype(np.int32))
                if kv == "f16" or layer == 1:
                    assert ulps.max() <= 1, (name, "KV"[which], int(ulps.max()))
                away, total = away + int((ulps > 0).sum()), total + ulps.size
        # near a boundary: rare (0.1% in the llama family's case)
        assert away <= total // (200 if kv == "f16" else 100), (away, total)


def test_f16_cache_prefill_decode_and_threads_bit_identical(path):
    ids = list(np.random.default_rng(2).integers(0, 256, 77))
    with Session(str(path), threads=1, prefill_block=1, kv="f16") as s:
        want = _greedy(s, ids)
    for block, threads in ((16, 1), (64, 2)):  # two full blocks and a tail; a full one of 64 and a tail
        with Session(str(path), threads=threads, prefill_block=block, kv="f16") as s:
            got = _greedy(s, ids)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (block, threads)


def test_f32_attention_at_a_long_prompt_equals_the_interpreter(path):
    ids = list(np.random.default_rng(3).integers(0, 256, 117))
    with cflow.load(path, threads=1, kv="f32") as m:
        got = _greedy(m.session, ids, steps=3)
        it = Interpreter(m.ir, act_quant="q8")
        ref = [it.prefill(ids)[-1]]
        for _ in range(3):
            ref.append(it.step(int(np.argmax(ref[-1]))))
    for a, b in zip(got, ref):
        assert np.abs(a - b).max() < 2e-2


def test_bad_kv_type_is_one_clear_error(path):
    with pytest.raises(cflow.CflowError, match="KV cache type must be auto or one of f32, f16, bf16, not 'f8'"):
        cflow.load(path, kv="f8")


def test_bad_activations_are_one_clear_error(path):
    from cflow.cli import ACT_CHOICES
    from cflow.layout.quant import ACT_FORMATS

    assert ACT_CHOICES == ACT_FORMATS
    with pytest.raises(cflow.CflowError, match="activations must be one of q8, q8x2, not 'q4'"):
        cflow.load(path, activations="q4")


def test_cli_kv_choices_are_the_cache_types():
    from cflow.cli import KV_CHOICES
    from cflow.codegen.abi import KV_BYTES

    assert KV_CHOICES == ("auto", *KV_BYTES)


def test_bf16_dot_instruction_and_its_emulation_are_bit_identical(path, monkeypatch):
    """kv='bf16' with VDPBF16PS (hosts with AVX512_BF16) and with its FMA emulation (CFLOW_FEATURES=-avx512bf16,
    every other host) give the same logits bit for bit: the products are exact and both add them in the
    instruction's order (cgutils.bf16_dot); only subnormals would differ."""
    from cflow.codegen.target import host_target

    ids = list(np.random.default_rng(4).integers(0, 256, 70))
    runs = []
    for feats in ("-amx-bf16", "-amx-bf16,-avx512bf16"):  # (the tile unit's order differs: test_attention_amx)
        monkeypatch.setenv("CFLOW_FEATURES", feats)
        # decode-only programs: the dot products are the attention core's, one per-token function that a prompt
        # block calls too (codegen/attention.py); the multi-token body would double the JIT of each
        with Session(str(path), threads=2, prefill_block=1, kv="bf16") as s:
            text = s.program.module if isinstance(s.program.module, str) else str(s.program.module)
            assert ("avx512bf16.dpbf16ps" in text) == ("avx512bf16" not in feats and host_target().has_avx512_bf16)
            runs.append(_greedy(s, ids, steps=4))
    assert all(np.array_equal(a, b) for a, b in zip(*runs))


def test_cli_run_ctx_and_kv(path, capsys):
    from cflow.cli import cflow_main

    assert cflow_main(["run", str(path), "--prompt", "1 2 3", "-n", "4", "--threads", "1", "--kv", "f16",
                       "--ctx", "16"]) == 0
    assert capsys.readouterr().out.split()[:3] == ["1", "2", "3"]
    # more than the model holds: one line naming both numbers
    assert cflow_main(["run", str(path), "--prompt", "1 2 3", "--ctx", "1024"]) == 1
    err = capsys.readouterr().err
    assert "1024 exceeds the model's context of 128" in err and "Traceback" not in err
    assert cflow_main(["run", str(path), "--prompt", "1 2 3", "--ctx", "16", "-n", "20"]) == 1
    assert "-n 20" in capsys.readouterr().err


@pytest.mark.parametrize("quant, want", [("q4", "f16"), ("q8", "f16"), ("f16", "f32"), ("f32", "f32")])
def test_auto_is_f16_for_quantised_weights_f32_for_float_ones(tmp_path, quant, want):
    from cflow.runtime.session import resolve_kv

    assert resolve_kv("auto", quant) == want
    p = tmp_path / f"m_{quant}.vflow"
    compile_file(load_graph("preset:arch1@tiny"), p, quant)
    # decode-only programs (prefill_block=1): the cache type is resolved the same way, for half the code to JIT
    with cflow.load(p, threads=1, prefill_block=1) as m:
        assert m.kv == m.session.kv_dtype == m.session.program.kv == want and f"kv={want}" in repr(m)
    if quant in ("q4", "f32"):  # an explicit type wins (whatever the weights: one quantised and one float type)
        other = "f32" if want == "f16" else "f16"
        with cflow.load(p, threads=1, kv=other, prefill_block=1) as m:
            assert m.kv == m.session.program.kv == other


def test_the_program_cache_tells_the_kv_types_apart(path):
    from cflow.codegen import program_cache

    with Session(str(path), threads=1) as s:
        args = (s.header, s.run_state.schedule.to_json(), "x86", s.max_seq, False)
        assert program_cache.fingerprint(*args, kv="f16") != program_cache.fingerprint(*args, kv="f32")


def test_cli_shows_the_kv_type_in_use(path, capsys):
    from cflow.cli import cflow_main

    assert cflow_main(["run", str(path), "--prompt", "1 2 3", "-n", "2", "--threads", "1"]) == 0
    assert "f16 KV cache" in capsys.readouterr().err  # q4 weights: auto -> f16
    assert cflow_main(["run", str(path), "--prompt", "1 2 3", "-n", "2", "--threads", "1", "--kv", "f32"]) == 0
    assert "f32 KV cache" in capsys.readouterr().err
    assert cflow_main(["inspect", str(path), "--no-verify"]) == 0
    assert "q4, f16 KV cache by default" in capsys.readouterr().out


@pytest.mark.parametrize("max_seq", [7, 24, 30, 128])  # K blocks of 1, 8, 2 and 16 positions (attention.kv_block)
@pytest.mark.parametrize("kv", ["f32", "f16", "bf16"])  # bf16 at 7: V in pairs of positions, one left over
def test_every_k_block_width_equals_the_interpreter(path, max_seq, kv):
    from cflow.codegen.attention import kv_block

    ids = list(np.random.default_rng(max_seq).integers(0, 256, max_seq - 3))
    # decode-only programs: the K block width is the cache layout's and the attention core's, one per-token function
    # that a prompt block calls too (codegen/attention.py); the multi-token body would double the JIT of each of
    # the nine programs (each width and type is one)
    with cflow.load(path, threads=2, kv=kv, max_seq=max_seq, prefill_block=1) as m:
        assert m.session.max_seq == max_seq
        got = _greedy(m.session, ids, steps=3)
        it = Interpreter(m.ir, act_quant="q8", kv=kv)
        ref = [it.prefill(ids)[-1]]
        for _ in range(3):
            ref.append(it.step(int(np.argmax(ref[-1]))))
    assert kv_block(max_seq) == {7: 1, 24: 8, 30: 2, 128: 16}[max_seq]
    for a, b in zip(got, ref):
        assert np.abs(a - b).max() < 5e-2


@pytest.mark.parametrize("kv, features", [("bf16", ""), ("bf16", "-avx512f"), ("f16", ""), ("f32", "")])
def test_a_poisoned_slot_is_harmless_after_reset(path, kv, features, monkeypatch):
    """Session.reset does not clear the cache, so entries past the current position hold whatever an earlier
    sequence (or anything) left there. Those must never reach the output: bf16's pair scan reads the partner of an
    even position with weight 0, and 0 x NaN is NaN, so the cache write zeroes that partner first. Here the whole
    cache is NaN before the prompt; the logits equal a clean session's. '-avx512f': the AVX2 kernels."""
    monkeypatch.setenv("CFLOW_FEATURES", features)
    ids = list(np.random.default_rng(8).integers(0, 256, 21))
    with Session(str(path), threads=2, kv=kv) as s:  # the default block: the programs of the tests above
        want = _greedy(s, ids, steps=5)
        s.kv.view(np.uint16 if kv != "f32" else np.uint32)[:] = 0xFFFF if kv != "f32" else 0x7FC00000  # NaN
        s.reset()
        got = _greedy(s, ids, steps=5)
    assert all(np.isfinite(g).all() and np.array_equal(g, w) for g, w in zip(got, want))


def test_bf16_cache_with_a_sliding_window_equals_the_interpreter(tmp_path):
    """Gemma 2: a window of 8 on every other layer (odd window starts: the pair scan's lower neighbour has weight
    0), soft-capped scores, through both bodies (prompt blocks of 5) and decode."""
    from cflow.frontend import from_torch
    from tests.frontend._models import hf_model

    p = tmp_path / "g.vflow"
    c = compile_file(from_torch(hf_model("gemma2", final_logit_softcapping=100.0)), p, "f32")
    ids = list(np.random.default_rng(9).integers(0, c.graph.config.vocab_size, 13))
    with Session(str(p), threads=2, prefill_block=5, kv="bf16") as s:
        got = _greedy(s, ids, steps=12)
    it = Interpreter(c.graph, kv="bf16")
    ref = [it.prefill(ids)[-1]]
    for g in got[:-1]:
        ref.append(it.step(int(np.argmax(g))))
    scale = max(1.0, float(np.abs(ref[0]).max()))
    for a, b in zip(got, ref):
        assert np.abs(a - b).max() <= 2e-3 * scale
