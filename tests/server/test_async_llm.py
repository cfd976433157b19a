"""``AsyncLLM`` when the engine fails: every open stream gets ``EngineDeadError`` (nothing hangs), later
submissions are refused with the cause, and ``/health`` would report it (``is_running`` is False)."""

from __future__ import annotations

import asyncio

import pytest

from deepinfer_npu import SamplingParams
from deepinfer_npu.config import EngineConfig
from deepinfer_npu.entrypoints.async_llm import AsyncLLM, EngineDeadError

from .conftest import needs_ref

pytestmark = needs_ref


def test_engine_error_reaches_every_stream_and_refuses_new_requests():
    llm = AsyncLLM(EngineConfig(model=None, max_num_seqs=4, block_size=16, num_kv_blocks=64))
    try:
        engine = llm.engine
        real_step, calls = engine.step_for_sinks, []

        def failing_step():
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("device lost")
            real_step()

        engine.step_for_sinks = failing_step
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

        async def consume(rid: str):
            outs = []
            async for out in llm.generate("import os\n", params, rid):
                outs.append(out)
            return outs

        async def run():
            results = await asyncio.wait_for(asyncio.gather(consume("a"), consume("b"), return_exceptions=True), 60)
            with pytest.raises(EngineDeadError, match="device lost"):
                await consume("c")
            return results

        results = asyncio.run(run())
        assert all(isinstance(r, EngineDeadError) and "RuntimeError: device lost" in str(r) for r in results)
        assert not llm.is_running
    finally:
        llm.shutdown()
