"""What the completion and chat endpoints share: prompt checks, running one or several engine requests,
streaming deltas that never take text back, logprob lookups, usage, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from deepinfer_npu.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_npu.engine.sampling_params import SamplingParams
from deepinfer_npu.entrypoints.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestStream
from deepinfer_npu.entrypoints.openai.errors import OpenAIError, bad_request


class ServingBase:
    def __init__(self, llm: AsyncLLM, served_model_name: str, retry_after_s: int = 1) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.tokenizer = llm.tokenizer
        self.retry_after_s = retry_after_s
        self.vocab_size = llm.vocab_size

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                              param="model")

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> None:
        """vLLM's context check: the prompt, and the prompt plus ``max_tokens``, must fit ``max_model_len``."""
        limit = self.llm.max_model_len
        if prompt_len >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                              f"{prompt_len} tokens; shorten it or raise --max-model-len", param=param)
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for "
                              "the completion); reduce the prompt or max_tokens", param="max_tokens")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send token ids as the prompt", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int, entry=None) -> str:
        if entry is not None and getattr(entry, "decoded_token", None) is not None:
            return entry.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------------ running requests
    async def admit(self, prompts: list[dict], params: SamplingParams, base_id: str) -> list[RequestStream]:
        """Submit every prompt (``{"prompt_token_ids": [...]}``) as one engine request, all or none: a rejection
        aborts the ones already admitted and raises the HTTP error (400 bad request, 503 queue full)."""
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                streams.append(await self.llm.add_request(f"{base_id}-{i}", p, params))
        except BaseException as e:
            for s in streams:
                s.close()
            raise self.translate(e) from e
        return streams

    async def results(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt_index, output)`` as the streams' outputs arrive, interleaved; every stream is closed
        (aborting unfinished requests) when the consumer stops early or is cancelled."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            open_streams = len(tasks)
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, BaseException):
                    raise self.translate(item) from item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    def translate(self, e: BaseException) -> BaseException:
        if isinstance(e, OpenAIError):
            return e
        if isinstance(e, QueueFullError):
            return OpenAIError(503, str(e), headers={"Retry-After": str(self.retry_after_s)})
        if isinstance(e, EngineDeadError):
            return OpenAIError(503, str(e))
        if isinstance(e, (ValueError, TypeError)):
            return bad_request(e)
        return e


class DeltaText:
    """Per choice: the text already streamed. While a choice runs, the last ``max(len(stop)) - 1`` characters
    are held back, since a stop string completed later cuts the text there; the streamed deltas therefore
    always add up to the final text."""

    def __init__(self, params: SamplingParams) -> None:
        self.hold = max((len(s) for s in params.stop or ()), default=1) - 1
        self.sent: dict[int, int] = {}

    def delta(self, key: int, c: CompletionOutput) -> str:
        end = len(c.text) if c.finish_reason is not None else max(len(c.text) - self.hold, 0)
        start = self.sent.get(key, 0)
        if end <= start:
            return ""
        self.sent[key] = end
        return c.text[start:end]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def until_disconnected(request: Request, work) -> object:
    """Await ``work`` (a coroutine) unless the client disconnects first; then it is cancelled (its requests are
    aborted) and ``None`` is returned."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return None
    finally:
        watcher.cancel()
