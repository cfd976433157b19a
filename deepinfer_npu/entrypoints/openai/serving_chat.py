"""``POST /v1/chat/completions``: messages rendered with the model's chat template, ``n`` choices, OpenAI-format
``logprobs`` / ``top_logprobs``, and SSE streaming (a role delta first, content deltas, the finish reason, then an
optional usage chunk)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepinfer_npu.engine.outputs import RequestOutput
from deepinfer_npu.engine.sampling_params import MAX_LOGPROBS
from deepinfer_npu.entrypoints.chat_template import ChatTemplate, ChatTemplateError
from deepinfer_npu.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from deepinfer_npu.entrypoints.openai.protocol import ChatCompletionRequest
from deepinfer_npu.entrypoints.openai.serving_base import DeltaText, ServingBase, new_id, now_s, sse, usage
from deepinfer_npu.entrypoints.openai.serving_completion import _finish


class OpenAIServingChat(ServingBase):
    def __init__(self, llm, served_model_name: str, chat_template: ChatTemplate | None,
                 retry_after_s: int = 1) -> None:
        super().__init__(llm, served_model_name, retry_after_s)
        self.chat_template = chat_template

    def prepare(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        body.warn_unknown_fields("/v1/chat/completions")
        if self.chat_template is None:
            raise bad_request("this model has no chat template (tokenizer_config.json 'chat_template' or "
                              "chat_template.jinja); start the server with --chat-template FILE", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {body.top_logprobs}",
                              param="top_logprobs")
        try:
            text = self.chat_template.render(body.message_dicts(), body.add_generation_prompt,
                                             **(body.chat_template_kwargs or {}))
        except (ChatTemplateError, ValueError) as e:
            raise bad_request(e, param="messages") from e
        ids = self.encode(text, add_special_tokens=False)  # the template wrote the special tokens it wants
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        self.check_length(len(ids), max_tokens, param="messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            params = body.sampling_params(self.llm.default_sampling_params(), max_tokens, logprobs)
        except ValueError as e:
            raise bad_request(e) from e
        return [{"prompt_token_ids": ids}], params

    async def create(self, body: ChatCompletionRequest) -> dict:
        prompts, params = self.prepare(body)
        rid = new_id("chatcmpl")
        final: RequestOutput | None = None
        async for _, out in self.results(await self.admit(prompts, params, rid)):
            final = out
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._logprobs(c.token_ids, c.logprobs, body) if body.logprobs else None,
                    "finish_reason": _finish(c), "stop_reason": c.stop_reason} for c in final.outputs]
        return {"id": rid, "object": "chat.completion", "created": now_s(), "model": self.model_name,
                "choices": choices,
                "usage": usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs))}

    async def start_stream(self, body: ChatCompletionRequest) -> AsyncIterator[str]:
        prompts, params = self.prepare(body)
        rid = new_id("chatcmpl")
        streams = await self.admit(prompts, params, rid)
        return self._stream(body, prompts, params, rid, streams)

    async def _stream(self, body: ChatCompletionRequest, prompts, params, rid: str, streams) -> AsyncIterator[str]:
        created = now_s()
        prompt_tokens = len(prompts[0]["prompt_token_ids"])
        deltas = DeltaText(params)
        tokens_sent: dict[int, int] = {}

        def chunk(choices: list[dict], with_usage: dict | None = None) -> str:
            payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                       "choices": choices}
            if with_usage is not None:
                payload["usage"] = with_usage
            return sse(payload)

        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(params.n)])
            async for _, out in self.results(streams):
                choices = []
                for c in out.outputs:
                    text = deltas.delta(c.index, c)
                    sent = tokens_sent.get(c.index, 0)
                    new_tokens = c.token_ids[sent:]
                    tokens_sent[c.index] = len(c.token_ids)
                    logprobs = None
                    if body.logprobs and new_tokens:
                        logprobs = self._logprobs(new_tokens, c.logprobs[sent:] if c.logprobs else None, body)
                    if text or new_tokens or c.finish_reason is not None:
                        choices.append({"index": c.index, "delta": {"content": text} if text else {},
                                        "logprobs": logprobs, "finish_reason": _finish(c),
                                        "stop_reason": c.stop_reason})
                if choices:
                    running = (usage(prompt_tokens, sum(tokens_sent.values()))
                               if body.stream_options and body.stream_options.continuous_usage_stats else None)
                    yield chunk(choices, running)
            if body.include_usage:
                yield chunk([], usage(prompt_tokens, sum(tokens_sent.values())))
        except OpenAIError as e:
            yield sse(error_body(e.status, e.message, e.param))
        yield sse("[DONE]")

    def _logprobs(self, token_ids, entries, body: ChatCompletionRequest) -> dict:
        """OpenAI chat format: per token its text, logprob, UTF-8 bytes and the ``top_logprobs`` alternatives."""
        content = []
        top_n = body.top_logprobs or 0
        for k, tid in enumerate(token_ids):
            entry = entries[k] if entries is not None and k < len(entries) else {}
            text = self.token_text(tid, entry.get(tid))
            alternatives = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            content.append({
                "token": text, "logprob": entry[tid].logprob if tid in entry else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [{"token": (t := self.token_text(a, lp)), "logprob": lp.logprob,
                                  "bytes": list(t.encode("utf-8"))} for a, lp in alternatives],
            })
        return {"content": content}
