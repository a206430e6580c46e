"""What the HTTP side writes per token: a text-only chunk made from a template is byte for byte the chunk `sse`
writes, and events the engine thread makes while the loop is busy reach the reader together, in order."""

import asyncio
import json
import threading
import time

import pytest

from cflow.serve.app import TextEvents, sse
from cflow.serve.job import Finish, Job, Piece, SamplingParams
from cflow.serve.protocol import ChatChunkChoice, ChatCompletionChunk, CompletionChoice, CompletionResponse, Delta

TEXTS = [" the", "", "\"quoted\" \\ back", "line\nbreak\ttab", "é ü 中文 🙂", "\x00\x1f", "</s>", " " * 40]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_text_event_is_the_chunk_sse_writes(kind):
    def chunk(i, text):
        if kind == "completion":
            return sse(CompletionResponse(id="cmpl-1", created=7, model="m é", choices=[
                CompletionChoice(index=i, text=text)]))
        return sse(ChatCompletionChunk(id="chatcmpl-1", created=7, model="m é", choices=[
            ChatChunkChoice(index=i, delta=Delta(content=text))]))

    events = TextEvents(chunk)
    for i in (0, 1, 3):
        for text in TEXTS + [TextEvents.MARK]:
            assert events(i, text) == chunk(i, text)
            assert json.loads(events(i, text).removeprefix("data: "))["choices"][0]["index"] == i


def test_events_made_while_the_loop_is_busy_arrive_together():
    async def main():
        job = Job([1, 2], SamplingParams(max_tokens=50))
        sent = [Piece(f"t{k}") for k in range(50)] + [Finish("length", 2, 50)]
        made = threading.Event()

        def engine():
            for ev in sent:
                job._emit(ev)
            made.set()

        threading.Thread(target=engine).start()
        made.wait()  # the loop is blocked meanwhile: every event waits for it
        batches = [b async for b in job.batches()]
        assert [ev for b in batches for ev in b] == sent
        assert len(batches) == 1
        # the loop keeping up: one event a batch
        job = Job([1], SamplingParams(max_tokens=3))
        batches = aiter(job.batches())
        for ev in sent[:3] + [Finish("length", 1, 3)]:
            job._emit(ev)
            assert await anext(batches) == [ev]

    asyncio.run(main())


def test_timings_of_a_job_whose_first_token_ended_it():
    async def main():
        job = Job([1, 2, 3], SamplingParams(max_tokens=5))
        assert job.timings() is None  # never admitted (cancelled while waiting)
        job.started_at, job.cache_n = time.monotonic() - 0.002, 1
        t = job.timings()
        assert t["prompt_n"] == 2 and t["cache_n"] == 1 and t["prompt_ms"] >= 2.0
        assert t["predicted_n"] == 0 and t["predicted_ms"] == 0 and t["predicted_per_second"] == 0
        job.first_token_at = job.last_token_at = job.started_at + 0.001
        job.steps, job.completion_tokens = 1, 1
        t = job.timings()
        assert t["prompt_ms"] == pytest.approx(1.0) and t["predicted_per_token_ms"] == 0
        job.last_token_at, job.steps, job.completion_tokens = job.first_token_at + 0.004, 5, 5
        t = job.timings()  # four intervals between five tokens
        assert t["predicted_ms"] == pytest.approx(4.0) and t["predicted_per_token_ms"] == pytest.approx(1.0)
        assert t["predicted_per_second"] == pytest.approx(1000.0, rel=1e-3)

    asyncio.run(main())
