"""Text summary of an opened container, printed by `cflow inspect`.

Input: a validated FileReader. Output: a stable, diffable multi-line string (no addresses, no times).
"""

from __future__ import annotations

import json
from collections import defaultdict

from . import spec as F


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # unreachable


def _value(v, width: int = 96) -> str:
    # Long strings (the tokenizer) are summarised by length, the rest as compact JSON.
    if isinstance(v, str) and len(v) > width:
        return f"<string, {len(v)} chars>"
    text = json.dumps(v, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= width else text[: width - 3] + "..."


def _group(title: str, tensors, key) -> list[str]:
    count, size = defaultdict(int), defaultdict(int)
    for t in tensors:
        count[key(t)] += 1
        size[key(t)] += t.nbytes
    lines = [f"{title}:"]
    for k in sorted(count, key=lambda k: (isinstance(k, str), k)):
        lines.append(f"  {k!s:>10}  {count[k]:5d} tensors  {_size(size[k]):>10}")
    return lines


def summarize(r, table: bool = True) -> str:
    """See FileReader.summary()."""
    order = "stage-major" if r.layout == "vflow" else "layer-major"
    data = sum(t.nbytes for t in r.tensors)
    lines = [
        f"file: {r.path}",
        (f"format: cflow container v{r.version}, layout {r.layout} ({order}), {_size(r.file_size)} "
         f"({r.file_size} bytes)"),
        (f"sections: header {r.data_offset - F.PREAMBLE.size} B (padded), data {_size(r.data_len)} at "
         f"0x{r.data_offset:x} ({_size(data)} tensors + {_size(r.data_len - data)} padding), "
         f"index {r.index_len} B at 0x{r.index_offset:x}"),
        "header:",
    ]
    lines += [f"  {k}: {_value(v)}" for k, v in sorted(r.header.items())]
    lines.append(f"tensors: {len(r.tensors)}")
    lines += _group("by dtype", r.tensors, lambda t: t.dtype.label)
    lines += _group("by stage", r.tensors, lambda t: "-" if t.stage < 0 else t.stage)
    lines += _group("by layer", r.tensors, lambda t: "-" if t.layer < 0 else t.layer)
    experts = r.experts
    if experts:
        per_layer = defaultdict(list)
        for layer, e in experts:
            per_layer[layer].append(sum(x.nbytes for x in r.expert_ranges(layer, e)))
        lines.append(f"experts: {len(experts)} entries in {len(per_layer)} layers")
        for layer, sizes in sorted(per_layer.items()):
            lines.append(f"  layer {layer:3d}: {len(sizes)} experts, {_size(min(sizes))}..{_size(max(sizes))} each")
    else:
        lines.append("experts: none")
    status = {None: "not verified (run with verification to read every byte)", "ok": "ok"}
    lines.append(f"checksums: {status.get(r.verified, 'FAILED: ' + str(r.verified))}")
    if table:
        lines.append(f"{'#':>5}  {'name':<40} {'dtype':>5} {'shape':<18} {'tile':<10} "
                     f"{'offset':>12} {'nbytes':>12} {'stage':>5} {'layer':>5} {'expert':>6} crc32")
        for t in r.tensors:
            shape = "x".join(map(str, t.shape))
            tile = "-" if len(t.shape) == 1 else f"{t.tile[0]}x{t.tile[1]}"
            lines.append(f"{t.index:5d}  {t.name:<40} {t.dtype.label:>5} {shape:<18} {tile:<10} "
                         f"0x{t.offset:010x} {t.nbytes:12d} {t.stage:5d} {t.layer:5d} {t.expert:6d} "
                         f"{t.crc:08x}")
    return "\n".join(lines)
