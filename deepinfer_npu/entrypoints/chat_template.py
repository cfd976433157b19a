"""Chat templates: found as Hugging Face finds them and rendered with jinja2 the way ``apply_chat_template`` does.

Where the template comes from, first match wins: ``--chat-template`` (a file path or the template text), the
model's ``chat_template.jinja``, then ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
``{"name", "template"}`` of which ``default`` is used). Rendering uses a sandboxed environment with
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception`` and a ``tojson`` filter
that keeps non-ASCII text, and passes the special tokens of ``tokenizer_config.json`` (``bos_token``, ...).
The rendered text already carries the template's special tokens, so it is tokenized without adding BOS again.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ChatTemplateError(ValueError):
    """A template that is missing, does not parse, or fails on the given messages."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = special_tokens
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template from {origin} does not parse: {e}") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template from {self.origin} failed on these messages: {e}") from e


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: str | os.PathLike | None, override: str | None = None) -> ChatTemplate | None:
    """The model's chat template (see the module docstring), or ``None`` when there is none."""
    config: dict = {}
    if model_dir is not None:
        path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
    special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    if override is not None:
        if os.path.exists(override):
            with open(override, encoding="utf-8") as f:
                return ChatTemplate(f.read(), special, origin=override)
        if "{" not in override:
            raise ChatTemplateError(f"--chat-template {override!r} is neither a file nor a jinja2 template")
        return ChatTemplate(override, special, origin="--chat-template")
    if model_dir is not None:
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), special, origin=jinja_path)
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return ChatTemplate(template, special, origin=os.path.join(str(model_dir), "tokenizer_config.json"))
    return None
