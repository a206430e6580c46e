"""Fuzz the reader: byte flips, truncations and structured lies (edited fields with valid checksums).

Every case must load (then verify() may fail cleanly) or raise FormatError; anything else fails.
Seeded loops (reproducible: the failing case is named) plus one hypothesis test that shrinks.
"""

from __future__ import annotations

import copy
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cflow.errors import FormatError
from cflow.runtime.format import FileReader
from cflow.runtime.format import spec as F

from . import Container, write_sample


def _columns(s) -> list[str]:
    # Struct format -> one type code per raw column ("4Q" -> Q, Q, Q, Q; "28s" stays one column).
    out = []
    for n, c in re.findall(r"(\d*)([a-zA-Z])", s.format.lstrip("<")):
        out += [c] if c == "s" else [c] * int(n or 1)
    return out


COLS = {"tensors": _columns(F.TENSOR_ENTRY), "experts": _columns(F.EXPERT_ENTRY), "ranges": _columns(F.RANGE_ENTRY)}
PRE_COLS = dict(zip(F.PREAMBLE_FIELDS, _columns(F.PREAMBLE)))
EDGES = {
    "Q": [0, 1, 7, 4095, 4096, 4097, 2**31, 2**32, 2**32 + 4096, 2**48, 2**62, 2**63 - 4096, 2**63,
          2**64 - 4096, 2**64 - 1],
    "I": [0, 1, 2, 3, 4, 5, 8, 9, 31, 32, 255, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1],
    "i": [-(2**31), -2, -1, 0, 1, 2, 2**31 - 1],
}
LIMITS = {"Q": (0, 2**64 - 1), "I": (0, 2**32 - 1), "i": (-(2**31), 2**31 - 1)}
HEADERS = [b"", b"{}", b"[]", b"null", b"{", b"\xff\xfe", b"[" * 50000, b'{"a": ' + b"9" * 5000 + b"}",
           b'{"a": 1e999999}', b'{"a": NaN}', b'{"a": "\\ud800"}', b"{}" + b"\0" * 10, b" " * 9000]


