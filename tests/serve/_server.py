"""Helpers of the serve tests: a uvicorn server in a thread, a slowed backend, an OpenAI client."""

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    t.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(15)
        sock.close()


class SlowSlots:
    """A backend that sleeps before every step (and, with prefill_delay, before every prefill piece): long enough
    generations to cancel, fill the queue, ...; it logs its calls (start / prefill / advance / stop)."""

    def __init__(self, inner, delay: float, prefill_delay: float = 0.0):
        self.inner, self.delay, self.prefill_delay, self.slots = inner, delay, prefill_delay, inner.slots
        self.log: list[tuple] = []

    @property
    def model(self):
        return self.inner.model

    def start(self, slot, job):
        self.log.append(("start", slot, tuple(job.prompt_ids)))
        return self.inner.start(slot, job)

    def prefill(self, slot):
        time.sleep(self.prefill_delay)
        left = self.inner.prefill(slot)
        self.log.append(("prefill", slot, left))
        return left

    def advance(self, slots):
        time.sleep(self.delay)
        self.log.append(("advance", tuple(slots)))
        return self.inner.advance(slots)

    def stop(self, slot):
        self.log.append(("stop", slot))
        self.inner.stop(slot)

    def close(self):
        self.inner.close()


def make_app(path, *, slots=1, max_queue=64, api_key=None, delay=None, prefill_delay=0.0, model_id="m",
             instance=None, **load_kwargs):
    from cflow.serve.app import create_app
    from cflow.serve.backends import load_backend
    from cflow.serve.engine import Engine
    from cflow.serve.metrics import ServeMetrics

    backend = load_backend(path, threads=1, slots=slots, **load_kwargs)
    if delay or prefill_delay:
        backend = SlowSlots(backend, delay or 0.0, prefill_delay)
    metrics = ServeMetrics()
    engine = Engine(backend, max_queue=max_queue, metrics=metrics)
    return create_app(engine, backend.model, model_id, api_key=api_key, metrics=metrics, instance=instance,
                      owns_engine=True)


def client(url, **kw):
    import openai

    kw.setdefault("api_key", "none")
    kw.setdefault("max_retries", 0)
    kw.setdefault("timeout", 30)
    return openai.OpenAI(base_url=url + "/v1", **kw)
