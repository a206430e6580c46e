"""The engine's scheduling loop on a scripted backend (no model): continuous batching at token boundaries,
refill from the queue, cancellation, the queue limit, a failing sequence; and stop-string hold-back."""

import asyncio
import threading
import time

import pytest

from cflow.serve.engine import Engine, EngineStopped, QueueFull
from cflow.serve.job import Finish, Job, Piece, SamplingParams, StopText
from cflow.serve.template import default_chat_prompt


class Script:
    """Slots that 'generate' the job's prompt ids back, one per step, then end (None); prompt id 666 raises.
    Logs every call, and checks the engine never calls it from two threads at once."""

    def __init__(self, slots: int, delay: float = 0.0, chunk: int = 0):
        self.slots, self.delay, self.chunk = slots, delay, chunk  # chunk: prompt ids per prefill (0: all at start)
        self.todo: dict[int, list[int]] = {}
        self.unread: dict[int, int] = {}
        self.log: list[tuple] = []
        self.busy = threading.Lock()
        self.threads: set[int] = set()

    def _enter(self):
        assert self.busy.acquire(blocking=False), "backend called from two threads at once"
        self.threads.add(threading.get_ident())

    def start(self, slot, job):
        self._enter()
        try:
            assert slot not in self.todo, "slot reused before stop"
            self.todo[slot] = list(job.prompt_ids)
            self.log.append(("start", slot, job.prompt_ids[0]))
            if self.chunk:
                self.unread[slot] = len(job.prompt_ids)
            return self.unread.get(slot, 0)
        finally:
            self.busy.release()

    def prefill(self, slot):
        self._enter()
        try:
            assert self.unread.get(slot), "prefill of a slot whose prompt is read"
            self.unread[slot] = max(0, self.unread[slot] - self.chunk)
            self.log.append(("prefill", slot, self.unread[slot]))
            return self.unread[slot]
        finally:
            self.busy.release()

    def advance(self, slots):
        self._enter()
        try:
            time.sleep(self.delay)
            self.log.append(("advance", tuple(slots)))
            assert not any(self.unread.get(s) for s in slots), "advance of a slot still reading its prompt"
            out = []
            for s in slots:
                if not self.todo[s]:
                    out.append(None)
                    continue
                t = self.todo[s].pop(0)
                out.append(RuntimeError("boom") if t == 666 else t)
            return out
        finally:
            self.busy.release()

    def stop(self, slot):
        self.todo.pop(slot, None)
        self.unread.pop(slot, None)
        self.log.append(("stop", slot))

    def close(self):
        self.log.append(("close",))


async def _run(job: Job):
    text, fin = [], None
    async for ev in job.events():
        if isinstance(ev, Piece):
            text.append(ev.text)
        else:
            fin = ev
    return "".join(text), fin


def _job(ids, max_tokens=100, stops=()):
    return Job(ids, SamplingParams(max_tokens=max_tokens, stops=stops))


def test_jobs_join_and_leave_at_token_boundaries():
    be = Script(2)

    async def main():
        eng = Engine(be, max_queue=8)
        a, b, c = _job([10, 11]), _job([20, 21, 22, 23, 24, 25]), _job([30, 31, 32])
        for j in (a, b, c):
            eng.submit(j)
        out = await asyncio.gather(_run(a), _run(b), _run(c))
        eng.close()
        return out

    (ta, fa), (tb, fb), (tc, fc) = asyncio.run(main())
    assert (ta, tb, tc) == (" 10 11", " 20 21 22 23 24 25", " 30 31 32")
    assert fa == Finish("stop", 2, 2) and fb.completion_tokens == 6 and fc.reason == "stop"
    starts = [e for e in be.log if e[0] == "start"]
    assert starts[:2] == [("start", 0, 10), ("start", 1, 20)]  # a and b run together
    # c waits for a free slot and takes a's slot while b keeps going: one step later both advance together
    i_c = be.log.index(("start", 0, 30))
    assert ("stop", 0) in be.log[:i_c]
    after = next(e for e in be.log[i_c:] if e[0] == "advance")
    assert sorted(after[1]) == [0, 1]
    assert max(len(e[1]) for e in be.log if e[0] == "advance") == 2
    assert len(be.threads) == 1 and be.log[-1] == ("close",)


def test_chunked_prefill_interleaves_with_decode():
    """A long prompt arriving while another stream runs is read a piece per loop turn, each piece followed by a
    decode step of the running stream (which keeps getting tokens); the new stream decodes once its prompt is read."""
    be = Script(2, delay=0.002, chunk=4)

    async def main():
        eng = Engine(be, max_queue=8)
        a, b = _job(list(range(100, 160))), _job(list(range(1, 41)))
        eng.submit(a)
        text_a = []
        async for ev in a.events():
            if isinstance(ev, Piece):
                text_a.append(ev.text)
                if len(text_a) == 2:
                    eng.submit(b)  # the long prompt arrives while a is decoding
        out_b = await _run(b)
        eng.close()
        return "".join(text_a), out_b

    ta, (tb, fb) = asyncio.run(main())
    assert ta == "".join(f" {i}" for i in range(100, 160))
    assert tb == "".join(f" {i}" for i in range(1, 41)) and fb.reason == "stop"
    slot_b = next(e[1] for e in be.log if e[0] == "start" and e[2] == 1)
    slot_a = 1 - slot_b
    pieces = [i for i, e in enumerate(be.log) if e[:2] == ("prefill", slot_b)]
    assert [be.log[i][2] for i in pieces] == list(range(36, -1, -4))  # 40 ids, 4 per piece
    for i, j in zip(pieces, pieces[1:]):  # a decode step of a between every two pieces of b
        assert any(e[0] == "advance" and slot_a in e[1] for e in be.log[i + 1 : j]), be.log[i : j + 1]
    assert not any(e[0] == "advance" and slot_b in e[1] for e in be.log[: pieces[-1]])  # b decodes after its prompt


