"""Host detection in one place: the target triple, CPU name and feature string code is built for.

Input: the running host (via LLVM) and the env overrides CFLOW_CPU / CFLOW_FEATURES.
Output: a frozen `Target` whose `magic_tuple()` enters every compile-cache key.

Overrides (for testing the fallback kernels on a capable host):
    CFLOW_CPU=x86-64            use that CPU name; the feature base becomes empty (the CPU's defaults)
    CFLOW_FEATURES=-avx512vnni  comma list of +feat / -feat applied on top of the base features
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import threading

import attrs

from ..errors import CodegenError

_init_lock = threading.Lock()
_initialised = False


def init_llvm() -> None:
    """Initialise LLVM's native target once per process.

    NOTE: llvmlite 0.50's `llvm.initialize()` raises; only the native target and asm printer are needed.
    """
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if not _initialised:
            import llvmlite.binding as llvm

            llvm.initialize_native_target()
            llvm.initialize_native_asmprinter()
            _initialised = True


class ISA(enum.StrEnum):
    """Kernel families, from the most capable down; a kernel runs on any target whose ISA ranks >= its own."""

    AVX512VNNI = "avx512vnni"  # AVX-512 F+BW+VNNI, F16C, FMA: vpdpbusd on 64-byte vectors
    AVXVNNI = "avxvnni"  # AVX2+FMA+F16C and AVX-VNNI (Intel cores from Alder Lake, Zen 5): vpdpbusd on 32-byte halves
    AVX2 = "avx2"  # AVX2+FMA+F16C: vpmaddubsw/vpmaddwd on 32-byte halves
    GENERIC = "generic"  # portable IR only (SSE2 baseline on x86-64)

    @property
    def rank(self) -> int:
        return {ISA.GENERIC: 0, ISA.AVX2: 1, ISA.AVXVNNI: 2, ISA.AVX512VNNI: 3}[self]

    @property
    def vnni(self) -> bool:
        """The integer dot is vpdpbusd (unsigned codes times signed activations, summed into i32 without an i16
        step): signed codes are shifted by +128 and the bias taken off after, at either width."""
        return self in (ISA.AVXVNNI, ISA.AVX512VNNI)

    @property
    def wide(self) -> bool:
        """64-byte vectors (32 registers): larger token groups and more accumulators."""
        return self == ISA.AVX512VNNI

    @property
    def narrow(self) -> bool:
        """The 256-bit x86 paths (AVX2, AVX-VNNI): 16 vector registers, x86 intrinsics on 32-byte halves."""
        return self in (ISA.AVX2, ISA.AVXVNNI)

    def runs_on(self, target_isa: ISA | str) -> bool:
        """Kernels of this ISA can run on a host whose best ISA is `target_isa`."""
        return self.rank <= ISA.parse(target_isa).rank

    @classmethod
    def parse(cls, value: ISA | str) -> ISA:
        try:
            return cls(value)
        except ValueError:
            raise CodegenError(f"unknown kernel ISA {value!r} (expected one of {', '.join(cls)})") from None


def _parse_features(text: str) -> dict[str, bool]:
    """'+avx2,-avx512f' -> {'avx2': True, 'avx512f': False} (order kept, later entries win)."""
    out: dict[str, bool] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item[0] in "+-":
            out[item[1:]] = item[0] == "+"
        else:
            out[item] = True
    return out


def _format_features(feats: dict[str, bool]) -> str:
    """Enables first, then disables (each group sorted, so the string is canonical for cache keys).

    NOTE: LLVM applies the list in order and an enable also turns on what it implies
    ('+avx512vnni' implies avx512f); disables go last so '-avx512f' also clears its dependents."""
    on = sorted(n for n, v in feats.items() if v)
    off = sorted(n for n, v in feats.items() if not v)
    return ",".join(["+" + n for n in on] + ["-" + n for n in off])


@attrs.frozen
class Target:
    """What code is generated for: LLVM triple, CPU name and the full +/- feature string."""

    triple: str
    cpu: str
    features: str

    @property
    def feature_map(self) -> dict[str, bool]:
        return _parse_features(self.features)

    def has(self, feature: str) -> bool:
        return self.feature_map.get(feature, False)

    # Capabilities the kernels choose from. A feature only counts when everything it builds on is on,
    # mirroring LLVM, which clears dependent features (e.g. -avx2 also disables avx512f).
    @property
    def has_avx2(self) -> bool:
        return self.has("avx") and self.has("avx2")

    @property
    def has_fma(self) -> bool:
        return self.has("avx") and self.has("fma")

    @property
    def has_f16c(self) -> bool:
        return self.has("avx") and self.has("f16c")

    @property
    def has_avx512(self) -> bool:
        """AVX-512 F + BW (byte/word ops on 64-byte vectors)."""
        return self.has_avx2 and self.has_fma and self.has_f16c and self.has("avx512f") and self.has("avx512bw")

    @property
    def has_avx512_bf16(self) -> bool:
        """VDPBF16PS at 128/256/512 bits (kv='bf16' attention: attention.attention)."""
        return self.has_avx512 and self.has("avx512vl") and self.has("avx512bf16")

    @property
    def bf16_unit(self) -> str:
        """What kv='bf16' attention's dot products run on (attention.attention): 'amx' (the tile unit's TDPBF16PS, where
        the CPU has AMX-BF16 and the kernel lets this process use the tile state: amx_permitted), 'dpbf16'
        (AVX512_BF16's VDPBF16PS) or '' (an FMA emulation of VDPBF16PS)."""
        if not self.has_avx512_bf16:
            return ""
        if self.has("amx-tile") and self.has("amx-bf16") and amx_permitted():
            return "amx"
        return "dpbf16"

    @property
    def has_avx512_vnni(self) -> bool:
        """AVX-512 VNNI with VL (its 256-bit form too: the avxvnni kernels run on such a host, EVEX-encoded)."""
        return self.has_avx512 and self.has("avx512vnni") and self.has("avx512vl")

    @property
    def has_avx_vnni(self) -> bool:
        """vpdpbusd on 32-byte vectors: AVX-VNNI (VEX) or AVX-512 VNNI with VL."""
        return self.has_avx2 and self.has_fma and self.has_f16c and (self.has("avxvnni") or self.has_avx512_vnni)

    @property
    def isa(self) -> ISA:
        """The kernel family this target gets."""
        if self.has_avx512_vnni:
            return ISA.AVX512VNNI
        if self.has_avx_vnni:
            return ISA.AVXVNNI
        if self.has_avx2 and self.has_fma and self.has_f16c:
            return ISA.AVX2
        return ISA.GENERIC

    def magic_tuple(self) -> tuple[str, str, str]:
        """(triple, cpu, features): everything about the target that changes emitted machine code."""
        return (self.triple, self.cpu, self.features)

    def with_features(self, edits: str) -> Target:
        """A copy with '+feat,-feat' edits applied (tests force fallback paths this way)."""
        feats = self.feature_map
        feats.update(_parse_features(edits))
        return attrs.evolve(self, features=_format_features(feats))

    def describe(self) -> str:
        return f"{self.triple} cpu={self.cpu} isa={self.isa}"


# The feature edits that force each path below a host's best (CFLOW_FEATURES): '-avx512f' also clears everything
# AVX-512 (VNNI, VL, BW, BF16) and leaves AVX-VNNI where the CPU has it; a path the CPU cannot run is not created by
# them (forcing only takes features away), so the result is checked: forced_env(isa) then host_target().isa.
# AVX2 also drops GFNI: the CPUs of that path (AMD Zen 2 / 3, Intel client cores before Alder Lake) lack it, and
# with it LLVM turns each byte shift of the nibble unpack into one vgf2p8affineqb where they take vpsrlw + vpand
# (5-10% fewer instructions in the Q4 and Q4_K inner loops, benchmarks/kernel_asm.py: a forced figure would flatter
# the path).
FORCE_FEATURES = {"avx512vnni": "", "avxvnni": "-avx512f", "avx2": "-avx512f,-avxvnni,-gfni"}


def forced_env(isa: ISA | str) -> dict[str, str]:
    """The CFLOW_CPU / CFLOW_FEATURES values that make this host build `isa`'s kernels (benchmarks and tests that
    measure or check a path other than the host's best; 'generic' is the portable IR for a plain x86-64)."""
    isa = ISA.parse(isa)
    if isa == ISA.GENERIC:
        return {"CFLOW_CPU": "generic", "CFLOW_FEATURES": ""}
    return {"CFLOW_CPU": "", "CFLOW_FEATURES": FORCE_FEATURES[isa]}


def forced_target(isa: ISA | str) -> Target | None:
    """The target this host builds `isa`'s kernels for when forced (forced_env's edits on the plain host; generic:
    generic_target), or None where the host cannot run that path (forcing only takes features away)."""
    isa = ISA.parse(isa)
    if isa == ISA.GENERIC:
        return generic_target()
    host = host_target(env=False)
    t = host.with_features(FORCE_FEATURES[isa]) if FORCE_FEATURES[isa] else host
    return t if t.isa == isa else None


def isa_path() -> str:
    """The ISA path this process's kernels are built for, as benchmarks record it beside the CPU: e.g.
    'avx512vnni', or 'avx2 (forced: CFLOW_FEATURES=-avx512f,-avxvnni,-gfni)' when CFLOW_CPU / CFLOW_FEATURES make this
    host build another path than its best (a forced figure measures the path, on this host's memory system)."""
    forced = [f"{k}={os.environ[k]}" for k in ("CFLOW_CPU", "CFLOW_FEATURES") if os.environ.get(k)]
    isa = str(host_target().isa)
    return f"{isa} (forced: {', '.join(forced)})" if forced and isa != host_target(env=False).isa else isa


def host_target(cpu: str | None = None, features: str | None = None, *, env: bool = True) -> Target:
    """Detect the host; explicit arguments win over CFLOW_CPU / CFLOW_FEATURES, which win over the host.

    Args:
        cpu: CPU name for LLVM (e.g. 'x86-64', 'haswell'); setting it empties the feature base.
        features: '+feat,-feat' edits applied on top of the base feature set.
        env: read the CFLOW_* overrides (False gives the plain host).
    """
    import llvmlite.binding as llvm

    init_llvm()
    if cpu is None and env:
        cpu = os.environ.get("CFLOW_CPU") or None
    if features is None and env:
        features = os.environ.get("CFLOW_FEATURES") or None
    if cpu is None:
        cpu = llvm.get_host_cpu_name()
        base = _parse_features(llvm.get_host_cpu_features().flatten())
    else:
        base = {}
    if features:
        base.update(_parse_features(features))
    return Target(triple=llvm.get_process_triple(), cpu=cpu, features=_format_features(base))


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where it cannot be read): read once per process."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if not ln.strip():
                    break  # the first processor's block is enough
                k, _, v = ln.partition(":")
                fields.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return fields


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64 (asm/prctl.h)


