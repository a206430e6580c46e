"""The sampling fields beyond temperature / top_p / seed, through the official `openai` client against a running
`cflow serve`, streamed and not: logprobs (values: the model's own log-softmax, from m.logits), n choices with
per-choice seeds, penalties, logit_bias, min_p. One slot (StreamSlots, text model) and two (BatchedSlots, ids)."""

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from cflow.runtime.choice import Chooser  # noqa: E402
from cflow.serve.logprobs import TokenStrings  # noqa: E402
from cflow.serve.template import default_chat_prompt  # noqa: E402

from ._server import client  # noqa: E402

STORY = "Once upon a time"


def log_softmax(z):
    z = np.asarray(z, np.float64)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def reference(ref, ids, n, top, stop=True, **opts):
    """m.generate's tokens for `ids` and, at each, (its logprob, [(id, logprob)] of the `top` best) from m.logits."""
    out = ref.generate(list(ids), n, stop=stop, **opts)
    rows = []
    for i, t in enumerate(out):
        lsm = log_softmax(ref.logits(list(ids) + out[:i]))
        best = np.argsort(-lsm, kind="stable")[:top]
        rows.append((float(lsm[t]), [(int(j), float(lsm[j])) for j in best]))
    return out, rows


# --- logprobs -------------------------------------------------------------------------------------------------
def test_completion_logprobs(text_server, ref_text):
    url, _ = text_server
    c, strings = client(url), TokenStrings(ref_text.tokenizer)
    ids = ref_text.tokenizer.encode(STORY)
    out, want = reference(ref_text, ids, 12, 3, temperature=0.9, seed=21)
    r = c.completions.create(model="story", prompt=STORY, max_tokens=12, temperature=0.9, seed=21, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [strings(t)[0] for t in out] and "".join(lp.tokens) == r.choices[0].text
    np.testing.assert_allclose(lp.token_logprobs, [w[0] for w in want], atol=1e-5)
    for d, t, (chosen, best) in zip(lp.top_logprobs, out, want):
        expect = {strings(j)[0]: v for j, v in best}
        expect.setdefault(strings(t)[0], chosen)  # the chosen token is always listed (N + 1 when not in the N)
        assert list(d) == list(expect)
        np.testing.assert_allclose(list(d.values()), list(expect.values()), atol=1e-5)
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # streamed: the chunks' entries, in order, are the same; each chunk's text is its tokens' text
    chunks = list(c.completions.create(model="story", prompt=STORY, max_tokens=12, temperature=0.9, seed=21,
                                       logprobs=3, stream=True))
    got = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((g.tokens for g in got), []) == lp.tokens
    assert sum((g.text_offset for g in got), []) == lp.text_offset
    np.testing.assert_allclose(sum((g.token_logprobs for g in got), []), lp.token_logprobs, atol=1e-9)
    assert all("".join(ch.choices[0].logprobs.tokens) == ch.choices[0].text for ch in chunks
               if ch.choices and ch.choices[0].logprobs)
    r0 = c.completions.create(model="story", prompt=STORY, max_tokens=3, temperature=0, logprobs=0)
    assert [len(d) for d in r0.choices[0].logprobs.top_logprobs] == [1, 1, 1]  # just the chosen token
    assert c.completions.create(model="story", prompt=STORY, max_tokens=3).choices[0].logprobs is None


def test_chat_logprobs(text_server, ref_text):
    url, _ = text_server
    c, strings = client(url), TokenStrings(ref_text.tokenizer)
    messages = [{"role": "user", "content": "Tell me about a cat."}]
    ids = ref_text.tokenizer.encode(default_chat_prompt([(m["role"], m["content"]) for m in messages]))
    out, want = reference(ref_text, ids, 10, 2, temperature=0.7, seed=4)
    kw = dict(model="story", messages=messages, max_tokens=10, temperature=0.7, seed=4, logprobs=True,
              top_logprobs=2)
    r = c.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(out)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e, t, (chosen, best) in zip(content, out, want):
        assert e.token == strings(t)[0] and e.bytes == list(e.token.encode()) and abs(e.logprob - chosen) < 1e-5
        assert [x.token for x in e.top_logprobs] == [strings(j)[0] for j, _ in best]
        np.testing.assert_allclose([x.logprob for x in e.top_logprobs], [v for _, v in best], atol=1e-5)
    chunks = list(c.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    for ch in chunks:  # the text a chunk shows is that of the tokens it carries
        if ch.choices and ch.choices[0].logprobs:
            assert "".join(e.token for e in ch.choices[0].logprobs.content) == ch.choices[0].delta.content
    assert c.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None


def test_token_strings_of_partial_characters(ref_text):
    """A byte-level token that holds part of a UTF-8 character: its bytes escaped, `bytes` the bytes themselves
    (OpenAI's convention); a special token by its name."""
    s = TokenStrings(ref_text.tokenizer)
    ids = ref_text.tokenizer.encode("café ☃", add_special=False)
    raw = b"".join(bytes(s(i)[1]) for i in ids)
    assert raw == "café ☃".encode()  # the tokens' bytes make the text's bytes
    partial = [i for i in ids if "\\x" in s(i)[0]]
    assert partial, "the snowman is split into bytes here"
    for i in partial:
        text, b = s(i)
        assert text == bytes(b).decode("utf-8", "backslashreplace")
    assert s(0)[0] == "<|endoftext|>"


# --- n choices --------------------------------------------------------------------------------------------------
def test_n_choices_text(text_server, ref_text):
    url, _ = text_server
    c = client(url)
    ids = ref_text.tokenizer.encode(STORY)
    want_ids = [ref_text.generate(ids, 14, temperature=1.0, seed=s) for s in (7, 8)]  # choice i: seed + i
    want = [ref_text.tokenizer.decode(w) for w in want_ids]
    r = c.completions.create(model="story", prompt=STORY, max_tokens=14, temperature=1.0, seed=7, n=2)
    assert [ch.index for ch in r.choices] == [0, 1] and [ch.text for ch in r.choices] == want
    assert r.usage.prompt_tokens == len(ids)  # the prompt once, the completions summed
    assert r.usage.completion_tokens == sum(len(w) for w in want_ids)
    chunks = list(c.completions.create(model="story", prompt=STORY, max_tokens=14, temperature=1.0, seed=7, n=2,
                                       stream=True, stream_options={"include_usage": True}))
    for i in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(x.text for x in mine) == want[i] and mine[-1].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat = c.chat.completions.create(model="story", messages=messages, max_tokens=10, temperature=0.9, seed=3, n=3)
    again = list(c.chat.completions.create(model="story", messages=messages, max_tokens=10, temperature=0.9, seed=3,
                                           n=3, stream=True))
    for i in range(3):
        mine = [ch.choices[0] for ch in again if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason in ("stop", "length")
        assert "".join(x.delta.content or "" for x in mine) == chat.choices[i].message.content  # reproducible
    assert len({ch.message.content for ch in chat.choices}) > 1  # the choices differ


def test_n_choices_batched_with_logprobs(tiny_server, ref_tiny):
    """Two choices in the two batched slots, each with logprobs: choice i is m.generate with seed + i."""
    url, _ = tiny_server
    prompt = [3, 1, 4, 1, 5]
    r = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.1, seed=40, n=2,
                                       logprobs=2)
    for i, ch in enumerate(r.choices):
        out, want = reference(ref_tiny, prompt, 8, 2, stop=False, temperature=1.1, seed=40 + i)
        assert ch.text == "".join(f" {t}" for t in out) and ch.logprobs.tokens == [f" {t}" for t in out]
        np.testing.assert_allclose(ch.logprobs.token_logprobs, [w[0] for w in want], atol=1e-5)
        for d, (_, best) in zip(ch.logprobs.top_logprobs, want):
            assert list(d)[:2] == [f" {j}" for j, _ in best]


# --- penalties, logit_bias, min_p -------------------------------------------------------------------------------
def test_rules_are_the_libraries(tiny_server, ref_tiny):
    """Every rule through the server (batched slots) gives the tokens the library's Chooser gives."""
    url, _ = tiny_server
    c = client(url)
    prompt = [1, 2, 3]
    cases = [
        (dict(temperature=0), dict(presence_penalty=2.0, frequency_penalty=2.0)),
        (dict(temperature=0), dict(repetition_penalty=3.0, repeat_last_n=8)),
        (dict(temperature=0.8, seed=5), dict(min_p=0.9)),
        (dict(temperature=1.2, seed=6), dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.5,
                                             min_p=0.05, logit_bias={"9": 1.5, "200": -100})),
    ]
    for base, rules in cases:
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=24, **base, extra_body=rules)
        kw = {"repetition_window" if k == "repeat_last_n" else k: v for k, v in rules.items()}
        if "logit_bias" in kw:
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
        want = ref_tiny.generate(prompt, 24, stop=False, sampler=Chooser(**base, prompt_ids=prompt, **kw))
        assert r.choices[0].text == "".join(f" {t}" for t in want), (base, rules)
    plain = ref_tiny.generate(prompt, 30, stop=False)
    assert len(set(plain)) < 30  # greedy repeats itself here ...
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, presence_penalty=2.0,
                             frequency_penalty=2.0)
    assert len(set(r.choices[0].text.split())) == 30  # ... strong penalties do not
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logit_bias={"17": 100})
    assert r.choices[0].text == " 17" * 6


