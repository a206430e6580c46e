"""Fuzz the GGUF importer: structured lies (any integer field of the header set to an edge value), truncations,
byte flips. Every case must import (and then its weights must load and run) or raise one CflowError; anything
else (another exception, a hang, a huge allocation) fails. In-process: nothing here calls native code with a
length the file did not bound (numpy views of a validated mmap), so a case cannot crash the interpreter.
Seeded loops name the failing case; one hypothesis test shrinks."""

from __future__ import annotations

import random
import struct
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cflow.errors import CflowError
from cflow.frontend.gguf import _SCALARS, GGUFFile, from_gguf
from cflow.ir import Interpreter, build_graph
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.runtime.format.gguf import export_gguf

pytest.importorskip("gguf")

TINY = ModelConfig(name="fuzz", vocab_size=300, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                   max_seq_len=16, attn_bias=True)
WIDTH = {code: n for code, (_f, n) in _SCALARS.items()}
EDGES = [0, 1, 2, 3, 7, 8, 31, 32, 33, 255, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**62, 2**63,
         2**64 - 1]


class _Recorder(GGUFFile):
    """Parses a good file and remembers where every integer field sits (offset, byte width)."""

    def _scalar(self, code, what):
        if code in (2, 3, 4, 5, 10, 11):
            self.fields.append((self.pos, WIDTH[code], what))
        return super()._scalar(code, what)

    def __init__(self, path):
        self.fields = []
        super().__init__(path)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    rng = np.random.default_rng(0)
    w = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in weight_shapes(TINY).items()}
    p = tmp_path_factory.mktemp("fuzz") / "good.gguf"
    export_gguf(build_graph(TINY, w, name="fuzz"), p)
    fields = _Recorder(p).fields
    return p.read_bytes(), fields


def _check(blob: bytes, path) -> str:
    path.write_bytes(blob)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = from_gguf(path)
            for n in g.weights:  # every loader runs on what the header let through
                g.weights[n]
            with np.errstate(all="ignore"):
                Interpreter(g, max_seq_len=4).run([0, 1])
        return "ok"
    except CflowError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        return "refused"


def _mutate(rng: random.Random, blob: bytes, fields) -> tuple[bytes, str]:
    b = bytearray(blob)
    kind = rng.choice(["field", "field", "field", "truncate", "flip"])
    if kind == "field":
        at, n, what = rng.choice(fields)
        v = rng.choice(EDGES + [int.from_bytes(b[at : at + n], "little") + rng.choice([-1, 1, 32, -32])])
        v %= 1 << (8 * n)
        b[at : at + n] = v.to_bytes(n, "little")
        return bytes(b), f"{what} := {v}"
    if kind == "truncate":
        n = rng.randrange(len(b))
        return bytes(b[:n]), f"truncate to {n}"
    at = rng.randrange(min(len(b), fields[-1][0] + 64))  # the header region
    b[at] ^= 1 << rng.randrange(8)
    return bytes(b), f"flip a bit at {at:#x}"


def test_seeded_structured_lies(sample, tmp_path):
    blob, fields = sample
    assert _check(blob, tmp_path / "x.gguf") == "ok"
    seen = {"ok": 0, "refused": 0}
    for seed in range(250):
        rng = random.Random(seed)
        bad, what = _mutate(rng, blob, fields)
        try:
            seen[_check(bad, tmp_path / "x.gguf")] += 1
        except Exception as e:  # noqa: BLE001 -- the point: name the case that broke
            raise AssertionError(f"seed {seed} ({what}): {type(e).__name__}: {e}") from e
    assert seen["refused"] > 100


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hypothesis_field_lies(sample, tmp_path, data):
    blob, fields = sample
    i = data.draw(st.integers(0, len(fields) - 1))
    at, n, _what = fields[i]
    v = data.draw(st.integers(0, (1 << (8 * n)) - 1))
    b = bytearray(blob)
    b[at : at + n] = v.to_bytes(n, "little")
    _check(bytes(b), tmp_path / "h.gguf")


def test_every_field_at_every_edge(sample, tmp_path):
    """Each recorded integer field set to 0, 1 and the largest value of its width."""
    blob, fields = sample
    for at, n, what in fields[:: max(1, len(fields) // 120)]:
        for v in (0, 1, (1 << (8 * n)) - 1):
            b = bytearray(blob)
            b[at : at + n] = v.to_bytes(n, "little")
            try:
                _check(bytes(b), tmp_path / "e.gguf")
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{what} at {at:#x} := {v}: {type(e).__name__}: {e}") from e


def test_struct_formats_cover_every_scalar_type():
    for code, (fmt, n) in _SCALARS.items():
        assert struct.calcsize("<" + fmt) == n, code


# The architectures read with llama.cpp's per-family conventions: fused rows (phi3), factor tensors and partial
# rotary (phi3), window patterns and soft-caps (gemma2/3), folded scales (granite), stacked experts (olmoe).
FAMILY_FILES = {"phi3": ("phi3", {"original_max_position_embeddings": 32, "rope_parameters": {
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
    "long_factor": [2.0, 3.0, 4.0, 6.0], "original_max_position_embeddings": 32}}),
    "gemma2": ("gemma2", {}), "gemma3": ("gemma3", {}), "granite": ("granite", {}), "olmoe": ("olmoe", {})}


@pytest.fixture(scope="module")
def family_samples(tmp_path_factory):
    from ._gguf import write_hf_gguf
    from ._models import hf_model

    out = {}
    for arch, (family, over) in FAMILY_FILES.items():
        p = tmp_path_factory.mktemp("fuzz_fam") / f"{arch}.gguf"
        write_hf_gguf(hf_model(family, num_hidden_layers=1, **over), p, arch)
        out[arch] = (p.read_bytes(), _Recorder(p).fields)
    return out


@pytest.mark.parametrize("arch", list(FAMILY_FILES))
def test_family_files_under_structured_lies(family_samples, tmp_path, arch):
    blob, fields = family_samples[arch]
    assert _check(blob, tmp_path / "f.gguf") == "ok"
    for seed in range(60):
        rng = random.Random(seed)
        bad, what = _mutate(rng, blob, fields)
        try:
            _check(bad, tmp_path / "f.gguf")
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"{arch} seed {seed} ({what}): {type(e).__name__}: {e}") from e
    for at, n, what in fields:  # every integer field of the header at 0 and at its largest value
        for v in (0, (1 << (8 * n)) - 1):
            b = bytearray(blob)
            b[at : at + n] = v.to_bytes(n, "little")
            try:
                _check(bytes(b), tmp_path / "e.gguf")
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{arch}: {what} at {at:#x} := {v}: {type(e).__name__}: {e}") from e
