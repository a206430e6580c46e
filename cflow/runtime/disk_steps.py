"""The disk tiers' side of a Session: the step in segments, the expert tier's reads between them, the streamer.

With experts (or weights) on disk the step runs as stage ranges (segments, runtime/segments.py): between two
calls the host awaits the reads a segment needs, points the step's table at them, and issues the reads of the
routes the segment chose (and, on a guess, the next layer's: runtime/route_guess.py).
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..codegen.abi import Param
from ..errors import CflowError
from .memory_estimate import cache_budget
from .route_guess import RouteGuess
from .segments import open_streamer, open_tier, plan_segments


class DiskSteps:
    """Mixed into Session (runtime/session.py): opening the tiers, one token's segments, their counters."""

    def _open_disk(self, expert_cache_mb: float | None) -> None:
        """The segments of the step and, for experts on disk, the expert tier; for weights on disk, the streamer."""
        self._dense_fd = os.open(self.path, os.O_RDONLY)
        plan = plan_segments(self.run_state.schedule, self.config.top_k, every_stage=self.weights == "disk",
                             sync=self.expert_io == "sync")
        self.segments = plan.segments
        self.window_stages = plan.window_stages  # stages run between a choice and its use
        self.segment_seconds = np.zeros(len(self.segments))  # native time per segment, summed over steps
        self._layer_misses = {l: 0 for l in plan.routed}
        self._min_slots = plan.min_slots
        scratch = self.program.scratch
        self._route_at = {l: scratch.route + l * scratch.route_stride for l in plan.routed}
        if self.experts == "disk" and self.max_ram is not None:  # the cache gets what the budget leaves
            # every part in full on top of the resident set: the KV cache and buffers are allocated but mostly
            # untouched yet, and a long context fills them
            expert_cache_mb = max(1, cache_budget(self.max_ram, sum(self.memory_parts().values()))) / 2**20
        self.route_guess = None
        if self.experts == "disk" and self.expert_io == "async" and self.guess_routes:
            self.route_guess = RouteGuess(self.run_state, self.reader.tensor, at=scratch.xn,
                                          only={l for l, w in plan.window_stages.items() if w == 0})
        if self.experts == "disk":
            try:
                self.tier, self.tier_tensors = open_tier(self.reader, self.compiled.tensors, self.config,
                                                         plan.routed, self._min_slots, expert_cache_mb)
            except CflowError as e:
                if self.max_ram is None:
                    raise
                raise CflowError(f"max_ram {self.max_ram / 2**30:.2f} GiB leaves {expert_cache_mb:.0f} MiB for "
                                 f"the expert cache once the step is built: {e}") from None
        if self.weights == "disk":
            self.streamer, self.streamed = open_streamer(self.reader, self.compiled.tensors,
                                                         self.run_state.schedule, self.read_ahead)

    def _route(self, layer: int) -> np.ndarray:
        """The experts layer `layer` chose (thread 0's copy; every thread routes alike)."""
        at = self._route_at[layer]
        return self.scratch[at : at + 4 * self.config.top_k].view(np.int32).copy()

    def _step_segments(self) -> None:
        chosen: dict[int, np.ndarray] = {}
        blk = self.config.block_of
        clock = time.perf_counter
        native = self.native
        # One thread count for every segment of the token: each thread keeps its own copy of a layer's route
        # (and shared-expert gate) in its scratch, written by the ROUTE segment and read by the expert
        # segments. Were the backoff to switch from one thread to all between them, a worker would read its stale
        # route and the pointer of an expert nobody loaded (NULL until first chosen: a SIGSEGV).
        solo = self._solo()
        for k, seg in enumerate(self.segments):
            for l in seg.awaits:
                if self.expert_io == "sync":
                    self._layer_misses[l] += self.tier.issue(blk(l), chosen[l], l)
                for name, addr in self.tier.wait(blk(l), chosen[l]).items():
                    native.point(name, addr)
            if self.streamer is not None:
                for name, addr in self.streamer.wait(seg.lo).items():  # one stage per segment when streaming
                    native.point(name, addr)
            native.params[Param.STAGE_LO], native.params[Param.STAGE_HI] = seg.lo, seg.hi
            t0 = clock()
            self._run_native(solo)
            self.segment_seconds[k] += clock() - t0  # compute only: what the overlap model needs
            if self.streamer is not None:
                self.streamer.done(seg.lo)
            for l in seg.issues:
                chosen[l] = self._route(l)
                if self.expert_io == "async":
                    self._layer_misses[l] += self.tier.issue(blk(l), chosen[l], l)
                    if self.route_guess is not None and (g := self.route_guess.guess(l, self.scratch)):
                        self.tier.prefetch(blk(g[0]), g[1], g[0])  # the next layer's reads, on a guess
            for l in seg.releases:
                self.tier.release(blk(l), chosen[l])
        if solo and native.backoff is not None:
            native.backoff.solo_calls += len(self.segments) - 1  # solo_calls counts native calls, solo() one

    def misses_by_layer(self) -> dict[int, int]:
        """Expert reads started per layer since load (the disk tier)."""
        return dict(self._layer_misses)

    def _reset_io(self) -> None:
        if self.tier is not None:
            self.tier.reset()
        if self.streamer is not None:
            self.streamer.reset()

