"""The server over two data-parallel ranks (processes, gloo, expert-parallel MoE): greedy completions equal
``LLM.generate`` on one process, streaming works, and /metrics reads the ranks' merged stats."""

from __future__ import annotations

import openai

from .conftest import ENGINE, PROMPTS, ServerThread, http, needs_ref

pytestmark = needs_ref


def test_two_ranks_serve_the_single_process_tokens(offline_greedy):
    from deepinfer_npu.config import EngineConfig
    from deepinfer_npu.entrypoints.async_llm import AsyncLLM
    from deepinfer_npu.entrypoints.metrics import ServerMetrics
    from deepinfer_npu.entrypoints.openai.api_server import build_app

    config = EngineConfig(model=None, data_parallel_size=2, distributed_timeout_s=120, **ENGINE)
    metrics = ServerMetrics("reference")
    llm = AsyncLLM(config, observer=metrics.observe)
    metrics.bind(llm)
    srv = ServerThread(build_app(llm, "reference", None, metrics))
    try:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="reference", prompt=PROMPTS[:4], max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert [c.text for c in r.choices] == [offline_greedy[p][1] for p in PROMPTS[:4]]
        stream = client.completions.create(model="reference", prompt=PROMPTS[4], max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in stream) == offline_greedy[PROMPTS[4]][1]
        status, _, body = http("GET", srv.base + "/metrics")
        assert status == 200 and 'deepinfer:kv_cache_usage_perc{model_name="reference"}' in body.decode()
        assert llm.engine.get_stats()["data_parallel_size"] == 2
    finally:
        srv.stop()
        llm.shutdown()