def _lie(rng: random.Random, code: str, orig: int, size: int) -> int:
    lo, hi = LIMITS[code]
    pick = rng.random()
    if pick < 0.5:
        v = rng.choice(EDGES[code])
    elif pick < 0.8:  # near the truth: off by one, by a page, doubled, halved
        v = rng.choice([orig + 1, orig - 1, orig + F.ALIGN, orig - F.ALIGN, orig * 2, orig // 2, size, size + 1])
    else:
        v = rng.randint(lo, hi)
    return min(max(v, lo), hi)


def lie(c: Container, rng: random.Random, size: int) -> str:
    """Plant one structured lie in `c`; returns a description for failure messages."""
    kind = rng.choice(["pre", "tensors", "tensors", "tensors", "experts", "ranges", "names", "header", "shape"])
    if kind == "pre":
        field = rng.choice([f for f, code in PRE_COLS.items() if code != "s"] + ["reserved"])
        if field == "reserved":
            c.overrides[field] = bytes(27) + b"\x01"
        else:
            c.overrides[field] = _lie(rng, PRE_COLS[field], c.pre[field], size)
        return f"preamble {field}={c.overrides[field]!r}"
    if kind in ("tensors", "experts", "ranges"):
        rows = getattr(c, kind)
        if not rows:
            return "noop"
        i, j = rng.randrange(len(rows)), rng.randrange(len(COLS[kind]))
        rows[i][j] = _lie(rng, COLS[kind][j], rows[i][j], size)
        return f"{kind}[{i}][{j}]={rows[i][j]}"
    if kind == "names":
        for _ in range(rng.randint(1, 3)):
            c.names[rng.randrange(len(c.names))] = rng.choice([0, 0x2E, 0xFF, 0xC3, rng.randrange(256)])
        if rng.random() < 0.3:
            del c.names[rng.randrange(len(c.names)) :]
        return "names pool"
    if kind == "header":
        c.header = rng.choice(HEADERS)
        return f"header {c.header[:20]!r}"
    # "shape": a self-consistent lie (ndim, dims, tile, nbytes all edited together)
    t = rng.choice(c.tensors)
    t[3] = rng.randint(0, 5)
    for k in range(4, 8):
        t[k] = rng.choice([0, 1, 3, 64, 2**31 - 1, 2**31, 2**32 + 1, 2**63, 2**64 - 1])
    t[8], t[9] = rng.choice([(0, 0), (1, 1), (32, 64), (2**32 - 1, 1), (0, 7)])
    t[11] = rng.choice([t[11], 0, 4, 2**64 - 1, rng.randrange(2**64)])
    return f"shape lie {t[3:12]}"


def exercise(path) -> str:
    """Open and use everything; returns 'rejected', 'bad-data' or 'ok'. Other exceptions escape."""
    try:
        r = FileReader(path)
    except FormatError:
        return "rejected"
    with r:
        r.summary()
        try:
            for t in r.tensors:
                r.tensor(t.name)
            for layer, e in r.experts:
                r.read_expert(layer, e, verify=True)
            r.verify()
        except FormatError:
            return "bad-data"
    return "ok"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "base.vflow"
    write_sample(path)
    return path.read_bytes()


def run(tmp_path, blob: bytes, desc: str) -> str:
    path = tmp_path / "case.vflow"
    path.write_bytes(blob)
    try:
        return exercise(path)
    except Exception as e:  # noqa: BLE001 - the point: nothing but FormatError may escape
        pytest.fail(f"{desc}: {type(e).__name__}: {e}")


def test_byte_flips_always_detected(tmp_path, base):
    # Every byte is covered by a checksum or a zero-padding rule, so no flip may pass as "ok".
    rng = random.Random(1)
    for case in range(500):
        blob = bytearray(base)
        where = []
        for _ in range(rng.choice([1, 1, 2, 4])):
            pos = rng.randrange(len(blob))
            blob[pos] ^= rng.randint(1, 255)
            where.append(pos)
        assert run(tmp_path, bytes(blob), f"flip case {case} at {where}") != "ok", f"flip at {where} undetected"


def test_truncation_and_appending_rejected(tmp_path, base):
    rng = random.Random(2)
    for case in range(200):
        if case % 4 == 3:
            blob, desc = base + bytes(rng.randint(1, 5000)), "appended"
        else:
            n = rng.randrange(len(base))
            blob, desc = base[:n], f"truncated to {n}"
        assert run(tmp_path, blob, f"case {case}: {desc}") == "rejected", desc


def test_structured_lies(tmp_path, base):
    rng = random.Random(3)
    parsed = Container(base)
    outcomes = {"rejected": 0, "bad-data": 0, "ok": 0}
    for case in range(700):
        c = copy.deepcopy(parsed)
        desc = "; ".join(lie(c, rng, len(base)) for _ in range(rng.choice([1, 1, 1, 2, 3])))
        try:
            blob = c.tobytes()
        except Exception as e:  # noqa: BLE001 -- a lie the struct cannot even hold is not a test case
            pytest.fail(f"harness: {desc}: {e}")
        outcomes[run(tmp_path, blob, f"lie case {case}: {desc}")] += 1
    assert outcomes["rejected"] > 500, outcomes  # lies are mostly caught at open, before any data use


def test_truncated_with_consistent_preamble(tmp_path, base):
    # A truncation whose preamble was "fixed up" to the new length (and re-checksummed).
    rng = random.Random(4)
    for case in range(100):
        c = Container(base)
        cut = rng.randrange(F.PREAMBLE.size, len(base))
        c.overrides["file_len"] = cut
        blob = c.tobytes()[:cut]
        assert run(tmp_path, blob, f"case {case}: cut at {cut}") == "rejected"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=st.integers(0, 13), col=st.integers(0, 15), value=st.integers(0, 2**64 - 1))
def test_tensor_field_lies_hypothesis(tmp_path, base, entry, col, value):
    c = Container(base)
    lo, hi = LIMITS[COLS["tensors"][col]]
    c.tensors[entry][col] = lo + value % (hi - lo + 1)  # any value the field can hold
    run(tmp_path, c.tobytes(), f"tensors[{entry}][{col}] = {c.tensors[entry][col]}")
