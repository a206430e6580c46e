"""The header is untrusted input: every field type-checked and bounded, strict JSON, the plan's size bounded by
what the file holds before the IR is built, memory checked before the JIT, and files from another cflow told
to recompile. Each case here is one the loader once failed with a non-CflowError, a hang or a MemoryError."""

import json

import pytest

import cflow
from cflow.compiler import compile_file
from cflow.errors import CflowError, FormatError
from cflow.frontend.load import load_graph
from cflow.runtime.format import FileReader
from cflow.runtime.format.header import written_by
from cflow.runtime.native_step import NativeStep

from . import Container


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("hdr") / "base.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4", (32, 64), None, "vflow", None, [0])
    return path.read_bytes()


@pytest.fixture
def no_jit(monkeypatch):
    """A case refused before anything is compiled: building the step fails the test."""
    def fail(self, cache):
        raise AssertionError("reached the JIT")

    monkeypatch.setattr(NativeStep, "_build", fail)


def craft(base: bytes, tmp_path, edit=None, text=None):
    c = Container(base)
    h = json.loads(c.header)
    if edit:
        edit(h)
    c.header = json.dumps(h, sort_keys=True).encode() if text is None else text(json.dumps(h, sort_keys=True))
    path = tmp_path / "case.vflow"
    path.write_bytes(c.tobytes())
    return path


def refused(path, *needles):
    with pytest.raises(CflowError) as e:
        cflow.load(path, threads=1)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def field(section, key, value):
    def edit(h):
        (h[section] if section else h)[key] = value
    return edit


@pytest.mark.parametrize("value", [5, True, [[1]], "abc", [None], [-1], [10**9], [1.0], [True]])
def test_eos_token_ids_checked(base, tmp_path, no_jit, value):
    refused(craft(base, tmp_path, field(None, "eos_token_ids", value)), "eos_token_ids")


@pytest.mark.parametrize("key, value", [
    ("norm_eps", "1e-5"), ("norm_eps", [1e-5]), ("norm_topk", 1), ("norm_topk", "true"), ("attn_bias", "yes"),
    ("attn_bias", None), ("rope_theta", [10000]), ("rope_theta", {}), ("vocab_size", 256.0), ("d_model", True),
    ("dense_layers", [1.5]), ("dense_layers", ["1"]), ("dense_layers", 3), ("routing", ["post"]), ("name", 5),
])
def test_config_fields_of_the_wrong_kind(base, tmp_path, no_jit, key, value):
    refused(craft(base, tmp_path, field("config", key, value)), f"config field {key}")


@pytest.mark.parametrize("key, value", [
    ("max_seq_len", 2**24 + 1), ("max_seq_len", 2**31), ("max_seq_len", 2**62), ("max_seq_len", 2**64),
    ("n_layers", 2**31), ("n_experts", 2**20), ("vocab_size", 2**40), ("d_model", -3), ("head_dim", 0),
])
def test_config_fields_bounded(base, tmp_path, no_jit, key, value):
    refused(craft(base, tmp_path, field("config", key, value)), key)


@pytest.mark.parametrize("old, new", [("1e-05", "NaN"), ("10000.0", "Infinity"), ("1e-05", "1e999")])
def test_strict_json(base, tmp_path, no_jit, old, new):
    path = craft(base, tmp_path, text=lambda t: t.replace(old, new, 1).encode())
    refused(path, "header")
    with pytest.raises(FormatError, match="not valid UTF-8 JSON"):
        FileReader(path)


def test_infinity_in_lists(base, tmp_path, no_jit):
    refused(craft(base, tmp_path, field("config", "dense_layers", [1]),
                  text=lambda t: t.replace('"dense_layers": [1]', '"dense_layers": [Infinity]').encode()), "Infinity")
    refused(craft(base, tmp_path, text=lambda t: t.replace('"tile": [32, 64]', '"tile": [Infinity, 64]').encode()),
            "Infinity")


@pytest.mark.parametrize("tile", [[1024, 32], [100, 7], [16], [16.0, 32], "32x64", [2**64, 32]])
def test_tile_bounded(base, tmp_path, no_jit, tile):
    refused(craft(base, tmp_path, field(None, "tile", tile)), "tile")


def _deep(n_layers, n_blocks):
    def edit(h):
        h["config"].update(n_layers=n_layers, n_blocks=n_blocks)
    return edit


@pytest.mark.parametrize("n_layers, n_blocks, needle", [
    (10**6, 10**6, "n_layers"), (2**31, 4, "n_layers"), (4096, 4096, "weight blocks"), (4096, 4, "at most 1024"),
    (1025, 5, "at most 1024"), (400, 400, "weight blocks"), (400, 4, "does not match"),
])
def test_a_small_file_cannot_ask_for_a_deep_plan(base, tmp_path, no_jit, n_layers, n_blocks, needle):
    # These hung in ir/build.py (a loop per layer before any tensor is compared) or spent minutes in LLVM.
    # Sharing is no longer bounded (the step's LLVM work follows the stage kinds, not the depth): 400 layers
    # over the 4 stored blocks pass the size checks and are refused by the plan comparison, before any JIT.
    refused(craft(base, tmp_path, _deep(n_layers, n_blocks)), needle)


