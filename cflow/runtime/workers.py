"""The threads that run a model's step: how many, when to run on one alone, and the workers themselves.

Worker threads 1..n-1 live in native code (the step's worker entry); Python starts them, kicks them each call
through a futex in a control block, and stops them. Detached (Workers(detached=True)), thread 0 is a worker too
and the caller joins the call's generation instead of running a share. Under load the default thread count backs
off to the caller's thread alone (Backoff), and a detached step to calls in turn (DetachedBackoff). Workers that
outlive a close are parked with what they may still touch.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings

import numpy as np

from ..codegen.abi import CTL_WORDS, JOIN_SYMBOL, KICK_SYMBOL, STEP_SYMBOL, WORKER_SYMBOL, CtlWord
from ..layout.tile import aligned_empty


class OversubscribedWarning(UserWarning):
    """More worker threads were asked for than this process may run on (os.sched_getaffinity)."""


def thread_count(threads: int | None) -> int:
    """The worker threads of a model: by default the cores this process may run on (its affinity mask, which
    taskset, cgroups' cpusets and container limits narrow; os.cpu_count() would count the whole machine).
    Asking for more still works (the barriers sleep instead of spinning) but every extra thread shares a core,
    so it warns; Python's default filter shows a given warning once per process."""
    usable = len(os.sched_getaffinity(0))
    if threads is None:
        return usable
    if threads > usable:
        warnings.warn(f"threads={threads} but this process may run on {usable} core{'s' * (usable != 1)} "
                      f"(os.sched_getaffinity): threads will share cores; the default is {usable}",
                      OversubscribedWarning, stacklevel=3)
    return int(threads)


def cores_taken(threads: int) -> bool:
    """Would `threads` threads not each get a core right now? The runnable tasks other than this calling thread
    (/proc/loadavg's count includes it; the workers sleep while the backoff runs single-threaded), plus `threads`,
    against the cores this process may run on. False where it cannot be read (then the probe decides)."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        cores = len(os.sched_getaffinity(0))
    except (OSError, ValueError, IndexError, AttributeError):
        return False
    return running - 1 + threads > cores


class _Doubling:
    """The backing off both policies share: after a failed judgement, calls run alone until `until`, for
    `backoff` seconds, doubling from FIRST up to MOST while the load lasts; a quiet judgement resets it."""

    # FIRST is short because bursts of other work (another job for 50 ms) also trip a judgement, and running
    # alone past their end costs; MOST is long because each probe under load costs a call that waits for a
    # descheduled worker.
    FIRST, MOST = 0.02, 2.0

    def __init__(self, clock):
        self.clock = clock
        self.until = 0.0  # run alone until this time
        self.backoff = self.FIRST
        self.solo_calls = 0  # calls run alone since load (reported by Session.solo_calls)
        self.trips = 0  # times it backed off (reported by Session.backoffs)

    def trip(self, now: float | None = None) -> None:
        """Back off from now (longer each time the load is still there)."""
        self.trips += 1
        self.until = (self.clock() if now is None else now) + self.backoff
        self.backoff = min(2 * self.backoff, self.MOST)

    def calm(self) -> None:
        """A judgement found no load: the next backoff is FIRST again."""
        self.backoff = self.FIRST


class Backoff(_Doubling):
    """The default thread count under load: back off to one thread while the workers are being descheduled.

    With another process busy on a core, a stage barrier waits for a worker that is not running, once per stage, so
    the default (every usable core) decodes many times slower than one thread (docs/journal/performance.md, "Under
    load"); no spin budget fixes that (the waiter either burns the core the worker needs or pays a wake-up per
    stage). The barrier counts the waits that ended in futex_wait (BarrierWord.NAPS). A quiet host naps too, where
    stages are uneven: 0-1 sleeps per call for models up to ~300 MB per token, 7 for a 0.5B and 35 for a 1.5B (of
    ~140 barriers per call; a busy other core: 120). So the judge is the model's own quiet rate, `floor` (the lowest
    rate of sleeps per call any window has shown): more than 2 x floor + 1 sleeps per call, and at least NAPS within
    a WINDOW of multi-threaded calls, mean a worker is being descheduled, and the calls of the next `backoff`
    seconds run on the caller's thread alone (nthreads = 1: the same arithmetic, bit-identical results; the workers
    stay asleep). Then multi-threaded calls probe again, and the first one under load usually decides at once; the
    backoff doubles up to MOST seconds while the load lasts (so probing costs little) and resets after a quiet
    window. In seconds, not calls: a call takes 50 us on a tiny model, 30 ms on a 1B one. A probe under load costs a
    call that naps at its barriers (~2-3% of a 114m decode measured over 1 s), so when a backoff ends and other
    tasks are runnable right then (`busy`: /proc/loadavg's count of runnable tasks says the threads would not each
    get a core), the probe is skipped and the backoff doubles as if it had failed; the barrier's naps stay the judge
    otherwise (a quiet moment still probes, and other tenants of a VM, invisible here, are caught as before). Only
    the default thread count adapts; an explicit `threads=N` is taken as asked."""

    WINDOW = 8  # multi-threaded calls per probe window
    NAPS = 8  # barrier sleeps in a window that mean descheduled workers
    def __init__(self, clock=time.perf_counter, busy=None):
        super().__init__(clock)
        self.busy = busy if busy is not None else (lambda: False)  # other tasks runnable now? (skip a probe)
        self.skipped = 0  # probes skipped because `busy` said so
        self.calls = self.naps = 0
        self.seen = 0  # BarrierWord.NAPS after the last multi-threaded call
        self.floor: float | None = None  # the lowest sleeps per call of any window: this model's quiet rate

    def solo(self) -> bool:
        """Run the next call on the caller's thread alone?"""
        if self.until:
            now = self.clock()
            if now >= self.until and self.busy():  # the load is still there: skip the probe, back off longer
                self.trip(now)
                self.skipped += 1
            if now < self.until:
                self.solo_calls += 1
                return True
        self.until = 0.0
        return False

    def after(self, naps: int) -> None:
        """After a multi-threaded call: `naps` = BarrierWord.NAPS now."""
        self.naps += naps - self.seen
        self.seen = naps
        self.calls += 1
        limit = self.NAPS if self.floor is None else max(self.NAPS, (2 * self.floor + 1) * self.WINDOW)
        if self.naps >= limit:  # at once, not at the window's end: under load one call already shows it
            self.trip()
        elif self.calls < self.WINDOW:
            return
        else:
            self.calm()
        rate = self.naps / self.calls
        self.floor = rate if self.floor is None else min(self.floor, rate)
        self.calls = self.naps = 0


