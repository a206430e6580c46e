"""The step's threads in generated code: the stage barrier and the persistent workers, woken by a futex.

Stage: codegen. barrier() is what every thread calls after each stage (codegen/step.py); emit_workers() the
worker loop the runtime starts once per model and kicks once per token (abi.CtlWord), with no Python in
between. BarrierWord and CtlWord (abi.py) say what the words mean.
"""

from __future__ import annotations

from llvmlite import ir

from .abi import FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE, BarrierWord, CtlWord, sys_futex
from .cgutils import P, alloca_once, c32, c64, i32, i64, internal_function, pause, syscall

SPINS = 4000  # pause rounds before an idle worker sleeps until the next token (emit_workers)
BARRIER_SPINS = 4000  # pause rounds before a thread waiting at a barrier sleeps (BarrierWord.SPIN overrides)


def _futex(b: ir.IRBuilder, word, op: int, val) -> None:
    """futex(word, op, val) through libc's syscall(); the JIT runs the code in this process, hence its triple."""
    import llvmlite.binding as llvm

    nr = sys_futex(llvm.get_process_triple())
    b.call(syscall(b.module), [c64(nr), b.ptrtoint(word, i64), c64(op), val, c64(0)])


def barrier(m: ir.Module, isa: str):
    """barrier(state, nth): wait until all nth threads have arrived (BarrierWord explains the words).

    A waiter spins (with pause) for SPIN rounds, then sleeps in futex_wait on the generation word, so a
    thread waiting for a descheduled one hands its core back (possibly to that very thread) instead of
    burning it. The last arriver bumps the generation and calls FUTEX_WAKE only if SLEEPERS is non-zero:
    the uncontended path makes no system call. No lost wake-up: a sleeper increments SLEEPERS before it
    rechecks the generation, the last arriver bumps the generation before it reads SLEEPERS (both seq_cst,
    so one of them sees the other), and futex_wait itself returns at once if the generation has moved.
    """

    def build(b, state, nth):
        done = b.append_basic_block("done")
        wait = b.append_basic_block("wait")
        last = b.append_basic_block("last")
        spin = b.append_basic_block("spin")
        poll = b.append_basic_block("poll")
        sleep = b.append_basic_block("sleep")
        recheck = b.append_basic_block("recheck")
        nap = b.append_basic_block("nap")
        woke = b.append_basic_block("woke")
        cnt = b.gep(state, [c32(BarrierWord.COUNT)])
        gen_p = b.gep(state, [c32(BarrierWord.GENERATION)])
        sleepers = b.gep(state, [c32(BarrierWord.SLEEPERS)])
        b.cbranch(b.icmp_signed("<=", nth, c64(1)), done, wait)
        b.position_at_end(wait)
        gen = b.load_atomic(gen_p, "acquire", 4)
        arrived = b.atomic_rmw("add", cnt, ir.Constant(i32, 1), "acq_rel")
        is_last = b.icmp_signed("==", b.sext(arrived, i64), b.sub(nth, c64(1)))
        b.cbranch(is_last, last, spin)

        b.position_at_end(last)
        b.store_atomic(ir.Constant(i32, 0), cnt, "monotonic", 4)
        b.atomic_rmw("add", gen_p, ir.Constant(i32, 1), "seq_cst")
        anyone = b.icmp_signed("!=", b.load_atomic(sleepers, "seq_cst", 4), ir.Constant(i32, 0))
        with b.if_then(anyone, likely=False):
            _futex(b, gen_p, FUTEX_WAKE_PRIVATE, c64(1 << 30))
        b.branch(done)

        b.position_at_end(spin)
        budget = b.sext(b.load_atomic(b.gep(state, [c32(BarrierWord.SPIN)]), "monotonic", 4), i64)
        budget = b.select(b.icmp_signed("==", budget, c64(0)), c64(BARRIER_SPINS), budget)
        spins = alloca_once(b, i64)
        b.store(c64(0), spins)
        b.branch(poll)
        b.position_at_end(poll)
        moved = b.icmp_signed("!=", b.load_atomic(gen_p, "acquire", 4), gen)
        count = b.append_basic_block("count")
        b.cbranch(moved, done, count)
        b.position_at_end(count)
        pause(b, isa)
        n = b.add(b.load(spins), c64(1))
        b.store(n, spins)
        b.cbranch(b.icmp_signed(">", n, budget), sleep, poll)

        b.position_at_end(sleep)
        b.atomic_rmw("add", b.gep(state, [c32(BarrierWord.NAPS)]), ir.Constant(i32, 1), "monotonic")
        b.atomic_rmw("add", sleepers, ir.Constant(i32, 1), "seq_cst")
        b.branch(recheck)
        b.position_at_end(recheck)
        b.cbranch(b.icmp_signed("!=", b.load_atomic(gen_p, "seq_cst", 4), gen), woke, nap)
        b.position_at_end(nap)  # returns at once if the generation is no longer gen; spurious wake-ups recheck
        _futex(b, gen_p, FUTEX_WAIT_PRIVATE, b.sext(gen, i64))
        b.branch(recheck)
        b.position_at_end(woke)
        b.atomic_rmw("sub", sleepers, ir.Constant(i32, 1), "seq_cst")
        b.branch(done)

        b.position_at_end(done)
        b.ret_void()

    return internal_function(m, ("barrier",), (P(i32), i64), build)


