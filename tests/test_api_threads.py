"""CompiledModel from several threads: generations are serialised (never interleaved on the one KV cache), a
second generation in the thread whose stream is still open is refused, and close() never pulls buffers from
under a running generation."""

import threading

import pytest

import cflow
from cflow.errors import CflowError


@pytest.fixture(scope="module")
def model():
    m = cflow.compile("preset:arch2_4_combined@tiny", quant="q8", threads=2)
    yield m
    m.close()


PROMPTS = [[1, 2, 3], [9, 8], [100, 5, 5, 7], [42]]


def test_two_threads_share_one_model(model):
    want = {i: model.generate(p, max_new_tokens=12, stop=False) for i, p in enumerate(PROMPTS)}
    sampled = model.generate([3, 4], max_new_tokens=8, temperature=0.9, seed=5, stop=False)
    got: dict[tuple[int, int], list] = {}
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for r in range(6):
                i = (t + r) % len(PROMPTS)
                if r % 3 == 2:  # a stream consumed token by token, interleaved with the other thread's calls
                    got[(t, r)] = ("s", list(model.stream([3, 4], 8, temperature=0.9, seed=5, stop=False)))
                else:
                    got[(t, r)] = (i, model.generate(PROMPTS[i], max_new_tokens=12, stop=False))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 12
    for key, out in got.values():
        assert out == (sampled if key == "s" else want[key])


def test_a_second_stream_in_the_same_thread_is_refused(model):
    first = model.stream([1, 2, 3], max_new_tokens=6, stop=False)
    a = [next(first)]
    second = model.stream([9, 9], max_new_tokens=3, stop=False)  # arguments checked, nothing run yet
    with pytest.raises(CflowError, match="already generating in this thread"):
        next(second)
    a += list(first)  # the first stream is intact
    assert a == model.generate([1, 2, 3], max_new_tokens=6, stop=False)
    first.close()
    assert model.generate([9, 9], max_new_tokens=3, stop=False)  # and the model is free again


def test_abandoned_stream_frees_the_model(model):
    s = model.stream([1, 2], max_new_tokens=10, stop=False)
    next(s)
    del s  # dropping it closes it
    assert len(model.generate([1, 2], max_new_tokens=4, stop=False)) == 4


def test_close_waits_for_another_threads_generation(tmp_path):
    m = cflow.compile("preset:arch1@tiny", quant="q4", threads=1)
    started, release = threading.Event(), threading.Event()
    out: list = []

    def slow_consumer():
        for tok in m.stream([1, 2], max_new_tokens=5, stop=False):
            out.append(tok)
            started.set()
            release.wait()

    t = threading.Thread(target=slow_consumer)
    t.start()
    started.wait()
    closer = threading.Thread(target=m.close)
    closer.start()
    closer.join(timeout=0.5)
    assert closer.is_alive()  # close() waits for the running stream ...
    release.set()
    t.join()
    closer.join()
    assert len(out) == 5  # ... which finished undisturbed
    with pytest.raises(CflowError, match="closed"):
        m.generate([1, 2], 2)


def test_closing_under_ones_own_stream_fails_cleanly():
    m = cflow.compile("preset:arch1@tiny", quant="q4", threads=2)
    s = m.stream([1, 2], max_new_tokens=5, stop=False)
    next(s)
    m.close()
    with pytest.raises(CflowError, match="closed during this stream"):
        next(s)
