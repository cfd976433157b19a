"""``POST /v1/completions``: one engine request per prompt, ``n`` choices each (choice index = prompt index × n
+ completion index), ``echo``, OpenAI-format ``logprobs``, and SSE streaming with optional usage chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from deepinfer_npu.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_npu.entrypoints.openai.errors import OpenAIError, bad_request, error_body
from deepinfer_npu.entrypoints.openai.protocol import CompletionRequest
from deepinfer_npu.entrypoints.openai.serving_base import DeltaText, ServingBase, new_id, now_s, sse, usage


class OpenAIServingCompletion(ServingBase):
    def prepare(self, body: CompletionRequest) -> tuple[list[dict], list[str | None], object]:
        """Checks and tokenizes: ``(engine prompts, prompt texts, sampling params)``; raises a 4xx."""
        self.check_model(body.model)
        body.warn_unknown_fields("/v1/completions")
        if body.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        raw = body.prompt
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise bad_request("prompt must not be empty", param="prompt")
        prompts, texts = [], []
        for i, p in enumerate(raw):
            if isinstance(p, str):
                ids, text = self.encode(p), p
            else:
                ids, text = list(p), None
            if not ids:
                raise bad_request(f"prompt[{i}] is empty", param="prompt")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise bad_request(f"prompt[{i}]: token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})",
                                  param="prompt")
            self.check_length(len(ids), body.max_tokens, param="prompt")
            prompts.append({"prompt_token_ids": ids})
            texts.append(text)
        if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
            body.prompt_logprobs = body.logprobs  # echoed prompt tokens carry their logprobs too
        try:
            params = body.sampling_params(self.llm.default_sampling_params(), body.max_tokens, body.logprobs)
        except ValueError as e:
            raise bad_request(e) from e
        return prompts, texts, params

    async def create(self, body: CompletionRequest) -> dict:
        prompts, texts, params = self.prepare(body)
        rid = new_id("cmpl")
        final: dict[int, RequestOutput] = {}
        async for i, out in self.results(await self.admit(prompts, params, rid)):
            if out.finished:
                final[i] = out
        choices = []
        for i in range(len(prompts)):
            out = final[i]
            for c in out.outputs:
                text = c.text
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._logprobs(c.token_ids, c.logprobs, 0)
                if body.echo:
                    echo_text = self._prompt_text(texts[i], out)
                    if logprobs is not None:
                        logprobs = _join(self._prompt_logprobs(out), logprobs, len(echo_text))
                    text = echo_text + text
                choices.append({"index": i * params.n + c.index, "text": text, "logprobs": logprobs,
                                "finish_reason": _finish(c), "stop_reason": c.stop_reason})
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for o in final.values() for c in o.outputs)
        return {"id": rid, "object": "text_completion", "created": now_s(), "model": self.model_name,
                "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    async def start_stream(self, body: CompletionRequest) -> AsyncIterator[str]:
        """Check and admit the request (raising the HTTP error), then return its SSE lines."""
        prompts, texts, params = self.prepare(body)
        rid = new_id("cmpl")
        streams = await self.admit(prompts, params, rid)
        return self._stream(body, prompts, texts, params, rid, streams)

    async def _stream(self, body: CompletionRequest, prompts, texts, params, rid: str,
                      streams) -> AsyncIterator[str]:
        created = now_s()
        deltas = DeltaText(params)
        tokens_sent: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)

        def chunk(choices: list[dict], with_usage: dict | None = None) -> str:
            payload = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": choices}
            if with_usage is not None:
                payload["usage"] = with_usage
            return sse(payload)

        try:
            echoed: set[int] = set()
            async for i, out in self.results(streams):
                choices = []
                for c in out.outputs:
                    key = i * params.n + c.index
                    text = deltas.delta(key, c)
                    sent = tokens_sent.get(key, 0)
                    new_tokens = c.token_ids[sent:]
                    logprobs = None
                    if body.logprobs is not None and new_tokens:
                        logprobs = self._logprobs(new_tokens, c.logprobs[sent:] if c.logprobs else None, 0)
                    if body.echo and key not in echoed:
                        echoed.add(key)
                        text = self._prompt_text(texts[i], out) + text
                    tokens_sent[key] = len(c.token_ids)
                    completion_tokens[key] = len(c.token_ids)
                    if text or new_tokens or c.finish_reason is not None:
                        choices.append({"index": key, "text": text, "logprobs": logprobs,
                                        "finish_reason": _finish(c), "stop_reason": c.stop_reason})
                if choices:
                    running = (usage(prompt_tokens, sum(completion_tokens.values()))
                               if body.stream_options and body.stream_options.continuous_usage_stats else None)
                    yield chunk(choices, running)
            if body.include_usage:
                yield chunk([], usage(prompt_tokens, sum(completion_tokens.values())))
        except OpenAIError as e:
            yield sse(error_body(e.status, e.message, e.param))
        yield sse("[DONE]")

    # ------------------------------------------------------------------ helpers
    def _prompt_text(self, text: str | None, out: RequestOutput) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) if self.tokenizer else ""

    def _logprobs(self, token_ids, entries, offset: int) -> dict:
        """OpenAI completions format for ``token_ids`` and their ``{id: Logprob}`` entries."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for k, tid in enumerate(token_ids):
            entry = entries[k] if entries is not None and k < len(entries) else None
            text = self.token_text(tid, entry.get(tid) if entry else None)
            offsets.append(offset)
            offset += len(text)
            tokens.append(text)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(entry[tid].logprob if tid in entry else None)
            tops.append({self.token_text(t, lp): lp.logprob for t, lp in entry.items()})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, out: RequestOutput) -> dict:
        entries = getattr(out, "prompt_logprobs", None)
        return self._logprobs(out.prompt_token_ids, entries, 0)


def _join(first: dict, second: dict, shift: int) -> dict:
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}


def _finish(c: CompletionOutput) -> str | None:
    """OpenAI knows ``stop`` and ``length``; an aborted or preempted request reports ``abort`` as vLLM does."""
    reason = c.finish_reason
    if reason == "preempted":
        return "abort"
    return reason
