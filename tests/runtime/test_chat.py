"""Chat templates (runtime/chat.py), CompiledModel.chat / stream_chat / chat_prompt, `cflow run --chat / -f /
--prompt -`: rendering as transformers renders, end-of-turn stops, the KV cache kept between turns, templates
that raise, loop or blow up refused by name. Tokenizers and templates are built here (no downloads)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from cflow.errors import CflowError
from cflow.frontend.hf_weights import read_chat_template
from cflow.runtime import chat as chat_mod
from cflow.runtime.chat import ChatTemplate, ChatTemplateError

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Uses what real templates use: whitespace control, namespace, loop.first/last, raise_exception, tojson, bos_token.
RICH = """{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% set ns.system = m['content'] %}{% continue %}{% endif %}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == (1 if ns.system else 0)) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if loop.first and ns.system %}{{ '[SYS]' + ns.system + '[/SYS]' }}{% endif %}
    {{- '<|' + m['role'] + '|>\\n' + m['content'] | trim + eos_token }}
{%- endfor %}
{%- if tools %}{{ '<|tools|>' + tools | tojson }}{% endif %}
{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Héllo  "},
            {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Bye"}]


def _words():
    return ["<|im_end|>", "<|im_start|>", "</s>", "<unk>", "user", "assistant", "system", "hi", "hello", "there"] + \
        [f"w{i}" for i in range(54)]


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_words())}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(["<|im_end|>", "<|im_start|>", "</s>"])
    return tk.to_str()


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    """A tiny f32 Llama with a word-level tokenizer (id 0 is <|im_end|>) and a ChatML template."""
    from cflow.compiler import compile_file
    from cflow.ir import build_graph
    from cflow.ir.build import weight_shapes
    from cflow.ir.config import ModelConfig

    c = ModelConfig(name="chatty", vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                    max_seq_len=96)
    rng = np.random.default_rng(0)
    w = {n: ((1 + 0.1 * rng.standard_normal(s)) if len(s) == 1 else
             rng.standard_normal(s) * (1.0 if n == "tok_embeddings" else s[-1] ** -0.5)).astype(np.float32)
         for n, s in weight_shapes(c).items()}
    g = build_graph(c, w, name="chatty")
    g.meta.chat_template = {"template": CHATML, "bos_token": None, "eos_token": "</s>"}
    path = tmp_path_factory.mktemp("chat") / "m.vflow"
    compile_file(g, path, "f32", tokenizer=_tokenizer_json(), eos=[2])
    w["norm"] = np.zeros_like(w["norm"])  # every logit 0: greedy picks id 0, <|im_end|>
    g0 = build_graph(c, w, name="silent")
    g0.meta.chat_template = g.meta.chat_template
    compile_file(g0, path.with_name("silent.vflow"), "f32", tokenizer=_tokenizer_json(), eos=[2])
    return path


# --- rendering ---------------------------------------------------------------------------------
@pytest.mark.parametrize("template, tools", [(CHATML, None), (RICH, None), (RICH, [{"name": "f", "x": "é"}])])
def test_rendering_matches_transformers(template, tools):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()), bos_token="<s>",
                                 eos_token="</s>", chat_template=template)
    ours = ChatTemplate({"template": template, "bos_token": "<s>", "eos_token": "</s>"}, name="t")
    msgs = MESSAGES if template is RICH else MESSAGES[1:]
    for gen in (True, False):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, tools=tools)
        assert ours.render(msgs, add_generation_prompt=gen, tools=tools) == want


def test_template_errors_name_the_template(monkeypatch):
    t = ChatTemplate({"template": RICH, "eos_token": "</s>"}, name="mymodel")
    with pytest.raises(ChatTemplateError, match="chat template of mymodel raised: Conversation roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="chat template of bad: syntax error at line 1"):
        ChatTemplate("{% for m in messages %}", name="bad")
    monkeypatch.setattr(chat_mod, "RENDER_SECONDS", 0.3)
    loops = ["{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
             "{% set s = 'x' * 3000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}"
             "{% endfor %}",
             "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"]
    for src in loops:
        with pytest.raises(ChatTemplateError, match="chat template of looping: (did not finish|recursion)"):
            ChatTemplate(src, name="looping").render([])
    for src in ["{{ 'x' * 10 ** 10 }}", "{{ 7 ** 100000000 }}", "{{ ('x' * 4000000) + ('y' * 4000000) }}"]:
        with pytest.raises(ChatTemplateError, match="too large"):
            ChatTemplate(src, name="big").render([])
    for src in ["{{ messages.__class__ }}{{ ''.__class__.__mro__[1].__subclasses__() }}",
                "{% set _ = messages.append(1) %}"]:  # the sandbox: no dunder access, no mutation
        with pytest.raises(ChatTemplateError, match="chat template of evil failed"):
            ChatTemplate(src, name="evil").render([{"role": "user", "content": "x"}])
    with pytest.raises(CflowError, match="messages"):
        t.render("hello")


def test_chat_template_from_a_directory(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}],
         "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}))
    assert read_chat_template(tmp_path) == {"template": CHATML, "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers >= 4.43 saves it here: it wins
    assert read_chat_template(tmp_path)["template"] == "J"


def test_hf_directory_template_reaches_the_compiled_file(tmp_path):
    from cflow.compiler import compile_file
    from cflow.frontend.hf import from_hf_dir
    from cflow.runtime.format import FileReader
    from tests.frontend._models import hf_model

    hf_model("llama").save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "tokenizer.json").write_text(_tokenizer_json())
    (tmp_path / "d" / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "</s>"}))
    g = from_hf_dir(tmp_path / "d")
    assert g.meta.chat_template["template"] == CHATML
    compile_file(g, tmp_path / "m.vflow", "q8")
    assert FileReader(str(tmp_path / "m.vflow")).header["chat_template"] == g.meta.chat_template


