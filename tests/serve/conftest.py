"""Servers for the serve tests: real uvicorn on 127.0.0.1 (a free port), in a thread of this process.

Models: the tiny arch2_4_combined preset (no tokenizer: prompts and answers are token ids) and the bundled
TinyStories model (text). Each server owns its own loaded copy; the reference answers come from another copy
(`m.generate`), never from the server's, which only its engine thread may run.
"""

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from ._server import make_app, serving  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph

    path = tmp_path_factory.mktemp("serve") / "tiny.vflow"
    compile_file(load_graph("preset:arch2_4_combined@tiny"), path, "q4")
    return str(path)


@pytest.fixture(scope="session")
def text_path(tmp_path_factory):
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir

    g = load_graph(default_model_dir())
    path = tmp_path_factory.mktemp("serve") / "story.vflow"
    compile_file(g, path, tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    return str(path)


# The bundled model with a chat template of its own; a turn ends with eos_token (<|endoftext|>, a special token).
CHAT_TEMPLATE = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('start with a user turn') }}{% endif %}"
                 "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


@pytest.fixture(scope="session")
def chat_path(tmp_path_factory):
    from cflow.compiler import compile_file
    from cflow.frontend.load import load_graph
    from cflow.models.bundled import default_model_dir

    g = load_graph(default_model_dir())
    g.meta.chat_template = {"template": CHAT_TEMPLATE, "bos_token": None, "eos_token": "<|endoftext|>"}
    path = tmp_path_factory.mktemp("serve") / "story_chat.vflow"
    compile_file(g, path, tokenizer=g.meta.tokenizer, eos=g.meta.eos_token_ids)
    return str(path)


@pytest.fixture(scope="session")
def ref_tiny(tiny_path):
    import cflow

    with cflow.load(tiny_path, threads=1) as m:
        yield m


@pytest.fixture(scope="session")
def ref_text(text_path):
    import cflow

    with cflow.load(text_path, threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def text_server(text_path):
    app = make_app(text_path, model_id="story")
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def tiny_server(tiny_path):
    app = make_app(tiny_path, slots=2, model_id="tiny")
    with serving(app) as url:
        yield url, app
