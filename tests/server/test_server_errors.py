"""Bad input gets a 400 (404 for an unknown model, as vLLM) with an OpenAI-style error body naming the field, and
the server keeps serving; a client that disconnects mid-stream has its request aborted and its KV blocks and
state slot returned; a full waiting queue answers 503 with ``Retry-After``."""

from __future__ import annotations

import asyncio
import http.client as http_client
import json
import time

import openai
import pytest

from .conftest import PROMPTS, http, needs_ref, wait_idle

pytestmark = needs_ref


def _error(server, path: str, body) -> tuple[int, dict, dict]:
    status, headers, raw = http("POST", server.url + path, body if isinstance(body, str) else json.dumps(body))
    return status, headers, json.loads(raw)["error"]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "top_p": 2.0}, "top_p", "top_p must be in (0, 1]"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be non-negative"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs", "logprobs must be None or in 0..20"),
    ({"prompt": "x", "stop": [""]}, "stop", "stop cannot contain an empty string"),
    ({"prompt": []}, "prompt", "prompt must not be empty"),
    ({"max_tokens": 4}, "prompt", "Field required"),
    ({"prompt": [[1, 2], [999999]]}, "prompt", "999999"),
    ({"prompt": "x " * 3000}, "prompt", "maximum context length is 2048 tokens"),
    ({"prompt": "x", "max_tokens": 5000}, "max_tokens", "maximum context length is 2048 tokens"),
])
def test_bad_completion_requests_get_400_naming_the_field(server, body, param, words):
    status, _, error = _error(server, "/completions", {"model": "reference", **body})
    assert status == 400, error
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and words in error["message"], error


def test_malformed_json_unknown_model_and_bad_chat(server, client):
    status, _, error = _error(server, "/completions", '{"prompt": "x", ')
    assert status == 400 and "not valid JSON" in error["message"]
    status, _, error = _error(server, "/completions", {"model": "gpt-9", "prompt": "x"})
    assert status == 404 and error["param"] == "model" and "gpt-9" in error["message"]
    status, _, error = _error(server, "/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and error["param"] == "messages" and "unknown role robot" in error["message"]
    status, _, error = _error(server, "/chat/completions", {"messages": []})
    assert status == 400 and error["param"] == "messages"
    with pytest.raises(openai.BadRequestError):  # the openai client sees the same as a typed error
        client.completions.create(model="reference", prompt="x", top_p=3)
    # ... and the server still serves everyone else
    r = client.completions.create(model="reference", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    wait_idle(server.llm)


def _free_blocks(llm) -> tuple[int, int]:
    s = llm.engine.scheduler
    return s.kv_block_manager.num_free, s.state_manager.num_free


def test_disconnect_mid_stream_aborts_and_returns_memory(server):
    llm = server.llm
    wait_idle(llm)
    free_before = _free_blocks(llm)
    aborted_before = llm.engine.get_stats()["aborted_requests"]
    host, port = server.base.removeprefix("http://").split(":")
    conn = http_client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "reference", "prompt": PROMPTS[0], "max_tokens": 1500, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = b""
    while seen.count(b"data: ") < 3:  # a few tokens arrived: the request holds blocks now
        seen += resp.read1(4096)
    assert llm.engine.get_num_unfinished_requests() == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_idle(llm)
    assert llm.engine.get_stats()["aborted_requests"] == aborted_before + 1
    assert _free_blocks(llm) == free_before
    llm.engine.scheduler.check_invariants()


def test_full_waiting_queue_answers_503_with_retry_after(server):
    llm = server.llm
    wait_idle(llm)

    async def burst():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)

        async def one(i):
            try:
                r = await aclient.completions.create(model="reference", prompt=PROMPTS[i % 8], max_tokens=4,
                                                     temperature=0)
                return r.usage.completion_tokens
            except openai.APIStatusError as e:
                return e

        try:
            return await asyncio.gather(*(one(i) for i in range(24)))
        finally:
            await aclient.close()

    llm.max_waiting_requests = 2
    try:
        results = asyncio.run(burst())
    finally:
        llm.max_waiting_requests = None
    rejected = [r for r in results if isinstance(r, Exception)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert rejected, "24 simultaneous requests never found more than 2 waiting"
    for e in rejected:
        assert e.status_code == 503 and e.response.headers["retry-after"] == "1"
        assert "max_waiting_requests=2" in e.message
    assert served and all(n == 4 for n in served)
    wait_idle(llm)
    deadline = time.monotonic() + 10
    while llm.num_waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.num_waiting == 0 and llm.num_running == 0
