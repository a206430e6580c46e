"""Where a decode step's time goes: per-stage cycle stamps of a profiling build, grouped by what a stage does."""

from __future__ import annotations

import time

import numpy as np


def profile(path: str, threads: int, prompt, tokens: int) -> str:
    """The table of a profiled decode of `tokens` steps after `prompt`. Each stage's time (worker 0's stamps after
    consecutive barriers) is split into the threads' work (from the previous barrier's release, as worker 0
    stamps it, to reaching this one; the mean over threads) and their wait (the rest): the wait for the slowest
    thread plus the barrier's own wake-up latency."""
    from cflow.runtime.session import Session

    s = Session(path, threads=threads, profile=True)
    logits = s.prefill(prompt)
    n = s.run_state.schedule.n_stages
    ticks, work = np.zeros(n), np.zeros(n)
    t0 = time.perf_counter()
    for _ in range(tokens):
        logits = s.step(int(np.argmax(logits)))
        ticks += np.diff(s.prof[0])
        # thread t reached stage i's barrier at prof[1 + t][i]; stage i began at worker 0's stamp prof[0][i]
        # (its release from barrier i - 1), stage 0 at the thread's own start, prof[1 + t][n]
        begin = np.repeat(s.prof[0:1, :n], s.threads, axis=0)
        begin[:, 0] = s.prof[1:, n]
        work += (s.prof[1:, :n] - begin).mean(axis=0)
    wall = (time.perf_counter() - t0) / tokens
    s.close()
    per_tick = wall / ticks.sum() * tokens  # seconds per cycle-counter tick, from the same run
    groups: dict[str, list] = {}
    for st, t, w in zip(s.run_state.schedule.stages, ticks, work):
        kinds = sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st if x.nbytes}) or ["no weights: " + ",".join(
            sorted({f"{x.op.split('.')[0]}/{x.phase}" for x in st}))]
        key = " + ".join(kinds)
        g = groups.setdefault(key, [0.0, 0, 0, 0.0])
        g[0] += t * per_tick / tokens
        g[1] += sum(x.nbytes for x in st)
        g[2] += 1
        g[3] += (t - w) * per_tick / tokens
    total_wait = sum(g[3] for g in groups.values())
    lines = [f"profile ({threads} threads, {tokens} tokens, {1e3 * wall:.2f} ms/token; stage times are cycle-counter "
             "stamps after each stage's barrier, scaled to the measured wall time; wait: the threads' mean time "
             f"at the stage's barrier, {100 * total_wait / wall:.1f}% of the token):",
             f"  {'stage kind':<44} {'stages':>6} {'ms/token':>9} {'share':>6} {'wait':>6} {'MB':>8} {'GB/s':>7}"
             f" {'w/o wait':>8}"]
    for k, (sec, nb, cnt, wt) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {k:<44} {cnt:>6} {1e3 * sec:9.3f} {100 * sec / wall:5.1f}% {100 * wt / sec:5.1f}% "
                     f"{nb / 1e6:8.1f} {(nb / sec / 1e9 if sec and nb else 0):7.2f} "
                     f"{(nb / (sec - wt) / 1e9 if sec > wt and nb else 0):8.2f}")
    return "\n".join(lines)
