"""The bundled default model loads, compiles and generates English-looking text."""

import cflow
from cflow.models.bundled import default_model_dir


def test_bundled_model_compiles_and_tells_a_story():
    m = cflow.compile(default_model_dir(), threads=2)
    text = m.generate("Once upon a time", max_new_tokens=40)
    assert m.tokenizer is not None and len(text.split()) >= 10
    assert sum(c.isalpha() or c.isspace() or c in ".,!?'\"" for c in text) / len(text) > 0.9
    m.close()
