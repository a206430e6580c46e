"""Shipped kernel choices per microarchitecture: what a load uses on a CPU whose own table has no record yet.

Stage: codegen (read by tune.choices and attn_tune.choices). A load never runs a search (`cflow tune FILE` does,
in a budget: tune.py); without a cached record for a kernel shape it takes the choice measured on a host of the
same microarchitecture family, from the tables the searches wrote there (the files named in `source`), and
without one the kernels' built-in defaults (tune.default_for, attention.KV_PREFETCH). The choices are schedule-only,
like every tuned knob: a wrong guess costs speed, never numbers.

A family is named by host_family(): LLVM's name for the host's microarchitecture (znver5, znver4, ...), or
"intel-amx" for an Intel core with the AMX tile unit (Sapphire Rapids and later). A family's choices may be
limited to the CPU names LLVM gave the hosts they were measured on (Family.cpus): two AMX Xeon VMs wanted
opposite loops. The one that reported a masked model (family 6 model 167, which LLVM names "rocketlake") ran the
group loop 1.18-1.27x faster than the built-in unit loop; one reporting its own model (207, "emeraldrapids")
decodes 1.19-1.27x faster with the built-in knobs than with those choices on its AVX-512 path, 1.00-1.15x on the
forced 256-bit paths, and its own search chose the unit loop for every shape
(docs/results/intel-amx/decode_shipped_vs_builtin_q4_emr.txt, _q8_emr.txt; docs/performance.md). So
"intel-amx" applies on the masked host only; another AMX core takes the built-ins until one is measured. A
choice's prefetch and loop knobs apply on every ISA path: they
are the memory system's, and `cflow tune` with the AVX2 and the AVX-VNNI paths forced on an AMX Xeon chose
the same loop and distances as its AVX-512 search (docs/journal/performance.md, "ISA paths"); the dot width and the Q4
unpack only on the path they were measured on (elsewhere the built-in ones). A choice applies to every dtype it
names; a GGUF block type's kernel keeps its built-in prefetch (one whole block ahead).

Prefetch distances are written in units of the kernel's block unit (layout.unit_nbytes: 2,304 bytes for Q4 at
128-row tiles, 4,352 for Q8) plus whole 64-byte lines, as the search's space() spells them, so one entry serves
every tile shape: Pf(1, 1) is one unit and one line ahead (an AMX Xeon's Q4 choice, 2,368 bytes).
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import NamedTuple


class Pf(NamedTuple):
    """A prefetch distance: `units` block units (whole lines of it) plus `lines` 64-byte lines."""

    units: Fraction | int
    lines: int = 0

    def nbytes(self, unit: int) -> int:
        return int(Fraction(self.units) * unit) // 64 * 64 + 64 * self.lines


class Family(NamedTuple):
    """The shipped choices of one microarchitecture family, measured on the ISA path `isa` (its own knobs apply
    there only: ISA_KNOBS)."""

    isa: str
    source: str  # where the measurement is recorded (docs/results/...)
    kernels: dict  # "q4" / "q8" (and "q4:gate_up" for a fused gate+up kernel alone) -> knobs with a Pf
    attention: dict  # KV cache type -> the attention core's prefetch distance (bytes)
    cpus: tuple = ()  # LLVM's host CPU names the choices apply to (those measured); empty: the whole family


_GLOOP = {"group_loop": 1, "unroll": 2, "max_groups": 8, "prefetch_locality": 3, "prefetch_stride": 64,
          "vector_bits": 0, "unpack": 0}
_UNIT = {"group_loop": 0, "unroll": 2, "max_groups": 8, "prefetch_locality": 3, "prefetch_stride": 64,
         "vector_bits": 0, "unpack": 0}

FAMILIES: dict[str, Family] = {
    # an AMX Xeon VM (Intel Xeon, family 6 model 167 masked, AMX): all six shapes of the TinyLlama geometry
    # chose the group loop, Q4 one unit and a line ahead, Q8 a quarter unit ahead. Not on model 207 (above).
    "intel-amx": Family("avx512vnni", "docs/results/intel-amx/tune_table_intel_s15.json",
                        {"q4": {**_GLOOP, "prefetch": Pf(1, 1)},
                         "q8": {**_GLOOP, "prefetch": Pf(Fraction(1, 4))}},
                        {"f16": 1024}, cpus=("rocketlake",)),
    # AMD EPYC Zen 5: the group loop four Q4 units ahead; Q8 two units ahead (two of its three shapes)
    "znver5": Family("avx512vnni", "docs/results/znver5/tune_table_zen5_s18.json",
                     {"q4": {**_GLOOP, "prefetch": Pf(4)},
                      "q8": {**_GLOOP, "prefetch": Pf(2)}},
                     {"f16": 16384}),
    # AMD EPYC Zen 4: no software prefetch and the 256-bit dots for the plain Q4 kernels, one prefetch per unit
    # into L2 for the fused gate+up (docs/journal/performance.md, "Per-host kernel tuning": the descent's table); Q8 was
    # not measured there
    "znver4": Family("avx512vnni", "docs/journal/performance.md (Per-host kernel tuning, the descent)",
                     {"q4": {**_UNIT, "prefetch": Pf(0), "vector_bits": 256},
                      "q4:gate_up": {**_UNIT, "prefetch": Pf(1), "prefetch_stride": -1, "prefetch_locality": 2}},
                     {}),
}


@functools.lru_cache(maxsize=1)
def host_family() -> str:
    """This host's microarchitecture family: "intel-amx" for an Intel core with AMX tiles, else LLVM's host CPU
    name. The real host's, not a forced CFLOW_CPU's: the memory system the choices were measured on."""
    from .target import _cpuinfo

    info = _cpuinfo()
    if info.get("vendor_id") == "GenuineIntel" and "amx_tile" in info.get("flags", "").split():
        return "intel-amx"
    return host_cpu()


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """LLVM's name for the real host's CPU (not a forced CFLOW_CPU's)."""
    import llvmlite.binding as llvm

    from .target import init_llvm

    init_llvm()
    return llvm.get_host_cpu_name()


def shipped_family() -> Family | None:
    """The shipped choices for this host: its family's, where they apply to its CPU (Family.cpus), else None."""
    fam = FAMILIES.get(host_family())
    if fam is None or fam.cpus and host_cpu() not in fam.cpus:
        return None
    return fam


ISA_KNOBS = ("vector_bits", "unpack")  # what only the ISA path a choice was measured on may take


def kernel_choice(layout, gate_up: bool, target) -> dict | None:
    """The shipped mat-vec knobs for one kernel shape on this host, with the prefetch in bytes; None: the built-in
    default (no family, a dtype the family did not measure, or a GGUF block type). On another ISA path than the
    family's the ISA's own knobs are the built-in ones."""
    fam = shipped_family()
    if fam is None or layout.is_block_type:
        return None
    label = layout.dtype.label
    k = fam.kernels.get(f"{label}:gate_up" if gate_up else "") or fam.kernels.get(label)
    if k is None:
        return None
    unit = layout.unit_nbytes
    out = {**k, "prefetch": k["prefetch"].nbytes(unit)}
    if str(target.isa) != fam.isa:
        out.update({knob: 0 for knob in ISA_KNOBS})
    if out["prefetch_stride"] == -1:  # one prefetch per unit
        out["prefetch_stride"] = unit
    return out


def attention_choice(kv: str) -> int | None:
    """The shipped attention-core prefetch distance for a KV cache type on this host (any ISA path), or None."""
    fam = shipped_family()
    return None if fam is None else fam.attention.get(kv)
