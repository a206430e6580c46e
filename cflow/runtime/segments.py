"""The disk tiers' step, cut into segments: where the schedule is cut so the host can act between native calls,
and the expert tier and weight streamer the host drives there.

Experts on disk: after each ROUTE stage the host reads the choice and starts the reads; before each expert UP
stage it waits for them and points the table at their slots; after DOWN it releases them. Weights on disk: one
stage per call, each stage's matrices read ahead by the streamer.
"""

from __future__ import annotations

import os

import attrs
import numpy as np

from ..errors import CflowError, FormatError
from ..layout.tile import aligned_empty
from ..passes.schedule import Phase
from ..util import crc32
from .format.spec import pad


@attrs.frozen
class Segment:
    """Stages [lo, hi) of the disk-tier schedule, run in one native call, and what the host does around it."""

    lo: int
    hi: int
    awaits: tuple[int, ...]  # layers whose chosen experts must be in RAM before the segment runs
    issues: tuple[int, ...]  # layers whose route is known after it: start their reads (async)
    releases: tuple[int, ...]  # layers whose experts are no longer needed after it


@attrs.frozen
class SegmentPlan:
    segments: list[Segment]
    routed: tuple[int, ...]  # layers with a router, in schedule order
    window_stages: dict[int, int]  # routed layer -> stages run between its choice and its use
    min_slots: int  # expert slots decoding needs: those pinned at once


def plan_segments(schedule, top_k: int, *, every_stage: bool, sync: bool) -> SegmentPlan:
    """Cut the late schedule where the host must act: after each ROUTE stage (read the choice, start the
    reads) and before each expert UP stage (wait, point the table at the slots); release after DOWN.
    every_stage: streamed weights, one stage per call; sync: expert reads start at the await, not the route."""
    route, up, down = {}, {}, {}
    for st in schedule.steps():
        if st.phase == Phase.ROUTE:
            route[st.layer] = st.stage
        elif st.phase == Phase.UP and st.layer in route and st.op.startswith("moe"):
            up[st.layer] = st.stage
        elif st.phase == Phase.DOWN and st.layer in route and st.op.startswith("moe"):
            down[st.layer] = st.stage
    n = schedule.n_stages
    every = set(range(n)) if every_stage else set()
    cuts = sorted({0, n} | {r + 1 for r in route.values()} | set(up.values()) | every)
    segments = []
    for lo, hi in zip(cuts, cuts[1:]):
        segments.append(Segment(
            lo=lo, hi=hi, awaits=tuple(l for l in up if lo <= up[l] < hi),
            issues=tuple(l for l in route if lo <= route[l] < hi),
            releases=tuple(l for l in down if lo <= down[l] < hi)))
    # Experts pinned at once: a layer's choice is pinned from its issue to its release.
    live, most = set(), 0
    for seg in segments:  # in step order: sync issues at the await, async after the route; release last
        live |= set(seg.awaits if sync else seg.issues)
        most = max(most, len(live))
        live -= set(seg.releases)
    return SegmentPlan(segments=segments, routed=tuple(route),
                       window_stages={l: up[l] - route[l] - 1 for l in route}, min_slots=max(1, most) * top_k)


def expert_entries(tensors) -> tuple[dict[tuple[int, int], list[str]], int]:
    """The stored experts' tensor names by (weight block, expert), and the bytes of one cache slot (the largest
    expert's tensors, each padded as the file places them): what the tier allocates and the estimate counts."""
    names: dict[tuple[int, int], list[str]] = {}
    for t in tensors.values():
        if t.expert >= 0:
            names.setdefault((t.block, t.expert), []).append(t.name)
    slot = max((sum(pad(tensors[n].nbytes) for n in ns) for ns in names.values()), default=0)
    return names, slot


def default_cache_bytes(n_experts: int, slot: int, min_slots: int) -> int:
    """The expert cache a load without --expert-cache-mb gets: a quarter of the experts, at least `min_slots`."""
    return max(min_slots, n_experts // 4) * slot


def open_tier(reader, tensors, config, routed, min_slots: int, expert_cache_mb: float | None):
    """The expert tier of a model's experts (tensors: the plan's, whose sizes check_plan matched with the file's),
    sized by `expert_cache_mb` (default_cache_bytes without it); returns it and the names of the tensors it
    holds."""
    from .experts import ExpertTier

    names, per = expert_entries(tensors)
    held = {n for ns in names.values() for n in ns}
    if expert_cache_mb is None:
        budget = default_cache_bytes(len(names), per, min_slots)
    else:
        if not expert_cache_mb > 0:
            raise CflowError(f"expert cache must be > 0 MB, not {expert_cache_mb}")
        budget = int(expert_cache_mb * 2**20)
    layers: dict[int, tuple[int, ...]] = {}  # weight block -> the layers that run it (named in read errors)
    for l in routed:
        layers[config.block_of(l)] = (*layers.get(config.block_of(l), ()), l)
    return ExpertTier(reader, names, budget, min_slots, layers=layers), held


def open_streamer(reader, tensors, schedule, read_ahead: int):
    """Stream every big non-expert matrix (tiled forms) per stage; norms, biases, router and the embedding
    table (one row per token) stay in RAM. Returns the streamer and the names it streams."""
    from ..layout.packed import Form
    from .streaming import StageStreamer

    big = {n for n, t in tensors.items() if t.expert < 0 and t.form.is_tiled}
    per_stage = [[n for st in stage for n in st.tensors if n in big] for stage in schedule.stages]
    streamed = {n for names in per_stage for n in names}
    assert all(tensors[n].form != Form.VECTOR for n in streamed)
    return StageStreamer(reader, per_stage, read_ahead), streamed


def read_dense(fd: int, reader, path: str, name: str) -> np.ndarray:
    """A non-expert tensor read into RAM from `fd` (disk mode: nothing of the file stays mapped), checksummed."""
    e = reader.entry(name)
    buf = aligned_empty(max(e.nbytes, 1), 64)
    got = os.preadv(fd, [memoryview(buf)[: e.nbytes]], e.file_offset)
    if got != e.nbytes or crc32(buf[: e.nbytes]) != e.crc:
        raise FormatError(f"{path}: tensor {name!r} at file offset 0x{e.file_offset:x}: "
                          f"{'short read' if got != e.nbytes else 'checksum mismatch'}")
    return buf
