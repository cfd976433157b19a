"""The sampling controls through the HTTP API: ``n`` choices (seeded: reproducible and different; greedy:
identical), penalties and ``logit_bias`` change the output as the engine defines them, ``min_p`` and
``prompt_logprobs`` pass through, and their bad values are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from .conftest import PROMPTS, http, needs_ref

pytestmark = needs_ref


def test_n_choices(client):
    kw = dict(model="reference", prompt=PROMPTS[0], max_tokens=12, n=2)
    greedy = client.completions.create(temperature=0, **kw)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 24
    a = client.completions.create(temperature=1.0, seed=7, **kw)
    b = client.completions.create(temperature=1.0, seed=7, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    batched = client.completions.create(model="reference", prompt=PROMPTS[:2], max_tokens=4, n=3, temperature=0)
    assert [c.index for c in batched.choices] == list(range(6))


def test_n_choices_stream(client):
    stream = client.chat.completions.create(model="reference", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=8, n=2, temperature=1.0, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    full = client.chat.completions.create(model="reference", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=8, n=2, temperature=1.0, seed=3)
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]


def test_penalties_and_logit_bias_change_greedy_output(client, offline_greedy, server):
    base = offline_greedy[PROMPTS[1]][1]  # "import os\n" loops on "import os" lines
    kw = dict(model="reference", prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == base
    assert client.completions.create(frequency_penalty=2.0, **kw).choices[0].text != base
    assert client.completions.create(presence_penalty=2.0, **kw).choices[0].text != base
    rep = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}})
    assert rep.choices[0].text != base
    forced = server.llm.tokenizer.encode(" banana", add_special_tokens=False)[0]
    biased = client.completions.create(logit_bias={str(forced): 100}, max_tokens=3, model="reference",
                                       prompt=PROMPTS[1], temperature=0, logprobs=0)
    assert biased.choices[0].logprobs.tokens == [server.llm.tokenizer.decode([forced])] * 3
    same = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "min_p": 0.0}})
    assert same.choices[0].text == base


def test_prompt_logprobs_and_echo_logprobs(client, server):
    r = client.completions.create(model="reference", prompt=PROMPTS[2], max_tokens=2, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    n_prompt = len(server.llm.tokenizer.encode(PROMPTS[2]))
    assert len(lp.tokens) == n_prompt + 2
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


@pytest.mark.parametrize("body, param", [
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"n": 0}, "n"),
])
def test_bad_control_values_are_400(server, body, param):
    status, _, raw = http("POST", server.url + "/completions",
                          json.dumps({"model": "reference", "prompt": "x", "max_tokens": 2, **body}))
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param, error
