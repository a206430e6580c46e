"""`cflow serve`: an OpenAI-compatible HTTP server in front of one engine thread (docs/serving.md).

    protocol.py   OpenAI request/response models (pydantic), error JSON
    job.py        one request in the engine: sampling parameters, events, detokenizer, stop strings
    backends.py   who runs the model for the slots: BatchedSlots (one batched model), StreamSlots (stream per slot)
    engine.py     the engine thread: bounded queue, slots, scheduling loop at token boundaries
    app.py        the FastAPI app (completions, chat, models, health, metrics; SSE streaming)
    metrics.py    prometheus-client metrics of one engine
    template.py   chat messages -> prompt (the model's template, else a ChatML-like default)

Needs the `serve` extra (fastapi, uvicorn, pydantic, prometheus-client): `pip install -e ".[serve]"`.
"""

from .backends import StreamSlots, load_backend  # noqa: F401
from .engine import Engine, QueueFull  # noqa: F401
from .job import SamplingParams  # noqa: F401
