"""Where the chat template comes from (--chat-template file or text, chat_template.jinja, tokenizer_config.json as
a string or a named list) and how it renders (HF's sandboxed jinja2 settings, special tokens, errors)."""

from __future__ import annotations

import json

import pytest

from deepinfer_npu.entrypoints.chat_template import ChatTemplateError, load_chat_template

MESSAGES = [{"role": "user", "content": "héllo"}]


def _model(tmp_path, config: dict, jinja: str | None = None):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_precedence_override_then_jinja_file_then_tokenizer_config(tmp_path):
    d = _model(tmp_path, {"bos_token": {"content": "<s>"}, "chat_template": "cfg:{{ messages[0].content }}"},
               jinja="file:{{ bos_token }}{{ messages[0].content }}")
    assert load_chat_template(d).render(MESSAGES) == "file:<s>héllo"
    assert load_chat_template(d, "text:{{ messages | length }}").render(MESSAGES) == "text:1"
    f = tmp_path / "t.jinja"
    f.write_text("path:{{ messages[0].role }}")
    assert load_chat_template(d, str(f)).render(MESSAGES) == "path:user"
    (tmp_path / "chat_template.jinja").unlink()
    assert load_chat_template(d).render(MESSAGES) == "cfg:héllo"


def test_named_template_list_and_missing_template(tmp_path):
    d = _model(tmp_path, {"chat_template": [{"name": "tool_use", "template": "tools"},
                                            {"name": "default", "template": "{{ messages[0].content | tojson }}"}]})
    assert load_chat_template(d).render(MESSAGES) == '"héllo"'  # tojson keeps non-ASCII text
    assert load_chat_template(_model(tmp_path, {})) is None


def test_template_errors_are_chat_template_errors(tmp_path):
    d = _model(tmp_path, {})
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_chat_template(d, "{% for %}")
    with pytest.raises(ChatTemplateError, match="neither a file nor a jinja2 template"):
        load_chat_template(d, "no-such-file.jinja")
    t = load_chat_template(d, "{{ raise_exception('only user messages') }}")
    with pytest.raises(ChatTemplateError, match="only user messages"):
        t.render(MESSAGES)
    sandboxed = load_chat_template(d, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render(MESSAGES)


def test_generation_prompt_and_loopcontrols(tmp_path):
    t = load_chat_template(_model(tmp_path, {}), "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                                 "[{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    two = MESSAGES + [{"role": "user", "content": "b"}]
    assert t.render(two) == "[héllo]>"
    assert t.render(two, add_generation_prompt=False) == "[héllo]"