def test_rules_streamed_one_slot(text_server, ref_text):
    """StreamSlots (m.stream with the job's Chooser), streamed: the library's tokens."""
    url, _ = text_server
    ids = ref_text.tokenizer.encode(STORY)
    rules = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3, min_p=0.1,
                 logit_bias={"13": -100})
    chunks = list(client(url).completions.create(model="story", prompt=STORY, max_tokens=20, temperature=0.9,
                                                 seed=12, stream=True, extra_body=rules))
    kw = {**rules, "logit_bias": {13: -100}}
    want = ref_text.generate(STORY, 20, temperature=0.9, sampler=Chooser(0.9, seed=12, prompt_ids=ids, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


def test_out_of_range_fields_are_400(tiny_server):
    url, _ = tiny_server
    c = client(url)
    bad = [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
           ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"), ({"n": 0}, "n"),
           ({"n": 17}, "n"), ({"logprobs": 21}, "logprobs"), ({"logit_bias": {"x": 1}}, "logit_bias"),
           ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logit_bias": {"256": 1}}, "logit_bias"),
           ({"repeat_last_n": -2}, "repeat_last_n")]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="tiny", prompt=[1], max_tokens=2, extra_body=body)
        assert e.value.param == param, body
    messages = [{"role": "user", "content": "x"}]
    for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                                                "top_logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=messages, extra_body=body)
        assert e.value.param == param, json.dumps(body)
