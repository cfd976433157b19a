"""A bounded load test on loopback: 200 concurrent streaming requests all finish, none is lost, and every greedy
output equals ``LLM.generate``'s; the engine ends idle with every block back."""

from __future__ import annotations

import asyncio

import openai

from .conftest import PROMPTS, needs_ref, wait_idle

pytestmark = needs_ref

NUM_REQUESTS = 200


def test_200_concurrent_streams_equal_offline(server, offline_greedy):
    llm = server.llm
    wait_idle(llm)
    free_before = llm.engine.scheduler.kv_block_manager.num_free

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)

        async def one(i: int) -> tuple[str, str, str | None, int]:
            prompt = PROMPTS[i % len(PROMPTS)]
            stream = await aclient.completions.create(
                model="reference", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, finish, used = "", None, 0
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            return prompt, text, finish, used

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(NUM_REQUESTS))), timeout=600)
        finally:
            await aclient.close()

    results = asyncio.run(run())
    assert len(results) == NUM_REQUESTS
    for prompt, text, finish, used in results:
        assert finish == "length" and used == 16
        assert text == offline_greedy[prompt][1], prompt
    wait_idle(llm)
    assert llm.engine.scheduler.kv_block_manager.num_free == free_before
