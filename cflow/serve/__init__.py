"""`cflow serve`: an OpenAI-compatible HTTP server in front of one engine thread (docs/serving.md).

    protocol.py   OpenAI request/response models (pydantic), error JSON
    engine.py     the engine thread: bounded queue, slots, scheduling loop at token boundaries
    app.py        the FastAPI app (completions, chat, models, health, metrics; SSE streaming)
    metrics.py    prometheus-client metrics of one engine
    template.py   chat messages -> prompt (the model's template, else a ChatML-like default)

Needs the `serve` extra (fastapi, uvicorn, pydantic, prometheus-client): `pip install -e ".[serve]"`.
"""

from .engine import Engine, QueueFull, SamplingParams, StreamSlots, load_backend  # noqa: F401