def test_max_tokens_and_stop_strings():
    be = Script(1)

    async def main():
        eng = Engine(be, max_queue=8)
        a = _job([1, 2, 3, 4, 5], max_tokens=3)
        b = _job([7, 8, 9, 10], stops=(" 9",))
        c = Job([10, 11, 12, 13], SamplingParams(max_tokens=100, stop_ids=frozenset({12})))  # an end-of-turn id
        for j in (a, b, c):
            eng.submit(j)
        out = await asyncio.gather(_run(a), _run(b), _run(c))
        eng.close()
        return out

    (ta, fa), (tb, fb), (tc, fc) = asyncio.run(main())
    assert tc == " 10 11" and fc.reason == "stop" and fc.completion_tokens == 2
    assert ta == " 1 2 3" and fa.reason == "length" and fa.completion_tokens == 3
    assert tb == " 7 8" and fb.reason == "stop"


def test_cancel_waiting_and_running_jobs():
    be = Script(1, delay=0.005)

    async def main():
        eng = Engine(be, max_queue=8)
        long, queued = _job(list(range(1, 400))), _job([5, 6])
        eng.submit(long)
        eng.submit(queued)
        eng.cancel(queued)  # leaves the queue at once
        tq, fq = await _run(queued)
        n = 0
        async for ev in long.events():
            n += isinstance(ev, Piece)
            if n == 3:
                eng.cancel(long)
            if isinstance(ev, Finish):
                fl = ev
        await asyncio.sleep(0.05)
        st = eng.stats()
        eng.close()
        return tq, fq, fl, st

    tq, fq, fl, st = asyncio.run(main())
    assert tq == "" and fq.reason == "cancelled" and fq.completion_tokens == 0
    assert fl.reason == "cancelled" and fl.completion_tokens < 10 and st.active == 0 and st.waiting == 0
    assert ("start", 0, 5) not in be.log


def test_queue_limit_error_and_shutdown():
    be = Script(1, delay=0.01)

    async def main():
        eng = Engine(be, max_queue=1)
        a, b, c = _job(list(range(1, 50))), _job([666, 2]), _job([3])
        eng.submit(a)
        eng.submit(b)
        with pytest.raises(QueueFull) as e:
            eng.submit(c)
        assert e.value.retry_after >= 1 and "busy" in str(e.value)
        eng.cancel(a)
        tb, fb = await _run(b)  # its first token raises: that job fails, the engine goes on
        d = _job([4, 5])
        eng.submit(d)
        td, fd = await _run(d)
        pending = _job(list(range(1, 500)))
        eng.submit(pending)
        await asyncio.sleep(0.05)
        await asyncio.to_thread(eng.close)
        tp, fp = await _run(pending)
        with pytest.raises(EngineStopped):
            eng.submit(_job([1]))
        return fb, td, fd, fp

    fb, td, fd, fp = asyncio.run(main())
    assert fb.reason == "error" and "boom" in fb.error
    assert td == " 4 5" and fd.reason == "stop"
    assert fp.reason == "error" and "shutting down" in fp.error


def test_logprob_records_ride_with_their_text():
    """Each token's record comes with the piece that shows its text: a token held back for a possible stop string
    waits for it; the tokens of text a stop string cut come with the last piece (empty text)."""
    from cflow.runtime.choice import TokenLogprob

    class Records:  # stands for the Chooser the Script backend does not call
        def take(self, token):
            return TokenLogprob(token, -float(token))

    async def main():
        eng = Engine(Script(1), max_queue=8)
        job = Job([3, 5, 7, 5, 6, 9], SamplingParams(max_tokens=100, stops=(" 5 6",), logprobs=0))
        job.chooser = Records()
        eng.submit(job)
        pieces = [ev async for ev in job.events()]
        eng.close()
        return pieces

    *pieces, fin = asyncio.run(main())
    assert [(p.text, [r.token for r in p.logprobs]) for p in pieces] == [(" 3", [3]), (" 5 7", [5, 7]), ("", [5, 6])]
    assert fin.reason == "stop" and fin.completion_tokens == 5


def test_stop_text_holds_back_partial_matches():
    st = StopText(["END", "xy"])
    assert st.push("abc E") == ("abc ", False)
    assert st.push("N") == ("", False)
    assert st.push("D and more") == ("", True)
    st = StopText(["END"])
    assert st.push("EN") == ("", False)
    assert st.push("ough") == ("ENough", False)
    assert st.push("E") == ("", False) and st.flush() == "E"
    assert StopText([]).push("E") == ("E", False)


def test_default_chat_template():
    p = default_chat_prompt([("system", "Be brief."), ("user", "Hi")])
    assert p == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
