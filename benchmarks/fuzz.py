"""Hostile files at scale: a structure-aware fuzzer of the .vflow/.cflow reader, loader and CLI.

    python -m benchmarks.fuzz --cases 100000              # the long run (docs/reliability.md records the result)
    python -m benchmarks.fuzz --seconds 25 --quick        # the short budget tests/runtime/test_fuzz_harness.py runs
    python -m benchmarks.fuzz --replay 7:1234             # rebuild case 1234 of seed 7 and run it in this process

Cases are small real model files (tiny presets, the bundled model with its tokenizer) with one hostile edit each:
a header field (config fields one at a time with hostile values: wrong JSON kinds, zero, negative, huge, 2^63,
NaN/Infinity text; tile, quant, delays, eos ids, tokenizer, versions; any node of the packing and schedule
sections changed or deleted), a config edit with the header's packing and schedule re-derived so only the
tensor table and the size checks stand in the way, a structured lie in the preamble, tensor, expert or range
tables or the names pool (offsets past EOF, overlapping, unaligned, dims whose products overflow 64 bits,
counts inconsistent with the config), poisoned tensor data, every checksum recomputed so the semantic checks
are what is tested; plus byte flips, truncations and extensions (checksums left stale).

The same harness covers the other readers of untrusted files (--targets): GGUF (`cflowc model.gguf`: small
exported Llama files with every numeric header field — counts, string and array lengths, value types, dims,
tensor types, offsets — edited one at a time) and ONNX (`cflowc model.onnx`: initializer dims, types and
data, node op types, inputs and attributes, graph shapes and the opset edited in the protobuf). A case of
those targets must be refused with a CflowError, or compile to a .vflow that then passes everything above.

Each case runs in a worker subprocess (a crash shows as a signal; the worker is restarted) that runs
`cflow inspect` (exit 0 or 1: exit 2 is an internal error), `cflow.load`, greedy and sampled generation and
a checksum pass. Outcomes: rejected (a CflowError), loaded, bad-data (loaded, checksums fail), and the
failures: bug (any other exception, or exit 2), crash (a signal), hang (no answer within --timeout).
Exit status 1 if any failure; failing cases are kept as files with their descriptions (--keep).
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from contextlib import redirect_stderr, redirect_stdout

from benchmarks.common.process import child_env, module_command
from benchmarks.common.record import Run, add_json_argument
from cflow.runtime.format import spec as F

FAILURES = ("bug", "crash", "hang")

# --- the container, field by field --------------------------------------------------------------------------


class Container:
    """A file split into editable parts; tobytes() re-packs it with consistent lengths and fresh checksums."""

    def __init__(self, blob: bytes):
        self.pre = dict(zip(F.PREAMBLE_FIELDS, F.PREAMBLE.unpack_from(blob)))
        p = self.pre
        self.header_text = blob[F.PREAMBLE.size : F.PREAMBLE.size + p["header_len"]]
        self.data = bytearray(blob[p["data_offset"] : p["index_offset"]])
        idx, pos = blob[p["index_offset"] :], 0
        self.tables: dict[str, list[list[int]]] = {"tensors": [], "experts": [], "ranges": []}
        for key, st, n in (("tensors", F.TENSOR_ENTRY, p["n_tensors"]), ("experts", F.EXPERT_ENTRY, p["n_experts"]),
                           ("ranges", F.RANGE_ENTRY, p["n_ranges"])):
            for _ in range(n):
                self.tables[key].append(list(st.unpack_from(idx, pos)))
                pos += st.size
        self.names = bytearray(idx[pos:])
        self.overrides: dict[str, object] = {}  # preamble fields forced after the lengths are derived

    @property
    def header(self) -> dict:
        return json.loads(self.header_text)

    def set_header(self, h: dict) -> None:
        self.header_text = json.dumps(h, sort_keys=True, separators=(",", ":")).encode()

    def fix_tensor_crcs(self) -> None:
        for t in self.tables["tensors"]:
            off, nb = t[10], t[11]
            if off + nb <= len(self.data):
                t[15] = zlib.crc32(self.data[off : off + nb])
        by_off = {t[10]: t for t in self.tables["tensors"]}
        for r in self.tables["ranges"]:
            t = by_off.get(r[0])
            if t is not None and r[1] == t[11]:
                r[2] = t[15]

    def tobytes(self, fix_crcs: bool = True) -> bytes:
        index = b"".join([F.TENSOR_ENTRY.pack(*t) for t in self.tables["tensors"]]
                         + [F.EXPERT_ENTRY.pack(*e) for e in self.tables["experts"]]
                         + [F.RANGE_ENTRY.pack(*r) for r in self.tables["ranges"]] + [bytes(self.names)])
        p = dict(self.pre)
        p.update(header_len=len(self.header_text), data_offset=F.pad(F.PREAMBLE.size + len(self.header_text)),
                 data_len=len(self.data), n_tensors=len(self.tables["tensors"]), n_experts=len(self.tables["experts"]),
                 n_ranges=len(self.tables["ranges"]), names_len=len(self.names), index_len=len(index))
        p.update(index_offset=p["data_offset"] + p["data_len"])
        p.update(file_len=p["index_offset"] + len(index))
        if fix_crcs:
            p.update(header_crc=zlib.crc32(self.header_text), index_crc=zlib.crc32(index))
        data_offset = p["data_offset"]  # where the data really starts (an override only lies about it)
        p.update(self.overrides)
        pre = F.PREAMBLE.pack(*(p[f] for f in F.PREAMBLE_FIELDS))
        if fix_crcs and "preamble_crc" not in self.overrides:
            pre = pre[:-4] + zlib.crc32(pre[:-4]).to_bytes(4, "little")
        gap = bytes(data_offset - F.PREAMBLE.size - len(self.header_text))
        return pre + self.header_text + gap + bytes(self.data) + index


def _columns(s) -> list[str]:
    out = []
    for n, c in re.findall(r"(\d*)([a-zA-Z])", s.format.lstrip("<")):
        out += [c] if c == "s" else [c] * int(n or 1)
    return out


COLS = {"tensors": _columns(F.TENSOR_ENTRY), "experts": _columns(F.EXPERT_ENTRY), "ranges": _columns(F.RANGE_ENTRY)}
PRE_COLS = dict(zip(F.PREAMBLE_FIELDS, _columns(F.PREAMBLE)))
LIMITS = {"Q": (0, 2**64 - 1), "I": (0, 2**32 - 1), "i": (-(2**31), 2**31 - 1)}
EDGES = {
    "Q": [0, 1, 7, 4095, 4096, 4097, 2**31, 2**32, 2**32 + 4096, 2**48, 2**62, 2**63 - 4096, 2**63, 2**64 - 4096,
          2**64 - 1],
    "I": [0, 1, 2, 3, 4, 5, 8, 9, 16, 31, 32, 255, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1],
    "i": [-(2**31), -2, -1, 0, 1, 2, 3, 1000, 2**31 - 1],
}

# --- hostile JSON values ---------------------------------------------------------------------------------------
INTS = [0, 1, 2, 3, -1, -2, 7, 15, 16, 17, 31, 32, 33, 64, 100, 255, 256, 1000, 4095, 4096, 4097, 2**16, 2**20,
        2**24, 2**24 + 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64, 10**6, 10**30,
        -(2**31), -(2**63)]
FLOATS = [0.0, -0.0, -1.0, 5e-324, 1e-300, 1e-45, 0.5, 1.0, 1.5, 1e30, 1.7976931348623157e308, -1e308]
OTHERS = [None, True, False, "", "8", "abc", "\u0000", [], [1], [[1]], [None], {}, {"a": 1}, "NaN", "x" * 5000]
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "9" * 5000, "1e-999", "-0"]


def hostile(rng: random.Random, orig=None):
    """A value JSON can hold that a field of kind `orig` should not (or an edge it should handle)."""
    pick = rng.random()
    if isinstance(orig, (int, float)) and not isinstance(orig, bool) and pick < 0.3:
        o = orig
        return rng.choice([o + 1, o - 1, o * 2, o // 2 if isinstance(o, int) else o / 2, -o, o * 1000, float(o),
                           str(o), [o], o + 2**32, o * 2**40])
    if pick < 0.65:
        return rng.choice(INTS)
    if pick < 0.8:
        return rng.choice(FLOATS)
    return copy.deepcopy(rng.choice(OTHERS))


def _nodes(tree, path=()):
    """Every (path, value) of a JSON tree, depth first."""
    yield path, tree
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _nodes(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _nodes(v, path + (i,))


def _set(tree, path, value, delete=False):
    node = tree
    for k in path[:-1]:
        node = node[k]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value


# --- mutators: each edits a Container and returns a description -----------------------------------------------
class Mutators:
    def __init__(self, tokenizer_text: str | None):
        self.tokenizer_text = tokenizer_text

    def config_field(self, c: Container, rng: random.Random) -> str:
        h = c.header
        field = rng.choice(sorted(h["config"]) + ["<new>"])
        if field == "<new>":
            h["config"]["future_field"] = 1
            c.set_header(h)
            return "config.future_field added"
        v = hostile(rng, h["config"][field])
        h["config"][field] = v
        # n_layers with n_blocks dividing it (the deep-plan cases), n_experts with top_k
        if field == "n_layers" and isinstance(v, int) and not isinstance(v, bool) and v > 0 and rng.random() < 0.5:
            h["config"]["n_blocks"] = rng.choice([v, 1, 2, 4]) if v % 4 == 0 else v
            for f in ("dense_delay", "expert_delay"):
                h["config"][f] = min(h["config"][f], max(v - 1, 0))
            h["delays"] = [h["config"]["dense_delay"], h["config"]["expert_delay"]]
        c.set_header(h)
        return f"config.{field} = {_short(v)}"

    def header_field(self, c: Container, rng: random.Random) -> str:
        h = c.header
        special = {
            "tile": [[16, 32], [1024, 32], [512, 4096], [100, 7], [0, 0], [2**31, 2**31], [-16, 32], [16],
                     [16, 32, 1], "128x256", [16.0, 32], [True, 32], [2**64, 32]],
            "quant": ["q4", "q8", "f16", "f32", "q2", "", None, 4, ["q4"]],
            "eos_token_ids": [5, True, [[1]], "abc", [None], [-1], [2**40], [0] * 5000, list(range(300)), [1.0],
                              [True], [], [0, 0]],
            "tokenizer": ["", "not json", "{}", '{"model": {}}', 5, None, ["x"], "x" * 100000]
            + ([self.tokenizer_text] if self.tokenizer_text else []),
            "format": ["cflow", "gguf", "", None, 1],
            "delays": [[0, 0], [1, 2], [2, 1], [0], [0, 0, 0], [-1, 0], [2**40, 0], "1,2", None],
            "trained_delays": [[0, 0], [3, 3], [-1, 0], [99, 99], [], None, "x"],
            "routing": ["post", "pre", "mid", None, 1],
            "name": ["", "x" * 5000, None, 5, "../../etc/passwd", "\u0000"],
            "cflow_version": ["0.0.1", "99.0", "", 5, None],
            "plan_version": [0, 2, 999, -1, "1", None],
            "format_version": [0, 2, "1", None],
            "chat_template": [None, "x", 5, [], {}, {"template": 5}, {"template": "{{ messages[0].content }}"},
                              {"template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                               "bos_token": "<s>", "eos_token": 7},
                              {"template": "{{ ''.__class__.__mro__ }}"}, {"template": "{{ 9 ** 9 ** 9 }}"},
                              {"template": "{% for i in range(10**6) %}{% for j in range(10**6) %}{% endfor %}"
                                           "{% endfor %}"},
                              {"template": "{{ 'x' * 10**9 }}"}, {"template": "{% if %}"},
                              {"template": "{{ raise_exception('no') }}"}],
        }
        key = rng.choice(sorted(special) + ["<delete>", "<unknown>"])
        if key == "<delete>":
            k = rng.choice(sorted(h))
            del h[k]
            c.set_header(h)
            return f"header.{k} deleted"
        if key == "<unknown>":
            h["some_future_key"] = hostile(rng)
            c.set_header(h)
            return "header.some_future_key added"
        v = copy.deepcopy(rng.choice(special[key])) if rng.random() < 0.8 else hostile(rng, h.get(key))
        h[key] = v
        c.set_header(h)
        return f"header.{key} = {_short(v)}"

    def json_tree(self, c: Container, rng: random.Random) -> str:
        h = c.header
        section = rng.choice(["packing", "schedule", "schedule", "config", "weight_dtypes"])
        nodes = [p for p, _ in _nodes(h.get(section)) if p]
        if not nodes:
            return "noop"
        path = rng.choice(nodes)
        full = (section,) + path
        op = rng.random()
        if op < 0.2:
            _set(h, full, None, delete=True)
            desc = "deleted"
        elif op < 0.3 and isinstance(path[-1], int):
            parent = h
            for k in full[:-1]:
                parent = parent[k]
            parent.append(copy.deepcopy(parent[path[-1]]))
            desc = "duplicated"
        else:
            node = h
            for k in full:
                node = node[k]
            v = hostile(rng, node)
            _set(h, full, v)
            desc = f"= {_short(v)}"
        c.set_header(h)
        return f"{'.'.join(map(str, full))} {desc}"

    def raw_json(self, c: Container, rng: random.Random) -> str:
        text = c.header_text.decode()
        numbers = [m for m in re.finditer(r'(?<=[:\[,])-?\d+(\.\d+)?([eE][-+]?\d+)?(?=[,\]}])', text)]
        if not numbers:
            return "noop"
        m = rng.choice(numbers)
        new = rng.choice(RAW_NUMBERS)
        if rng.random() < 0.1:
            new = "[" * 2000 + "1" + "]" * 2000
        c.header_text = (text[: m.start()] + new + text[m.end() :]).encode()
        return f"header text {text[max(0, m.start() - 30) : m.start()]!r} number -> {new[:20]}"

    def consistent(self, c: Container, rng: random.Random) -> str:
        """Edit the config and re-derive the header's packing and schedule, so that only the tensor table,
        the size checks against the file and the memory check stand in the way."""
        from cflow.passes.pipeline import plan_from_header

        h = c.header
        cfg = h["config"]
        field = rng.choice(["n_layers", "n_experts", "d_model", "vocab_size", "max_seq_len", "ffn_dim", "expert_dim",
                            "max_seq_len", "n_heads", "top_k", "head_dim", "norm_eps", "rope_theta", "n_blocks"])
        o = cfg.get(field)
        if field == "max_seq_len":
            v = rng.choice([1, 2, 3, o + 1, o * 2, 2**20, 2**22, 2**24, 2**23 + 1])
        elif isinstance(o, float):
            v = rng.choice([o * 2, o / 2, 1e-30, 1e30, 1.0])
        elif isinstance(o, int) and not isinstance(o, bool):
            v = rng.choice([max(o - 1, 1), o + 1, o * 2, max(o // 2, 1), 1, o * 4])
        else:
            return "noop"
        cfg[field] = v
        if field == "n_layers":
            cfg["n_blocks"] = v if cfg.get("n_blocks") == o or v % cfg.get("n_blocks", 1) else cfg["n_blocks"]
        if field in ("d_model", "n_heads"):
            cfg["head_dim"] = max(2, (cfg["d_model"] // cfg["n_heads"]) // 2 * 2)
        try:
            plan = plan_from_header(h, "case")
        except Exception:  # noqa: BLE001 -- an invalid config: the file keeps the old plan (still a case)
            c.set_header(h)
            return f"consistent config.{field} = {v} (invalid, old plan kept)"
        h["packing"] = {n: t.to_json() for n, t in plan.tensors.items()}
        h["schedule"] = plan.schedule.to_json()
        h["delays"] = [cfg["dense_delay"], cfg["expert_delay"]]
        c.set_header(h)
        return f"consistent config.{field} = {v} (packing and schedule re-derived)"

    def table(self, c: Container, rng: random.Random) -> str:
        kind = rng.choice(["pre", "tensors", "tensors", "tensors", "experts", "ranges", "names", "shape"])
        if kind == "pre":
            field = rng.choice([f for f, code in PRE_COLS.items() if code != "s"] + ["reserved"])
            if field == "reserved":
                c.overrides[field] = bytes(27) + b"\x01"
            else:
                c.overrides[field] = _lie(rng, PRE_COLS[field], c.pre[field], len(c.data))
            return f"preamble {field} = {c.overrides[field]!r}"
        if kind in ("tensors", "experts", "ranges"):
            rows = c.tables[kind]
            if not rows:
                return "noop"
            i, j = rng.randrange(len(rows)), rng.randrange(len(COLS[kind]))
            rows[i][j] = _lie(rng, COLS[kind][j], rows[i][j], len(c.data))
            if kind == "tensors" and j in (10, 11) and rng.random() < 0.5:  # move data too: crcs stay right
                c.fix_tensor_crcs()
            return f"{kind}[{i}][{j}] = {rows[i][j]}"
        if kind == "names":
            for _ in range(rng.randint(1, 3)):
                c.names[rng.randrange(len(c.names))] = rng.choice([0, 0x2E, 0xFF, 0xC3, rng.randrange(256)])
            if rng.random() < 0.3:
                del c.names[rng.randrange(len(c.names)) :]
            return "names pool edited"
        t = rng.choice(c.tables["tensors"])  # a self-consistent lie: ndim, dims, tile, nbytes edited together
        t[3] = rng.randint(0, 5)
        for k in range(4, 8):
            t[k] = rng.choice([0, 1, 3, 64, 2**31 - 1, 2**31, 2**32 + 1, 2**63, 2**64 - 1])
        t[8], t[9] = rng.choice([(0, 0), (1, 1), (32, 64), (2**32 - 1, 1), (0, 7)])
        t[11] = rng.choice([t[11], 0, 4, 2**64 - 1, rng.randrange(2**64)])
        return f"tensor shape lie {t[3:12]}"

    def poison(self, c: Container, rng: random.Random) -> str:
        """Valid structure, hostile numbers: a tensor's bytes become NaN/Inf/max patterns (crcs recomputed)."""
        t = rng.choice(c.tables["tensors"])
        off, nb = t[10], t[11]
        byte = rng.choice([0xFF, 0x7F, 0x7C, 0x80, 0x00])
        if rng.random() < 0.3:
            c.data[off : off + nb] = bytes(rng.randrange(256) for _ in range(min(nb, 4096))) + bytes(
                [byte]) * max(0, nb - 4096)
        else:
            c.data[off : off + nb] = bytes([byte]) * nb
        c.fix_tensor_crcs()
        return f"tensor at data offset {off:#x} ({nb} B) filled with {byte:#04x}"

    def versions(self, c: Container, rng: random.Random) -> str:
        h = c.header
        h[rng.choice(["cflow_version", "plan_version", "format_version"])] = rng.choice(["0.0.1", 0, 2, "9.9"])
        if rng.random() < 0.7:  # and a plan this cflow would not derive
            sched = h.get("schedule") or {}
            if isinstance(sched, dict) and sched.get("stages"):
                sched["stages"] = sched["stages"][:-1]
        c.set_header(h)
        return f"version stamp {({k: h.get(k) for k in ('cflow_version', 'format_version', 'plan_version')})}"


