"""Stop strings over streamed text: `StopText` cuts the text at the first stop string and holds back a tail that
could still grow into one, so that no part of a stop string is ever shown. Used by `CompiledModel.stream_chat`
(a chat format's own stops, such as the default format's `<|im_end|>`) and by the server (a request's `stop`).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Cut the text at the first stop string; hold back a tail that could still grow into one."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.pending = tuple(stops), ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is safe to show, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:k]):
                    keep = k
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