@functools.lru_cache(maxsize=1)
def amx_permitted() -> bool:
    """Ask Linux for this process's use of the AMX tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)):
    without it the first tile instruction kills the process (SIGILL). Process-wide, so once; False where the
    kernel refuses (before 5.16, a signal stack too small for the 8 KiB tile state) or this is not x86-64 Linux."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
                            ctypes.c_long(XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def cpu_name() -> str:
    """The host's CPU model name as /proc/cpuinfo (and lscpu) give it. Hypervisors often shorten it ("AMD
    EPYC" on both a Zen 4 and a Zen 5 host), so figures are labelled with cpu_model() instead."""
    return _cpuinfo().get("model name", "unknown CPU")


def cpu_model() -> str:
    """The host's CPU, recorded beside every benchmark figure: the model name, LLVM's name for the
    microarchitecture and the CPUID family/model, e.g. "AMD EPYC (znver5, family 26 model 2)": the name alone
    does not tell a Zen 4 host from a Zen 5 one."""
    fields = _cpuinfo()
    init_llvm()
    import llvmlite.binding as llvm

    extra = [llvm.get_host_cpu_name()]
    if "cpu family" in fields and "model" in fields:
        extra.append(f"family {fields['cpu family']} model {fields['model']}")
    # LLVM names the core from the family/model, which a hypervisor may mask: an AMX Xeon reports model 167
    # ("rocketlake", a core without AMX). The tile unit tells a Sapphire Rapids-class or later Intel core apart.
    if "amx_tile" in fields.get("flags", "").split():
        extra.append("AMX")
    return f"{cpu_name()} ({', '.join(extra)})"


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache(cpu: int = 0) -> tuple[str, int]:
    """The last cache level the kernel reports for `cpu` (sysfs, e.g. ('L3', 503316480)); ('?', 0) where it is
    not exposed. Hosts differ by an order of magnitude here (32 MiB on a Zen 4 or Zen 5, 480 MiB on an AMX
    Xeon), and a set meant to stream from DRAM must be larger than it (tune.stream_span)."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/cache"
    caches = []  # (level, bytes)
    try:
        for d in os.listdir(base):
            if d.startswith("index"):
                with open(os.path.join(base, d, "level")) as f:
                    level = int(f.read())
                with open(os.path.join(base, d, "size")) as f:
                    text = f.read().strip().upper()  # e.g. '491520K'
                caches.append((level, int(text.rstrip("KMG")) * _SIZE_UNITS[text.lstrip("0123456789")]))
    except (OSError, ValueError, KeyError):
        return "?", 0
    level, size = max(caches, default=(0, 0))
    return (f"L{level}", size) if size else ("?", 0)


def generic_target() -> Target:
    """The architecture's baseline CPU (SSE2 on x86-64): the portable-kernel path, runnable on any host."""
    return host_target(cpu="generic", features="", env=False)
