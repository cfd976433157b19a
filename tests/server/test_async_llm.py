"""``AsyncLLM`` when the engine fails: every open stream gets ``EngineDeadError`` (nothing hangs), later
submissions are refused with the cause, and ``/health`` would report it (``is_running`` is False)."""

from __future__ import annotations

import asyncio
import re

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


def test_the_grammar_compiler_is_prepared_off_the_request_path():
    """The server prepares structured output after start-up (xgrammar's import, the tokenizer's vocabulary for
    it: seconds) on a thread of its own, so its first constrained request does not wait for them; the request
    then compiles its grammar in the prepared pool."""
    from deepinfer_npu.structured_output import StructuredOutputsParams

    llm = AsyncLLM(EngineConfig(model=None, max_num_seqs=4, block_size=16, num_kv_blocks=64))
    try:
        grammars = llm.engine._grammars
        assert grammars._pool is None
        thread = llm.prepare_structured_output()
        assert thread is not None
        thread.join(120)
        pool = grammars._pool
        assert pool is not None
        params = SamplingParams(max_tokens=8, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2}-\d"))

        async def run():
            return [out async for out in llm.generate("tag: ", params, "r0")]

        outs = asyncio.run(run())
        assert outs[-1].finished and re.fullmatch(r"[a-z]{2}-\d", outs[-1].outputs[0].text)
        assert grammars._pool is pool  # the prepared pool served it
    finally:
        llm.shutdown()