def _lie(rng: random.Random, code: str, orig: int, size: int) -> int:
    lo, hi = LIMITS[code]
    pick = rng.random()
    if pick < 0.5:
        v = rng.choice(EDGES[code])
    elif pick < 0.8:
        v = rng.choice([orig + 1, orig - 1, orig + F.ALIGN, orig - F.ALIGN, orig * 2, orig // 2, size, size + 1])
    else:
        v = rng.randint(lo, hi)
    return min(max(v, lo), hi)


def _short(v) -> str:
    text = json.dumps(v) if not isinstance(v, bytes) else repr(v)
    return text if len(text) <= 50 else text[:47] + "..."


# --- GGUF: every numeric field of the header, found by walking it (not by the reader under test) -------------------
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}


def gguf_fields(blob: bytes) -> list[tuple[int, str, str]]:
    """(offset, struct code, what) of every number in a GGUF header: counts, lengths, types, values, dims,
    offsets. Stops quietly where the file stops making sense (a base file always parses)."""
    import struct

    out: list[tuple[int, str, str]] = []
    pos = 0

    def take(code: str, what: str):
        nonlocal pos
        v = struct.unpack_from("<" + code, blob, pos)[0]
        out.append((pos, code, what))
        pos += struct.calcsize(code)
        return v

    def string(what: str) -> None:
        nonlocal pos
        pos += take("Q", f"{what} length")

    def value(t: int, what: str, depth: int = 0) -> None:
        nonlocal pos
        if t in GGUF_SCALARS:
            take(GGUF_SCALARS[t], what)
        elif t == 8:
            string(what)
        elif t == 9 and depth == 0:
            et = take("I", f"{what} element type")
            n = take("Q", f"{what} length")
            for i in range(n):
                if et == 8 or i < 64:
                    value(et, f"{what}[{i}]", 1)
                else:  # long numeric arrays: step over the rest
                    pos += struct.calcsize(GGUF_SCALARS.get(et, "B")) * (n - i)
                    break
        else:
            raise ValueError(t)

    try:
        take("I", "magic")
        take("I", "version")
        n_t = take("Q", "tensor_count")
        n_kv = take("Q", "kv_count")
        for k in range(n_kv):
            start = pos
            string(f"key {k}")
            key = blob[start + 8 : pos].decode("utf-8", "replace")
            value(take("I", f"{key} type"), key)
        for k in range(n_t):
            string(f"tensor {k} name")
            nd = take("I", f"tensor {k} n_dims")
            for d in range(nd):
                take("Q", f"tensor {k} dim {d}")
            take("I", f"tensor {k} type")
            take("Q", f"tensor {k} offset")
    except (struct.error, ValueError):
        pass
    return out


def gguf_mutate(base: bytes, rng: random.Random, fields) -> tuple[bytes, str, str]:
    import struct

    blob = bytearray(base)
    off, code, what = rng.choice(fields)
    size = struct.calcsize(code)
    if code in "fd":
        v = rng.choice([float("nan"), float("inf"), -1.0, 0.0, 1e30, 5e-324])
    else:
        bits = 8 * size
        lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if code.islower() else (0, 2**bits - 1)
        orig = struct.unpack_from("<" + code, blob, off)[0]
        v = rng.choice([lo, hi, 0, 1, 2, 7, 13, 32, 255, orig + 1, orig - 1, orig * 2, orig // 2, 2**31, 2**32 + 1,
                        2**40, 2**62, rng.randint(lo, hi)])
        v = min(max(v, lo), hi)
    struct.pack_into("<" + code, blob, off, v)
    return bytes(blob), "field", f"{what} (at {off:#x}) = {v!r}"


def onnx_mutate(base: bytes, rng: random.Random) -> tuple[bytes, str, str]:
    import onnx

    m = onnx.ModelProto()
    m.ParseFromString(base)
    g = m.graph
    pick = rng.random()
    if pick < 0.35 and len(g.initializer):
        t = rng.choice(g.initializer)
        what = rng.choice(["dims", "dims", "type", "data", "name"])
        if what == "dims" and len(t.dims):
            i = rng.randrange(len(t.dims))
            t.dims[i] = rng.choice([0, -1, 1, t.dims[i] + 1, 2**31, 2**62, -(2**63)])
        elif what == "type":
            t.data_type = rng.choice([0, 2, 7, 9, 10, 11, 16, 999])
        elif what == "data":
            t.raw_data = t.raw_data[: rng.randrange(len(t.raw_data) + 1)] if rng.random() < 0.7 else t.raw_data * 2
        else:
            t.name = rng.choice(["", "x", g.initializer[0].name])
        desc = f"initializer {t.name!r} {what}"
    elif pick < 0.7 and len(g.node):
        n = rng.choice(g.node)
        what = rng.choice(["op", "input", "attr", "drop"])
        if what == "op":
            n.op_type = rng.choice(["MatMul", "Add", "Mul", "Gather", "Softmax", "Reshape", "Foo", ""])
        elif what == "input" and len(n.input):
            n.input[rng.randrange(len(n.input))] = rng.choice(["", "nope", g.node[0].output[0]])
        elif what == "attr" and len(n.attribute):
            a = rng.choice(n.attribute)
            if len(a.ints):
                a.ints[rng.randrange(len(a.ints))] = rng.choice([0, -1, 2**31, 2**62, -(2**63)])
            else:
                a.i = rng.choice([0, -1, 2**31, 2**62])
                a.f = rng.choice([float("nan"), float("inf"), -1.0, 0.0])
        else:
            g.node.remove(n)
        desc = f"node {n.name or n.op_type} {what}"
    elif pick < 0.85:
        vi = rng.choice(list(g.input) + list(g.output))
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            dims[rng.randrange(len(dims))].dim_value = rng.choice([0, 1, 2**31, 2**62])
        desc = f"graph value {vi.name!r} shape"
    else:
        m.opset_import[0].version = rng.choice([0, 1, 7, 99, 2**40])
        desc = f"opset {m.opset_import[0].version}"
    return m.SerializeToString(), "proto", desc


# Mutation kinds and their weights.
KINDS = {"config_field": 22, "header_field": 12, "json_tree": 16, "raw_json": 5, "consistent": 8, "table": 18,
         "poison": 4, "versions": 3, "flip": 6, "truncate": 4, "extend": 2}


def make_case(base: bytes, muts: Mutators, rng: random.Random, target: str = "vflow",
              fields=None) -> tuple[bytes, str, str]:
    """(file bytes, kind, description) of one case."""
    if target == "vflow":
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    else:
        kind = rng.choices(["structured", "flip", "truncate", "extend"], weights=[70, 15, 10, 5])[0]
        if kind == "structured":
            return gguf_mutate(base, rng, fields) if target == "gguf" else onnx_mutate(base, rng)
    if kind == "flip":
        blob = bytearray(base)
        where = []
        for _ in range(rng.choice([1, 1, 2, 4])):
            pos = rng.randrange(len(blob))
            blob[pos] ^= rng.randint(1, 255)
            where.append(pos)
        return bytes(blob), kind, f"bytes flipped at {where}"
    if kind == "truncate":
        n = rng.randrange(len(base))
        return base[:n], kind, f"truncated to {n} bytes"
    if kind == "extend":
        n = rng.choice([1, 7, 4096, 5000])
        return base + bytes(n), kind, f"{n} bytes appended"
    c = Container(base)
    desc = getattr(muts, kind)(c, rng)
    try:
        return c.tobytes(), kind, desc
    except Exception as e:  # noqa: BLE001 -- a harness bug, reported as such
        raise RuntimeError(f"harness could not pack case ({kind}: {desc}): {e}") from e


# --- the worker: runs one case at a time ------------------------------------------------------------------------
def exercise(path: str, threads: int) -> tuple[str, str]:
    """(outcome, detail) for one file: rejected | loaded | bad-data | bug. Crashes and hangs never return."""
    import cflow
    from cflow.cli import cflow_main
    from cflow.errors import CflowError, FormatError

    err = io.StringIO()
    with open(os.devnull, "w") as null, redirect_stdout(null), redirect_stderr(err):
        rc = cflow_main(["inspect", path])
    if rc not in (0, 1):
        return "bug", f"cflow inspect exited {rc}: {err.getvalue().strip().splitlines()[-1:]}"
    try:
        m = cflow.load(path, threads=threads)
    except CflowError as e:
        return "rejected", f"{type(e).__name__}: {str(e)[:300]}"
    with m:
        V = m.config.vocab_size
        try:
            m.generate([i % V for i in (1, 2, 3)], max_new_tokens=3)
            m.generate([i % V for i in (5, 1)], max_new_tokens=2, temperature=0.9, top_p=0.9, seed=1)
            if m.tokenizer is not None:
                m.generate("Once upon", max_new_tokens=2)
            if m.session.header.get("chat_template"):
                t = m.chat_template
                if t is not None:
                    t.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        except CflowError as e:
            return "rejected", f"at run: {type(e).__name__}: {str(e)[:300]}"
        try:
            m.session.reader.verify()
        except FormatError as e:
            return "bad-data", str(e)[:300]
    return "loaded", ""


def exercise_frontend(path: str, threads: int) -> tuple[str, str]:
    """A GGUF or ONNX case: read and compiled with a CflowError or nothing; a compiled file is then exercised."""
    from cflow.compiler import compile_file
    from cflow.errors import CflowError
    from cflow.frontend.load import load_graph

    out = path + ".vflow"
    try:
        g = load_graph(path)
        compile_file(g, out, "q4", tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    except CflowError as e:
        return "rejected", f"{type(e).__name__}: {str(e)[:300]}"
    try:
        return exercise(out, threads)
    finally:
        os.remove(out)


def worker_main(threads: int, mem_gb: float) -> None:
    import faulthandler
    import resource

    faulthandler.enable()  # a crash prints the native stack to the worker log
    if mem_gb > 0:
        lim = int(mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    import warnings

    warnings.simplefilter("ignore")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            run_case = exercise if req.get("target", "vflow") == "vflow" else exercise_frontend
            outcome, detail = run_case(req["path"], threads)
        except BaseException as e:  # noqa: BLE001 -- the point: anything but a CflowError is a bug (pyo3 panics too)
            if isinstance(e, KeyboardInterrupt):
                raise
            tb = traceback.extract_tb(e.__traceback__)
            where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in tb[-4:])
            outcome, detail = "bug", f"{type(e).__name__}: {str(e)[:300]} [{where}]"
        sys.stdout.write(json.dumps({"id": req["id"], "outcome": outcome, "detail": detail}) + "\n")
        sys.stdout.flush()


class Worker:
    def __init__(self, n: int, args, tmp: str, env: dict):
        self.n, self.args, self.tmp, self.env = n, args, tmp, env
        self.path = None
        self.log = open(os.path.join(tmp, f"worker{n}.log"), "a")  # noqa: SIM115 -- closed in stop()
        self.proc = None
        self.case = None
        self.t0 = 0.0
        self.start()

    def start(self) -> None:
        cmd = module_command("benchmarks.fuzz", "--worker", "--threads", self.args.threads, "--mem-gb",
                             self.args.mem_gb)
        nice = self.args.nice
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=self.env, bufsize=1, preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def submit(self, case: dict, blob: bytes) -> None:
        self.path = os.path.join(self.tmp, f"case{self.n}.{case['target']}")
        with open(self.path, "wb") as f:
            f.write(blob)
        self.case, self.t0 = case, time.monotonic()
        self.proc.stdin.write(json.dumps({"id": case["id"], "path": self.path, "target": case["target"]}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


# --- base files ---------------------------------------------------------------------------------------------------
BASES = {  # name -> (model, quant, tile, layout)
    "arch2_4_combined-tiny-q4": ("preset:arch2_4_combined@tiny", "q4", (32, 64), "vflow"),
    "bundled-q4": ("bundled", "q4", (128, 256), "vflow"),
    "arch5_shared-tiny-q8": ("preset:arch5_shared@tiny", "q8", (16, 32), "cflow"),
    "arch1-tiny-f16": ("preset:arch1@tiny", "f16", (128, 256), "vflow"),
}
QUICK_BASES = ("arch2_4_combined-tiny-q4",)
TARGETS = ("vflow", "gguf", "onnx")
TARGET_WEIGHTS = {"vflow": 70, "gguf": 15, "onnx": 15}


def build_bases(names, out: str, targets=("vflow",), onnx_base: str | None = None) -> dict[str, tuple[str, bytes]]:
    """name -> (target, file bytes) of every base file. onnx_base: an export of preset:arch2_4_combined@tiny made
    before (the same bytes: the export is deterministic), read instead of exporting again."""
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir

    blobs = {}
    if "vflow" in targets:
        for name in names:
            model, quant, tile, layout = BASES[name]
            g = load_graph(str(default_model_dir()) if model == "bundled" else model)
            path = os.path.join(out, f"{name}.{layout}")
            compile_file(g, path, quant, tile, None, layout, g.meta.tokenizer, g.meta.eos_token_ids)
            with open(path, "rb") as f:
                blobs[name] = ("vflow", f.read())
    if "gguf" in targets:  # a small Llama (GQA, untied head) with the bundled byte-level BPE tokenizer, f32 and q8
        import numpy as np

        from cflow.ir import build_graph
        from cflow.ir.build import weight_shapes
        from cflow.ir.config import ModelConfig
        from cflow.passes.manager import Pipeline
        from cflow.passes.quantize import quantize_weights
        from cflow.runtime.format.gguf import export_gguf

        c = ModelConfig(name="fuzz_llama", vocab_size=2048, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=96, max_seq_len=64)
        rng = np.random.default_rng(0)
        w = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in weight_shapes(c).items()}
        tok = os.path.join(default_model_dir(), "tokenizer.json")
        for quant in ("f32", "q8") if len(names) > 1 else ("q8",):
            g = build_graph(c, w, name=c.name)
            if quant != "f32":
                g = Pipeline([quantize_weights(quant)], name="q")(g)
            path = os.path.join(out, f"llama-{quant}.gguf")
            export_gguf(g, path, tokenizer_json=tok)
            with open(path, "rb") as f:
                blobs[f"llama-{quant}-gguf"] = ("gguf", f.read())
    if "onnx" in targets:
        from cflow.frontend.export import export_onnx, load_torch_model

        path = onnx_base or os.path.join(out, "arch2_4_combined-tiny.onnx")
        if not onnx_base:
            export_onnx(load_torch_model("preset:arch2_4_combined@tiny"), path)
        with open(path, "rb") as f:
            blobs["arch2_4_combined-tiny-onnx"] = ("onnx", f.read())
    return blobs


def _tokenizer_text() -> str | None:
    from cflow.models.bundled import default_model_dir

    p = os.path.join(default_model_dir(), "tokenizer.json")
    return open(p, encoding="utf-8").read() if os.path.exists(p) else None


_FIELDS: dict[str, list] = {}  # GGUF base name -> its header fields (walked once)


def case_for(seed: int, i: int, blobs: dict[str, tuple[str, bytes]], muts: Mutators) -> tuple[dict, bytes]:
    rng = random.Random(f"{seed}:{i}")
    targets = sorted({t for t, _ in blobs.values()})
    target = rng.choices(targets, weights=[TARGET_WEIGHTS[t] for t in targets])[0]
    base = rng.choice(sorted(n for n, (t, _) in blobs.items() if t == target))
    if target == "gguf" and base not in _FIELDS:
        _FIELDS[base] = gguf_fields(blobs[base][1])
    blob, kind, desc = make_case(blobs[base][1], muts, rng, target, _FIELDS.get(base))
    return {"id": i, "target": target, "base": base, "kind": kind if target == "vflow" else f"{target}:{kind}",
            "desc": desc}, blob


# --- the run ----------------------------------------------------------------------------------------------------
def run(args, bench: Run) -> dict:
    tmp = tempfile.mkdtemp(prefix="cflow-fuzz-")
    keep = args.keep or os.path.join(tmp, "failures")
    env = child_env()
    env.setdefault("CFLOW_CACHE_DIR", os.path.join(tmp, "cache"))
    os.environ["CFLOW_CACHE_DIR"] = env["CFLOW_CACHE_DIR"]
    t_start = time.monotonic()
    names = QUICK_BASES if args.quick else tuple(BASES)
    blobs = build_bases(names, tmp, args.targets, args.onnx_base)
    muts = Mutators(_tokenizer_text())
    if args.warm and "vflow" in args.targets:  # the bases' steps into the program cache: unchanged configs load fast
        import cflow

        for name in names:
            with cflow.load(os.path.join(tmp, f"{name}.{BASES[name][3]}"), threads=args.threads) as m:
                m.generate([1, 2], max_new_tokens=1)
    setup = time.monotonic() - t_start
    workers = [Worker(n, args, tmp, env) for n in range(args.workers)]
    counts: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    failures: list[dict] = []
    slowest = (0.0, None)
    next_case, done = args.start, 0
    t0 = time.monotonic()
    paused = 0.0  # seconds spent waiting while --pause-while's file exists (not part of the --seconds budget)
    stop = []

    def on_signal(signum, frame):  # finish the cases in flight, then report what ran
        stop.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def pausing() -> bool:
        return any(os.path.exists(f) for f in args.pause_while or ())

    def budget_left() -> bool:
        if stop or (args.cases is not None and next_case >= args.start + args.cases):
            return False
        return args.seconds is None or time.monotonic() - t0 - paused < args.seconds

    def summary() -> dict:
        import cflow

        elapsed = time.monotonic() - t0 - paused
        return {
            "command": bench.command, "cflow_version": cflow.__version__, "seed": args.seed,
            "targets": list(args.targets),
            "bases": sorted(blobs), "cases": done, "first_case": args.start, "interrupted": bool(stop),
            "seconds": round(elapsed, 1), "paused_seconds": round(paused, 1), "setup_seconds": round(setup, 1),
            "cases_per_second": round(done / elapsed, 2) if elapsed else 0.0,
            "outcomes": dict(sorted(counts.items())), "crashes": counts.get("crash", 0),
            "hangs": counts.get("hang", 0), "bugs": counts.get("bug", 0),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(by_kind.items())},
            "slowest_case": {"seconds": round(slowest[0], 1), "case": slowest[1]}, "failures": failures,
            "failures_dir": keep if failures else None,
        }

    def record(w: Worker, outcome: str, detail: str) -> None:
        nonlocal done, slowest
        case, dt = w.case, time.monotonic() - w.t0
        w.case = None
        done += 1
        counts[outcome] = counts.get(outcome, 0) + 1
        by_kind.setdefault(case["kind"], {}).setdefault(outcome, 0)
        by_kind[case["kind"]][outcome] += 1
        if dt > slowest[0]:
            slowest = (dt, f"case {case['id']} ({case['kind']}: {case['desc']}): {outcome}")
        if outcome in FAILURES:
            os.makedirs(keep, exist_ok=True)
            name = f"{outcome}-{args.seed}-{case['id']}"
            shutil.copy(w.path, os.path.join(keep, f"{name}.{case['target']}"))
            entry = {**case, "outcome": outcome, "detail": detail, "seconds": round(dt, 1),
                     "replay": f"python -m benchmarks.fuzz --seed {args.seed} --replay {case['id']}"
                               + (" --quick" if args.quick else "") + f" --targets {','.join(args.targets)}"}
            with open(os.path.join(keep, name + ".json"), "w") as f:
                json.dump(entry, f, indent=2)
            failures.append(entry)
            print(f"FAIL {outcome}: case {case['id']} ({case['kind']}: {case['desc']}): {detail}", file=sys.stderr)
        if args.progress and done % args.progress == 0:
            print(f"{done} cases, {time.monotonic() - t0 - paused:.0f} s: {counts}", file=sys.stderr, flush=True)
            if args.json is not None:  # a long run's partial result survives anything
                write(bench, args.json, summary())

    try:
        while True:
            if pausing() and not stop:
                if all(w.case is None for w in workers):
                    t_pause = time.monotonic()
                    while pausing() and not stop:
                        time.sleep(5)
                    paused += time.monotonic() - t_pause
                    continue
            for w in workers:
                if w.case is None and budget_left() and not pausing():
                    case, blob = case_for(args.seed, next_case, blobs, muts)
                    next_case += 1
                    w.submit(case, blob)
            busy = [w for w in workers if w.case is not None]
            if not busy:
                break
            wait = max(0.0, min(w.t0 + args.timeout for w in busy) - time.monotonic())
            ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], min(wait, 1.0))
            for w in busy:
                if w.proc.stdout in ready:
                    line = w.proc.stdout.readline()
                    if line:
                        r = json.loads(line)
                        record(w, r["outcome"], r["detail"])
                        continue
                    rc = w.proc.wait()
                    record(w, "crash", f"worker died with {'signal ' + str(-rc) if rc < 0 else 'exit ' + str(rc)}")
                    w.start()
                elif time.monotonic() - w.t0 > args.timeout:
                    w.kill()
                    record(w, "hang", f"no answer in {args.timeout} s")
                    w.start()
    finally:
        for w in workers:
            w.stop()
    result = summary()
    if not args.keep:
        keep_dir = os.path.join(tmp, "failures")
        for p in os.listdir(tmp):
            if os.path.join(tmp, p) != keep_dir:
                full = os.path.join(tmp, p)
                shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)
        if not failures:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def write(bench: Run, path: str | None, result: dict) -> None:
    """The result as one record (no timing: the speed fields are null; extra: the result without its command)."""
    extra = {k: v for k, v in result.items() if k != "command"}
    bench.write(path, [bench.record(engine="cflow", isa_path=None, **extra)])


