"""The OpenAI endpoints through the real ``openai`` client: greedy completions equal ``LLM.generate``, chat with
the model's template, streaming deltas that add up to the full text, usage, logprobs, stop strings, seeds."""

from __future__ import annotations

import math

from .conftest import PROMPTS, http, needs_ref

pytestmark = needs_ref

GREEDY = dict(max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["reference"]
    assert http("GET", server.base + "/health")[0] == 200


def test_completion_equals_offline_generate(client, server, offline_greedy):
    r = client.completions.create(model="reference", prompt=PROMPTS[:3], **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    tokenizer = server.llm.tokenizer
    for p, c in zip(PROMPTS[:3], r.choices):
        assert c.text == offline_greedy[p][1]
        assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 3 * 16
    assert r.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS[:3])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompt_and_echo(client, server, offline_greedy):
    ids = server.llm.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model="reference", prompt=ids, echo=True, **GREEDY)
    assert r.choices[0].text == server.llm.tokenizer.decode(ids, skip_special_tokens=False) + offline_greedy[PROMPTS[0]][1]


def test_streaming_deltas_add_up_with_usage(client, offline_greedy):
    stream = client.completions.create(model="reference", prompt=PROMPTS[1], stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == offline_greedy[PROMPTS[1]][1]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_uses_the_template_and_streams_the_same_text(client, server):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]
    r = client.chat.completions.create(model="reference", messages=messages, max_tokens=12, temperature=0)
    rendered = server.llm.engine.tokenizer.encode(
        "<|bos|># system:\nYou write Python.\n# user:\nA stack class\n# assistant:\n", add_special_tokens=False)
    assert r.usage.prompt_tokens == len(rendered)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="reference", messages=messages, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = [ch for ch in stream if ch.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_string_streamed_text_never_taken_back(client, offline_greedy):
    full = offline_greedy[PROMPTS[0]][1]
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a piece of the greedy text
    assert stop.strip(), full
    r = client.completions.create(model="reference", prompt=PROMPTS[0], stop=[stop], max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]
    stream = client.completions.create(model="reference", prompt=PROMPTS[0], stop=[stop], max_tokens=16,
                                       temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in stream) == r.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model="reference", prompt=PROMPTS[2], logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 16
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(16)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4  # the top 3 plus the sampled token when it is not among them
        assert math.isclose(max(top.values()), value, abs_tol=1e-5)  # greedy: the sampled token is the best


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="reference", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert bytes(item.bytes).decode("utf-8") == item.token


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model="reference", prompt=PROMPTS[3], max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # different seeds do not all give the seed-1234 text


def test_metrics_count_what_was_served(client, server):
    client.completions.create(model="reference", prompt=PROMPTS[4], **GREEDY)
    status, _, raw = http("GET", server.base + "/metrics")
    assert status == 200
    body = raw.decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    label = '{model_name="reference"}'
    assert values["deepinfer:generation_tokens_total" + label] >= 16
    assert values["deepinfer:prompt_tokens_total" + label] >= 1
    assert values["deepinfer:time_to_first_token_seconds_count" + label] >= 1
    assert values["deepinfer:e2e_request_latency_seconds_count" + label] >= 1
    assert values["deepinfer:inter_token_latency_seconds_count" + label] >= 15
    assert values['deepinfer:request_success_total{finished_reason="length",model_name="reference"}'] >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "state_slot_usage_perc"):
        assert "deepinfer:" + gauge + label in values
