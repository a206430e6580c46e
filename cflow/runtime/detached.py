"""The detached step's API of a Session: start a decode step, do other work, take its logits or give it up.

    session.step_launch(token)   start step(token) and return (a session loaded with detached=True)
    session.step_wait()          its logits once it is done (a view, as step() gives)
    session.step_drop()          give it up: stopped at its next stage boundary on one thread, else waited for;
                                 slot 0's position goes back to the token's, which the next call writes again

Any other call on the session (step, prefill, step_batch, reset, release, the KV spans) first waits for a step in
flight. The server launches a lone sequence's next step this way while it hands out the token just drawn
(serve/backends.py, docs/serving.md).
"""

from __future__ import annotations

import numpy as np

from ..errors import RuntimeFault


class DetachedSteps:
    """Mixed into Session (runtime/session.py): the methods above, over its `native` step, `pos`, `slot_open`
    and `_set_token`."""

    _launched_pos: int | None = None  # slot 0's position of the step in flight (step_drop puts it back)

    def step_launch(self, token: int) -> None:
        """Start step(token) and return while it runs: the caller does its own work meanwhile (the server: the
        token's text out, the next draw's bookkeeping) and takes the logits with step_wait(). The position
        advances now. Launching while in_turn() says the step is backing off under load still works (and is
        judged); the server does not."""
        if not self.detached:
            raise RuntimeFault("step_launch needs a session loaded with detached=True")
        self._set_token(token)
        self.native.launch()
        self._launched_pos = self.pos
        self.pos += 1
        self.slot_open[0] = True

    def in_turn(self) -> bool:
        """Is the detached step backing off under load (runtime/workers.py DetachedBackoff)? Then the caller
        should not launch ahead: its calls run in turn on its own thread for now."""
        backoff = self.native.detached_backoff
        return backoff is not None and backoff.active()

    def step_wait(self) -> np.ndarray:
        """The logits of the launched step (a view, as step() gives), once it is done."""
        self.native.wait(judge=True)
        return self.native.logits_view

    def step_drop(self) -> None:
        """Give up the launched step (its token will not be used): stopped at its next stage boundary where it
        runs on one thread, else waited for; slot 0's position goes back to the token's. Nothing to do once the
        step has been waited for (by step_wait or any other call)."""
        if self.native.inflight:
            self.native.abort()
            self.pos = self._launched_pos
