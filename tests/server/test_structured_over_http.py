"""Structured output through the HTTP API with the ``openai`` client: chat's ``response_format`` (``json_schema``,
``json_object``) and vLLM's ``structured_outputs`` body field; a schema the grammar compiler rejects, or both forms
at once, is a 400 and the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from .conftest import needs_ref

pytestmark = needs_ref

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "count"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def test_response_format_json_schema_validates(client):
    r = client.chat.completions.create(
        model="reference", messages=MESSAGES, max_tokens=96, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_json_object_and_seeded_sampling_parse(client):
    finished = 0
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="reference", messages=MESSAGES, max_tokens=128, temperature=0.8, seed=seed,
            response_format={"type": "json_object"})
        choice = r.choices[0]
        if choice.finish_reason == "stop":  # a free-form object may run past max_tokens; a finished one parses
            assert isinstance(json.loads(choice.message.content), dict)
            finished += 1
    assert finished, "no json_object completion finished within max_tokens"


def test_structured_outputs_field_regex_and_choice(client):
    r = client.completions.create(model="reference", prompt="id: ", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}})
    assert re.fullmatch(r"[a-z]{3}-\d{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model="reference", prompt="colour: ", max_tokens=8, temperature=1.0, seed=3,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")


@pytest.mark.parametrize("kw, words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                        "properties": 5}}}),
     "schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "json_schema.schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a+"}}),
     "cannot be combined"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="reference", messages=MESSAGES, max_tokens=8, **kw)
    assert words in str(e.value), str(e.value)
    ok = client.chat.completions.create(model="reference", messages=MESSAGES, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content is not None