# --- the API -----------------------------------------------------------------------------------
def test_chat_reuses_the_kv_cache_and_equals_a_fresh_prompt(chat_file):
    import cflow

    with cflow.load(chat_file, threads=1) as m:
        msgs = [{"role": "user", "content": "hi there"}]
        prompt = m.chat_prompt(msgs)
        assert prompt == "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
        first = m.chat(msgs, max_new_tokens=6, stop=False)
        assert m.reused_tokens == 0 and first.strip()
        msgs2 = msgs + [{"role": "assistant", "content": first}, {"role": "user", "content": "hello"}]
        second = "".join(m.stream_chat(msgs2, max_new_tokens=6, stop=False))
        assert m.reused_tokens >= len(m.tokenizer.encode(prompt))  # only the new turn was fed
        fresh = m.generate(m.chat_prompt(msgs2), max_new_tokens=6, stop=False)  # generate starts from scratch
        assert second == fresh


def test_chat_stops_at_the_templates_end_of_turn(chat_file):
    import cflow

    with cflow.load(chat_file.with_name("silent.vflow"), threads=1) as m:
        assert m.chat_template.end_of_turn_ids(m.tokenizer) == {0} and 0 not in m.eos_ids
        assert m.chat([{"role": "user", "content": "hi"}]) == ""  # <|im_end|> first: the turn is over
        assert m.generate([4, 7], max_new_tokens=3) == [0, 0, 0]  # plain generation does not stop there


def test_models_without_a_template_chat_in_the_default_format(chat_file):
    """One chat behaviour everywhere: a file without a template chats in cflow's ChatML default (m.chat here,
    the server in tests/serve/test_server.py), and its answer ends at the default's stop strings, unseen."""
    import cflow
    from cflow.runtime.chat import DEFAULT_STOPS

    with cflow.load(chat_file, threads=1) as m:
        m.session.header = {**m.session.header, "chat_template": None}  # as a file compiled without one
        assert m.chat_template.is_default and m.chat_template.stops == DEFAULT_STOPS
        msgs = [{"role": "user", "content": "hi"}]
        assert m.chat_prompt(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        eot, _ = m.chat_stops()
        assert eot == {0}  # this tokenizer knows <|im_end|> as a special token: it ends the turn as a token
        said = []
        for text in ("hi", "hi there", "w1 w2 w3", "hello hi"):
            msgs = [{"role": "user", "content": text}]
            ids = m.generate(m.tokenizer.encode(m.chat_prompt(msgs)), max_new_tokens=24, stop=False)
            ids = ids[: min([i for i, t in enumerate(ids) if t in eot | m.eos_ids], default=len(ids))]
            free = m.tokenizer.decode(ids)
            cut = min([i for s in DEFAULT_STOPS if (i := free.find(s)) >= 0], default=len(free))
            said.append(m.chat(msgs, max_new_tokens=24))
            assert said[-1].lstrip() == free[:cut]  # (the stream decoder keeps the word-level space)
        assert any(said)
        m.tokenizer = None
        with pytest.raises(CflowError, match="has no tokenizer"):
            m.chat(msgs)


def test_stop_strings_cut_a_chat_reply(chat_file):
    import cflow

    with cflow.load(chat_file, threads=1) as m:
        m.session.header = {**m.session.header, "chat_template": None}
        m._chat = None
        msgs = [{"role": "user", "content": "hi there"}]
        free = m.generate(m.chat_prompt(msgs), max_new_tokens=12, stop=False)
        m.chat_template.stops = (free[3:6],)  # a stop string in the middle of the free reply
        assert m.chat(msgs, max_new_tokens=12, stop=False) == free  # stop=False: no stops at all
        assert m.chat(msgs, max_new_tokens=12) == free[: free.find(free[3:6])]


# --- the command line ----------------------------------------------------------------------------
def test_cflow_run_chat_loop(chat_file, monkeypatch, capsys):
    from cflow.cli import cflow_main

    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n\nhello\n/exit\nnever read\n"))
    assert cflow_main(["run", str(chat_file), "--chat", "--threads", "1", "-n", "4", "--no-stop",
                       "--system", "w1 w2"]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and all(line.strip() for line in out.splitlines())
    stats = [line for line in err.splitlines() if "prompt tokens reused" in line]
    assert len(stats) == 2 and stats[0].startswith("[0 ")
    assert int(stats[1].split()[0].lstrip("[")) > 0  # the second turn reused the first from the KV cache


def test_cflow_run_prompt_from_stdin_and_file(chat_file, monkeypatch, capsys, tmp_path):
    from cflow.cli import cflow_main

    monkeypatch.setattr("sys.stdin", io.StringIO("hi there\n"))
    assert cflow_main(["run", str(chat_file), "--prompt", "-", "-n", "3", "--threads", "1", "--no-stop"]) == 0
    a = capsys.readouterr().out
    (tmp_path / "p.txt").write_text("hi there\n")
    assert cflow_main(["run", str(chat_file), "-f", str(tmp_path / "p.txt"), "-n", "3", "--threads", "1",
                       "--no-stop"]) == 0
    b = capsys.readouterr().out
    assert a == b and a.startswith("hi there")
    assert cflow_main(["run", str(chat_file), "-f", str(tmp_path / "nope.txt")]) == 1
    assert "error: -f" in capsys.readouterr().err
    assert cflow_main(["run", str(chat_file), "--system", "x"]) == 1
    assert "--system needs --chat" in capsys.readouterr().err