def emit_workers(m: ir.Module, step: ir.Function, isa: str, worker_name: str, kick_name: str,
                 join_name: str) -> None:
    """cflow_worker(ptrs, params, tid, nth, barrier, ctl): loop { wait until ctl.go changes; run the step;
    ctl.done = go } until ctl.stop; cflow_kick(ctl): start the next token (go += 1, wake the sleepers);
    cflow_join(ctl, gen): return once the step of generation `gen` is done (when every thread of the step is a
    worker, so that the caller is free meanwhile: runtime.workers.Workers(detached=True)).

    A waiting worker spins briefly (the next token usually follows within microseconds), then sleeps
    in futex_wait, so an idle loaded model costs no CPU.
    """
    args = [a.type for a in step.args]
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), args + [P(i32)]), worker_name)
    fn.attributes.add("nounwind")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    *step_args, ctl = fn.args
    go_p, stop_p = b.gep(ctl, [c32(CtlWord.GO)]), b.gep(ctl, [c32(CtlWord.STOP)])
    seen = alloca_once(b, i32)
    spins = alloca_once(b, i64)
    # NOTE: start from generation 0, the value ctl.go has when the workers are created, not from
    # whatever it is when this thread gets going: a kick may already have happened by then.
    b.store(ir.Constant(i32, 0), seen)
    wait, poll, sleep, run, out = (b.append_basic_block(n) for n in ("wait", "poll", "sleep", "run", "out"))
    b.branch(wait)
    b.position_at_end(wait)
    b.store(c64(0), spins)
    budget = _spin_budget(b, ctl)
    b.branch(poll)
    b.position_at_end(poll)
    now = b.load_atomic(go_p, "acquire", 4)
    changed = b.icmp_signed("!=", now, b.load(seen))
    check_spin = b.append_basic_block("check_spin")
    b.cbranch(changed, run, check_spin)
    b.position_at_end(check_spin)
    pause(b, isa)
    n = b.add(b.load(spins), c64(1))
    b.store(n, spins)
    b.cbranch(b.icmp_signed(">", n, budget), sleep, poll)
    b.position_at_end(sleep)  # futex_wait returns at once if go already moved on: no lost wake-up
    _futex(b, go_p, FUTEX_WAIT_PRIVATE, b.sext(b.load(seen), i64))
    b.branch(poll)
    b.position_at_end(run)
    b.store(now, seen)
    stop = b.load_atomic(stop_p, "acquire", 4)
    go_on = b.append_basic_block("go_on")
    b.cbranch(b.icmp_signed("!=", stop, ir.Constant(i32, 0)), out, go_on)
    b.position_at_end(go_on)
    b.call(step, step_args)
    # the step is over (every thread has passed its last barrier; thread 0, which says so, has also written its
    # profiling stamps): tell cflow_join, waking a sleeper if one says it sleeps (both seq_cst against its
    # JOINERS-then-DONE: one side sees the other, no lost wake-up). Attached, thread 0 is the caller: no one joins.
    with b.if_then(b.icmp_signed("==", step_args[2], c64(0))):
        done_p = b.gep(ctl, [c32(CtlWord.DONE)])
        b.store_atomic(now, done_p, "seq_cst", 4)
        joiners = b.load_atomic(b.gep(ctl, [c32(CtlWord.JOINERS)]), "seq_cst", 4)
        with b.if_then(b.icmp_signed("!=", joiners, ir.Constant(i32, 0)), likely=False):
            _futex(b, done_p, FUTEX_WAKE_PRIVATE, c64(1 << 30))
    b.branch(wait)
    b.position_at_end(out)
    b.ret_void()

    _emit_join(m, isa, join_name)
    kick = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(i32)]), kick_name)
    kick.attributes.add("nounwind")
    b = ir.IRBuilder(kick.append_basic_block("entry"))
    go_p = b.gep(kick.args[0], [c32(CtlWord.GO)])
    b.atomic_rmw("add", go_p, ir.Constant(i32, 1), "acq_rel")
    _futex(b, go_p, FUTEX_WAKE_PRIVATE, c64(1 << 30))
    b.ret_void()