class DetachedBackoff(_Doubling):
    """A detached step under load: back off to calls in turn while the step's worker is being descheduled.

    Detached, the step's worker and the caller both spin while they wait for each other (the worker for the next
    launch, the caller for the step), which is what makes the overlap pay on a quiet host; with another process
    busy on a core they take turns with it instead, and a token took 3.5x as long as steps in turn (the bundled
    model served, docs/serving.md). The judge is the time from a launch to the end of its wait, against the
    quickest launch seen (`floor`: no launch ends before its step is done): a WINDOW of launches whose mean is
    over FACTOR x floor (decided as soon as its sum passes the bound) means the worker is being descheduled, and
    for the next `backoff` seconds nothing is launched ahead (`active()`) and a one-thread step's calls run on the
    caller's thread (nthreads = 1: the same arithmetic, bit-identical results; the worker falls asleep; a step of
    more threads keeps them). Then launches probe again; the backoff doubles up to MOST seconds while the load
    lasts and resets after a window within the bound. The caller's own work between a launch and its wait (its
    thread's CPU time) is taken out: a grammar-heavy request is not load; the caller waiting for a core, for the
    interpreter lock or for the worker is."""

    WINDOW = 32  # launches per judged window
    FACTOR = 5.0  # a window this many times slower than the quiet floor means a descheduled worker

    def __init__(self, clock=time.perf_counter, cpu_clock=time.thread_time):
        super().__init__(clock)
        self.cpu_clock = cpu_clock  # the caller's thread's CPU time: its own work is not judged
        self.calls, self.total = 0, 0.0
        self.floor: float | None = None  # the fewest seconds from a launch to its wait's end seen
        self.started: float | None = None  # the launch being timed: its wall clock, its caller's CPU clock
        self.started_cpu = self.own = 0.0

    def active(self) -> bool:
        """Backing off now (run calls in turn, launch nothing ahead)?"""
        if self.until and self.clock() < self.until:
            return True
        self.until = 0.0
        return False

    def solo(self) -> bool:
        """Run the next call in turn on the caller's thread? (counted)"""
        if self.active():
            self.solo_calls += 1
            return True
        return False

    def launched(self) -> None:
        self.started, self.started_cpu = self.clock(), self.cpu_clock()

    def waiting(self) -> None:
        """The caller starts waiting for the launched call: its CPU since the launch was its own work."""
        self.own = self.cpu_clock() - self.started_cpu

    def waited(self, judge: bool = True) -> None:
        """After the wait for a launched call (judge=False: a call given up, whose wait says nothing)."""
        if self.started is None or not judge:
            self.started = None
            return
        took = self.clock() - self.started
        self.started = None
        # the floor is the quickest launch seen: no launch ends before its step is done, and even under load some
        # run undisturbed, so a server started under load finds the step's own time too
        self.floor = took if self.floor is None else min(self.floor, took)
        # judged: the time less the caller's own work (a grammar's, the HTTP side's), so that what is left is the
        # wait for the worker and the time the caller itself was not running
        self.total += max(took - self.own, 0.0)
        self.calls += 1
        if self.total > self.FACTOR * self.floor * self.WINDOW:
            # at once, not at the window's end: under load a probe should not cost a whole window
            self.calls, self.total = 0, 0.0
            self.trip()
            return
        if self.calls < self.WINDOW:
            return
        self.calls, self.total = 0, 0.0  # a window within the bound: the load (if any) is gone
        self.calm()


