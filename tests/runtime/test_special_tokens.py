"""BOS / EOS from every source, applied the same way on every path a prompt takes.

Sources: a GGUF's tokenizer.ggml.add_bos_token (and llama.cpp's defaults when it is absent: a SentencePiece
vocabulary adds BOS, a BPE one only after some pre-tokenisers), a Hugging Face directory's tokenizer.json
post-processor and its tokenizer_config.json (which wins), the bundled model (trained with <|endoftext|> before
every story). Paths: Tokenizer.encode, generate / stream / chat, `cflow run`, the server, each feeding the same ids
to the session; a chat template that writes the BOS text itself never gets a second one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import cflow
from cflow.frontend.gguf import from_gguf
from cflow.frontend.hf_weights import read_special_tokens, specials_from_post_processor
from cflow.ir import build_graph
from cflow.ir.build import weight_shapes
from cflow.ir.config import ModelConfig
from cflow.models.bundled import default_model_dir
from tests.frontend._gguf import write_gguf

gguf = pytest.importorskip("gguf")

TINY = ModelConfig(name="tiny", vocab_size=300, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64,
                   max_seq_len=64)


def _graph(c=TINY):
    rng = np.random.default_rng(0)
    w = {n: (0.1 * rng.standard_normal(s) + (1.0 if len(s) == 1 else 0)).astype(np.float32)
         for n, s in weight_shapes(c).items()}
    return build_graph(c, w, name=c.name)


def _spm(tmp_path, metadata=None, name="s.gguf", template=None):
    TT = gguf.TokenType
    pieces = ["\u2581", "a", "b", "\u2581a", "\u2581b", "ab"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    tokens += [f"[PAD{i}]" for i in range(TINY.vocab_size - len(tokens))]
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256 + [TT.NORMAL] * len(pieces)
    types += [TT.UNUSED] * (TINY.vocab_size - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    path = tmp_path / name
    write_gguf(_graph(), path, "llama", tokenizer=("llama", tokens, scores, [int(t) for t in types], None),
               metadata=metadata, chat_template=template)
    return path


def _bpe(tmp_path, pre, metadata=None):
    TT = gguf.TokenType
    tokens = [chr(0x100 + i) if i < 250 else f"<|t{i}|>" for i in range(TINY.vocab_size)]
    types = [int(TT.NORMAL)] * 250 + [int(TT.CONTROL)] * (TINY.vocab_size - 250)
    path = tmp_path / f"b-{pre}.gguf"
    write_gguf(_graph(), path, "llama", tokenizer=("gpt2", tokens, None, types, []), pre=pre, metadata=metadata)
    return path


@pytest.mark.parametrize("flag, want", [(None, True), (True, True), (False, False)])
def test_gguf_sentencepiece_adds_bos_unless_the_file_says_not(tmp_path, flag, want):
    meta = {} if flag is None else {"add_add_bos_token": flag}
    sp = from_gguf(_spm(tmp_path, meta)).meta.special_tokens
    assert sp["bos"] == 1 and sp["add_bos"] is want and sp["add_eos"] is False
    assert ("tokenizer.ggml.add_bos_token" in sp["source"]) == (flag is not None)


@pytest.mark.parametrize("pre, flag, want", [("gpt-2", None, False), ("llama-bpe", None, True),
                                             ("gpt-2", True, True), ("llama-bpe", False, False),
                                             ("smollm", None, False)])
def test_gguf_bpe_follows_llama_cpp_defaults_then_the_file(tmp_path, pre, flag, want):
    meta = {} if flag is None else {"add_add_bos_token": flag}
    sp = from_gguf(_bpe(tmp_path, pre, meta)).meta.special_tokens
    assert sp["add_bos"] is want and sp["bos"] == 1  # write_gguf names bos id 1


def test_compiled_gguf_prompts_carry_one_bos_on_every_path(tmp_path):
    """generate / stream / logits of text, and a chat whose template writes the BOS text itself: the session
    receives exactly one BOS in front, and add_special=False leaves it out."""
    path = _spm(tmp_path, template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    m = cflow.compile(str(path), quant="f32")
    seen = []
    real = m.session.prefill

    def spy(ids, *a, **k):
        seen.append(list(ids))
        return real(ids, *a, **k)

    m.session.prefill = spy
    assert m.tokenizer.encode("a b") == [1] + m.tokenizer.encode("a b", add_special=False)
    assert m.tokenizer.encode("<s>a b")[:2] != [1, 1]
    m.generate("a b", max_new_tokens=2)
    assert seen[-1][:2] == [1, m.tokenizer.encode("a b", add_special=False)[0]]
    list(m.stream("a b", max_new_tokens=2))
    assert seen[-1][0] == 1 and seen[-1][1] != 1
    m.chat([{"role": "user", "content": "a b"}], max_new_tokens=2)
    ctx = m._ctx  # the tokens the KV cache holds (a chat may reuse the earlier prompt's): one BOS, the template's
    assert ctx[0] == 1 and ctx[1] != 1
    m.close()


def test_hf_post_processor_and_tokenizer_config(tmp_path):
    from tokenizers import Tokenizer, models, processors

    tk = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    text = tk.to_str()
    sp = specials_from_post_processor(text)
    assert sp["bos"] == 0 and sp["add_bos"] and not sp["add_eos"]
    assert read_special_tokens(tmp_path, text)["add_bos"]  # no tokenizer_config.json: the post-processor
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "bos_token": "<s>"}))
    assert read_special_tokens(tmp_path, text)["add_bos"] is False  # tokenizer_config.json wins
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": True,
                                                                "bos_token": "<s>", "eos_token": "</s>"}))
    sp = read_special_tokens(tmp_path, text)
    assert (sp["bos"], sp["eos"], sp["add_bos"], sp["add_eos"]) == (0, 1, True, True)
    tk.post_processor = None
    assert specials_from_post_processor(tk.to_str()) is None


def test_bundled_model_prompts_start_with_endoftext(tmp_path):
    """The bundled model saw <|endoftext|> (id 0) before every story in training: its prompts start with it, as
    the reference generator (models.train.generate_text) feeds them; cflow run takes the same path."""
    m = cflow.compile(str(default_model_dir()), quant="f32")
    assert m.session.header["special_tokens"]["add_bos"] and m.tokenizer.bos_id == 0
    ids = m.tokenizer.encode("Once upon a time")
    assert ids[0] == 0 and ids[1:] == m.tokenizer.encode("Once upon a time", add_special=False)
    m.close()


@pytest.mark.parametrize("value, needle", [({"bos": 10**9, "add_bos": True}, "bos"), ({"add_bos": "yes"}, "add_bos"),
                                           ([1], "special_tokens"), ({"bos": 1, "extra": 2}, "special_tokens")])
def test_header_refuses_a_bad_special_tokens_entry(tmp_path, value, needle):
    from .test_header_validation import craft, field, refused

    path = tmp_path / "m.vflow"
    cflow.compile(str(default_model_dir()), quant="q8").save(path)
    refused(craft(path.read_bytes(), tmp_path, field(None, "special_tokens", value)), "special_tokens", needle)


def test_server_completions_and_chat_prompts_carry_one_bos(tmp_path):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from tests.serve._server import make_app

    path = _spm(tmp_path, template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    out = tmp_path / "m.vflow"
    m = cflow.compile(str(path), quant="f32")
    m.save(out)
    want = len(m.tokenizer.encode("a b"))
    assert want == len(m.tokenizer.encode("a b", add_special=False)) + 1
    m.close()
    with TestClient(make_app(str(out))) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == want
        r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "a b"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == want  # <s> from the template, none added: one BOS