def _emit_join(m: ir.Module, isa: str, name: str) -> None:
    """cflow_join(ctl, gen): spin (with pause) until ctl.done == gen, then sleep in futex_wait on it. The caller
    (the host's thread, back from its own work between kicks) usually finds the step nearly done, so the spin
    covers it; a long step gets the core back to the other threads."""
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [P(i32), i32]), name)
    fn.attributes.add("nounwind")
    ctl, gen = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    done_p, joiners = b.gep(ctl, [c32(CtlWord.DONE)]), b.gep(ctl, [c32(CtlWord.JOINERS)])
    spins = alloca_once(b, i64)
    b.store(c64(0), spins)
    budget = _spin_budget(b, ctl)
    poll, count, sleep, recheck, nap, woke, out = (b.append_basic_block(n) for n in (
        "poll", "count", "sleep", "recheck", "nap", "woke", "out"))
    b.branch(poll)
    b.position_at_end(poll)
    b.cbranch(b.icmp_signed("==", b.load_atomic(done_p, "acquire", 4), gen), out, count)
    b.position_at_end(count)
    pause(b, isa)
    n = b.add(b.load(spins), c64(1))
    b.store(n, spins)
    b.cbranch(b.icmp_signed(">", n, budget), sleep, poll)
    b.position_at_end(sleep)
    b.atomic_rmw("add", joiners, ir.Constant(i32, 1), "seq_cst")
    b.branch(recheck)
    b.position_at_end(recheck)
    now = b.load_atomic(done_p, "seq_cst", 4)
    b.cbranch(b.icmp_signed("==", now, gen), woke, nap)
    b.position_at_end(nap)  # returns at once if done is no longer `now`; spurious wake-ups recheck
    _futex(b, done_p, FUTEX_WAIT_PRIVATE, b.sext(now, i64))
    b.branch(recheck)
    b.position_at_end(woke)
    b.atomic_rmw("sub", joiners, ir.Constant(i32, 1), "seq_cst")
    b.branch(out)
    b.position_at_end(out)
    b.ret_void()


def _spin_budget(b: ir.IRBuilder, ctl):
    """The pause rounds ctl.SPINS asks for (i64), SPINS where it is 0 (runtime.workers sets it)."""
    v = b.sext(b.load_atomic(b.gep(ctl, [c32(CtlWord.SPINS)]), "monotonic", 4), i64)
    return b.select(b.icmp_signed("==", v, c64(0)), c64(SPINS), v)