def test_a_stored_block_may_run_more_than_8_times(tmp_path):
    import numpy as np

    from cflow.ir import build_graph
    from cflow.ir.build import weight_shapes
    from cflow.models.presets import get_preset

    c = get_preset("arch5_shared", "tiny").evolve(n_layers=18, n_blocks=2)  # each block runs 9 times
    w = {n: np.full(s, 0.01, np.float32) for n, s in weight_shapes(c).items()}
    path = tmp_path / "shared.vflow"
    compile_file(build_graph(c, w), path, "q4")
    m = cflow.load(path, threads=1, prefill_block=1)
    try:
        assert len(m.generate([1, 2], max_new_tokens=2)) >= 2
    finally:
        m.close()


@pytest.mark.parametrize("key, value, needle", [
    ("n_experts", 4000, "n_experts"), ("n_experts", 2**14, "n_experts"), ("d_model", 40000, "bytes"),
    ("vocab_size", 2**22, "vocab_size"), ("expert_dim", 2**20, "expert_dim"),
])
def test_plan_bounded_by_the_file(base, tmp_path, no_jit, key, value, needle):
    refused(craft(base, tmp_path, field("config", key, value)), needle)


def test_memory_checked_before_the_jit(base, tmp_path, no_jit, monkeypatch):
    import cflow.util

    path = craft(base, tmp_path)  # a valid file
    monkeypatch.setattr(cflow.util, "available_memory", lambda: 1 << 20)
    refused(path, "loading needs", "of memory", "but 1.0 MiB is available")


def test_max_seq_in_the_millions_is_refused_by_memory(base, tmp_path, no_jit, monkeypatch):
    # 2^24 positions pass the field's bound; the KV cache (16 GiB here) must then fit in memory.
    import cflow.util

    monkeypatch.setattr(cflow.util, "available_memory", lambda: 8 << 30)
    refused(craft(base, tmp_path, field("config", "max_seq_len", 2**24)), "max_seq_len=16777216", "KV cache",
            "load with a smaller max_seq")


RLIMIT_CHILD = r"""
import resource, sys
from cflow.cli import cflow_main
from cflow.runtime import memory_estimate as me
from cflow.util import _read_kv

real = me.check_memory

def limited(path, parts, threads=0):
    # an address-space limit just above what the load's buffers add up to: the RoPE table was once computed
    # with temporaries 2.5 times its size, past such a limit, before any check could see it (a MemoryError)
    vm = _read_kv("/proc/self/status")["VmSize"] * 1024
    lim = vm + sum(parts.values()) + (64 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    return real(path, parts, threads)

me.check_memory = limited
sys.exit(cflow_main(["run", sys.argv[1], "--prompt", "1 2 3", "-n", "1", "--threads", "1"]))
"""


def test_max_seq_in_the_millions_under_an_address_space_limit(base, tmp_path):
    import subprocess
    import sys

    path = craft(base, tmp_path, field("config", "max_seq_len", 2**24))
    r = subprocess.run([sys.executable, "-c", RLIMIT_CHILD, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "MemoryError" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for needle in ("of address space", "config.max_seq_len=16777216", "KV cache", "RLIMIT_AS"):
        assert needle in r.stderr, r.stderr


def test_unknown_format_and_missing_config(base, tmp_path, no_jit):
    refused(craft(base, tmp_path, field(None, "format", "gguf")), "header field format")
    refused(craft(base, tmp_path, lambda h: h.pop("config")), "header field config")
    refused(craft(base, tmp_path, field(None, "config", [1, 2])), "header field config")


# --- files from another cflow -----------------------------------------------------------------------------
def _older_plan(stamp):
    def edit(h):
        for k in ("cflow_version", "format_version", "plan_version"):
            h.pop(k, None)
        h.update(stamp)
        h["schedule"]["stages"] = h["schedule"]["stages"][:-1]  # a plan this cflow would not derive
    return edit


def test_file_from_another_version_says_recompile(base, tmp_path, no_jit):
    msg = refused(craft(base, tmp_path, _older_plan({"cflow_version": "0.0.9", "format_version": 1,
                                                     "plan_version": 0})),
                  "compiled by cflow 0.0.9 (format 1, plan 0)", "recompile with cflowc")
    assert f"this is cflow {cflow.__version__}" in msg


def test_file_without_a_version_says_recompile(base, tmp_path, no_jit):
    refused(craft(base, tmp_path, _older_plan({})), "compiled by an earlier cflow", "recompile with cflowc")


def test_same_version_mismatch_is_a_plain_error(base, tmp_path, no_jit):
    msg = refused(craft(base, tmp_path, _older_plan(written_by())), "does not match")
    assert "recompile" not in msg


def test_files_carry_their_versions(base, tmp_path):
    path = craft(base, tmp_path)
    with FileReader(path) as r:
        assert {k: r.header[k] for k in written_by()} == written_by()


def test_load_arguments_checked(base, tmp_path, no_jit):
    path = craft(base, tmp_path)
    for kw, needle in ((dict(max_seq=1024), "exceeds the model's context of 128"), (dict(threads=0), "threads"),
                       (dict(max_seq=0), "max_seq"), (dict(threads=10**6), "threads"), (dict(max_seq=1.5), "max_seq")):
        with pytest.raises(CflowError, match=needle):
            cflow.load(path, **kw)
