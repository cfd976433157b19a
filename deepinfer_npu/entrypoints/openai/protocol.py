"""Request bodies of the OpenAI-compatible endpoints (pydantic), and their mapping to :class:`SamplingParams`.

Field names and defaults follow the OpenAI API, plus vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``prompt_logprobs``). Unknown fields are accepted and ignored with a warning, as
vLLM does, so newer clients keep working. Range checks are :class:`SamplingParams`'s, whose messages name the
parameter.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepinfer_npu.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions; ``None`` means "the model's default"."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def warn_unknown_fields(self, endpoint: str) -> None:
        extra = sorted(self.model_extra or {})
        if extra:
            logger.warning("%s: ignoring unsupported fields %s", endpoint, extra)

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine parameters of this request. Unset fields take ``defaults`` (the model's
        ``generation_config.json``); the optional controls are passed only when the request sets them."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "temperature": defaults.temperature if self.temperature is None else self.temperature,
            "top_p": defaults.top_p if self.top_p is None else self.top_p,
            "top_k": defaults.top_k if self.top_k is None else self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        for name in ("min_p", "repetition_penalty"):  # generation_config.json may set these defaults
            value = getattr(self, name)
            kwargs[name] = getattr(defaults, name) if value is None else value
        for name in ("presence_penalty", "frequency_penalty", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.logit_bias:
            kwargs["logit_bias"] = {_token_id(k): v for k, v in self.logit_bias.items()}
        constraint = self.structured_outputs_params()
        if constraint is not None:
            kwargs["structured_outputs"] = constraint
        return SamplingParams(**kwargs)

    def structured_outputs_params(self):
        """vLLM's ``structured_outputs`` body field (``json``, ``regex``, ``choice``, ``grammar``,
        ``json_object``) as :class:`StructuredOutputsParams`; chat's ``response_format`` adds to it."""
        if not self.structured_outputs:
            return None
        from deepinfer_npu.structured_output import StructuredOutputsParams

        try:
            return StructuredOutputsParams(**self.structured_outputs)
        except TypeError as e:
            raise ValueError(f"structured_outputs: {e}".replace("StructuredOutputsParams.__init__() ", "")) from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_id(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise ValueError(f"logit_bias keys must be token ids (integers as strings), got {key!r}") from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    def structured_outputs_params(self):
        """``response_format`` (``json_object``, ``json_schema``) or ``structured_outputs``, not both."""
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return super().structured_outputs_params()
        if self.structured_outputs:
            raise ValueError("response_format and structured_outputs cannot be combined; use one")
        from deepinfer_npu.structured_output import StructuredOutputsParams

        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object")
        return StructuredOutputsParams(json=schema)

    def message_dicts(self) -> list[dict[str, Any]]:
        """Messages as the template sees them: text parts of a list content joined, other parts rejected."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                texts = []
                for part in m.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise ValueError(f"messages[{i}].content: only text parts are supported, got a "
                                         f"{part.get('type')!r} part")
                    texts.append(part["text"])
                d["content"] = "\n".join(texts)
            out.append(d)
        return out