# Workers that were still alive when their session closed (join timed out: a thread descheduled for long), with
# everything they may still touch: the control block they wait on, the step's argument buffers and the JIT-compiled
# code they run. Kept alive here, never freed under a running thread; entries go once all their threads have ended.
_PARKED: list[tuple[list[threading.Thread], tuple]] = []
_PARK_LOCK = threading.Lock()
JOIN_TIMEOUT = 5.0  # seconds close() waits for each worker before parking it


def _reap_parked() -> None:
    with _PARK_LOCK:
        _PARKED[:] = [(ts, keep) for ts, keep in _PARKED if any(t.is_alive() for t in ts)]


def parked_workers() -> int:
    """Worker threads of closed sessions still running (normally 0)."""
    _reap_parked()
    with _PARK_LOCK:
        return sum(t.is_alive() for ts, _ in _PARKED for t in ts)


# Pause rounds a detached step's idle workers and its joiner spin before sleeping: 0.55 ms on the AMX Xeon VM of
# model 167 (14 ns a pause), about 2 ms where a pause is 140 cycles (docs/serving.md, "The next step while a token
# is handed out").
DETACHED_SPINS = 40000


class Workers:
    """Worker threads 1..n-1 live in native code (cflow_worker): each token, worker 0 (the caller)
    kicks them through a futex and runs its share; the step's final barrier means all are done.
    Python only starts them (one thread each, ctypes releases the GIL) and stops them.

    detached: every one of the n threads is a worker, thread 0 too, and the caller only kicks (`launch`) and
    waits (`wait`: cflow_join, until the step's generation is done), so that it can do other work while the step
    runs (the server's host work between tokens, runtime/session.py step_launch). `run` is launch then wait."""

    def __init__(self, library, args, n: int, keep: tuple = (), detached: bool = False):
        self.n, self.detached = n, detached
        # the code the workers run and the buffers args points into: they must outlive the threads (close parks
        # them if a worker lingers)
        self.library, self.keep = library, keep
        self.ctl = aligned_empty(4 * CTL_WORDS, 64, zero=True).view(np.int32)
        vp = ctypes.c_void_p
        self.worker = library.get_cfunc(WORKER_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp, vp)
        self.kick = library.get_cfunc(KICK_SYMBOL, None, vp)
        self.join = library.get_cfunc(JOIN_SYMBOL, None, vp, ctypes.c_int32)
        self.step = library.get_cfunc(STEP_SYMBOL, None, vp, vp, ctypes.c_int64, ctypes.c_int64, vp)
        self.args = args
        if detached:  # the next kick comes after the host's work on a token (100-300 us in a server) and the
            # step after the host's work: either may outlast threads.SPINS (50-200 us, by the CPU's pause), and a
            # party asleep costs a wake-up (30-40 us on the VMs); the host's core is the host's alone meanwhile
            self.ctl[CtlWord.SPINS] = DETACHED_SPINS
        ctl = ctypes.c_void_p(self.ctl.ctypes.data)
        self._ctl = ctl
        self.generation = 0  # kicks so far (ctl.GO, as the i32 it wraps to)
        self.inflight = False  # a step launched and not yet waited for
        self.threads = [threading.Thread(target=self.worker, args=(args[0], args[1], t, n, args[2], ctl), daemon=True,
                                         name=f"cflow-worker-{t}") for t in range(0 if detached else 1, n)]
        for t in self.threads:
            t.start()

    def run(self) -> None:
        if self.detached:
            self.launch()
            self.wait()
            return
        self.kick(self._ctl)
        self.step(self.args[0], self.args[1], 0, self.n, self.args[2])

    def launch(self) -> None:
        """Start the step on the workers and return (detached only; one step in flight at a time)."""
        assert self.detached and not self.inflight
        self.generation = (self.generation + 1 + 2**31) % 2**32 - 2**31
        self.inflight = True
        self.kick(self._ctl)

    def wait(self) -> None:
        """Return once the launched step is done (at once if none is in flight)."""
        if self.inflight:
            self.join(self._ctl, self.generation)
            self.inflight = False

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers. Between tokens a worker only waits on the control block (and the barrier), so one
        that has not ended after the join timeout is parked with the control block, the argument buffers and
        the code, rather than having them freed under it; it ends as soon as it runs again and sees STOP."""
        self.wait()  # a launched step finishes first: its buffers and code go with the session
        self.ctl[CtlWord.STOP] = 1  # then wake everyone
        self.kick(self._ctl)
        for t in self.threads:
            t.join(timeout=JOIN_TIMEOUT if timeout is None else timeout)
        alive = [t for t in self.threads if t.is_alive()]
        if alive:
            with _PARK_LOCK:
                keep = (self.library, self.keep, self.ctl, self._ctl, self.args, self.worker, self.kick)
                _PARKED.append((alive, keep))
        _reap_parked()