def replay(args) -> int:
    tmp = tempfile.mkdtemp(prefix="cflow-fuzz-replay-")
    names = QUICK_BASES if args.quick else tuple(BASES)
    blobs = build_bases(names, tmp, args.targets, args.onnx_base)
    case, blob = case_for(args.seed, args.replay, blobs, Mutators(_tokenizer_text()))
    path = os.path.join(tmp, f"case.{case['target']}")
    with open(path, "wb") as f:
        f.write(blob)
    print(f"case {case['id']} on {case['base']} ({case['kind']}): {case['desc']}\nfile: {path}", file=sys.stderr)
    run_case = exercise if case["target"] == "vflow" else exercise_frontend
    print(run_case(path, args.threads))  # a bug raises here, with its traceback
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=None, help="number of cases (default: 1000 unless --seconds)")
    ap.add_argument("--seconds", type=float, default=None, help="stop issuing cases after this long (default: none)")
    ap.add_argument("--seed", type=int, default=0, help="case i is fully determined by (seed, i) (default 0)")
    ap.add_argument("--start", type=int, default=0, help="first case index (default 0)")
    ap.add_argument("--workers", type=int, default=2, help="worker subprocesses (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each loaded model (default 1)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds without an answer that make a case a hang (default 120: a JIT of a new config "
                    "takes ~10 s on a loaded 2-core machine)")
    ap.add_argument("--mem-gb", type=float, default=8.0,
                    help="address-space limit of each worker in GiB; 0 = none (default 8)")
    ap.add_argument("--targets", type=lambda t: tuple(t.split(",")), default=TARGETS,
                    help=f"readers to fuzz, comma-separated (default {','.join(TARGETS)})")
    ap.add_argument("--quick", action="store_true", help="one base file (the in-suite budget) (default: all bases)")
    ap.add_argument("--no-warm", dest="warm", action="store_false",
                    help="do not pre-load the bases into the program cache (default: pre-load)")
    ap.add_argument("--onnx-base", metavar="FILE",
                    help="the ONNX base: a `cflow export-onnx preset:arch2_4_combined@tiny` made before, read instead "
                    "of exporting it again (default: export it)")
    ap.add_argument("--keep", metavar="DIR", help="where failing cases are kept (default: a temp directory)")
    add_json_argument(ap, "also write the result as one record (default: stdout only)")
    ap.add_argument("--progress", type=int, default=0, metavar="N",
                    help="a progress line every N cases (default: none)")
    ap.add_argument("--pause-while", metavar="FILE", action="append",
                    help="issue no cases while FILE exists, e.g. /tmp/cflow-quiet during measurements; repeatable "
                    "(default: none)")
    ap.add_argument("--nice", type=int, default=0, help="niceness added to the workers (default 0)")
    ap.add_argument("--replay", type=int, metavar="CASE", help="run case CASE of --seed in this process and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = [t for t in args.targets if t not in TARGETS]
    if bad:
        ap.error(f"--targets: unknown target {bad[0]!r} (known: {', '.join(TARGETS)})")
    if args.worker:
        worker_main(args.threads, args.mem_gb)
        return 0
    if args.replay is not None:
        return replay(args)
    if args.cases is None and args.seconds is None:
        args.cases = 1000
    bench = Run("fuzz", argv)
    result = run(args, bench)
    print(json.dumps(result, indent=2))
    write(bench, args.json, result)
    return 1 if any(result[k] for k in ("crashes", "hangs", "bugs")) else 0


if __name__ == "__main__":
    sys.exit(main())
