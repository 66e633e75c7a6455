"""Nothing silent: every field of the openai SDK's request types is implemented, refused
with a 400 naming it, or accepted and ignored for a reason docs/api.md states."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_harness import CHAT, COMPLETIONS, RefusingScheduler, body_for, http_post
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from gateway.api.openai_api import OpenAIApi
from gateway.api.protocol import IGNORED, REFUSED, ChatCompletionRequest, CompletionRequest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

# A value each refused field could carry from a client that relies on it.
REFUSED_SAMPLES: dict[str, Any] = {
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
    "suffix": "the end",
}
IGNORED_SAMPLES: dict[str, Any] = {
    "user": "u-1",
    "safety_identifier": "s-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {},
}


def sdk_fields(module: Any) -> set[str]:
    keys: set[str] = set()
    for name in ("CompletionCreateParamsNonStreaming", "CompletionCreateParamsStreaming"):
        cls = getattr(module, name)
        keys |= set(cls.__required_keys__) | set(cls.__optional_keys__)
    return keys


CASES = [(COMPLETIONS, CompletionRequest, field) for field in sorted(sdk_fields(completion_params))] + [
    (CHAT, ChatCompletionRequest, field) for field in sorted(sdk_fields(chat_params))
]


@pytest.mark.parametrize(
    ("endpoint", "model", "field"), CASES, ids=[f"{'chat' if e == CHAT else 'completions'}-{f}" for e, _, f in CASES]
)
def test_every_sdk_field_is_implemented_refused_or_documented_as_ignored(tok, endpoint, model, field):
    if field in REFUSED:
        r, scheduler = http_post(tok, endpoint, body_for(endpoint, {field: REFUSED_SAMPLES[field]}))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
        assert not scheduler.submitted
    elif field in IGNORED:
        assert f"`{field}`" in ignored_section(), f"docs/api.md does not say why {field} is ignored"
        r, _ = http_post(tok, endpoint, body_for(endpoint, {field: IGNORED_SAMPLES[field]}))
        assert r.status_code == 200, r.text
    else:
        assert field in model.model_fields, f"{field} is neither implemented, refused nor ignored"
        assert f"`{field}`" in API_DOC.read_text(), f"docs/api.md does not document {field}"


def ignored_section() -> str:
    text = API_DOC.read_text()
    start = text.index("Accepted and ignored")
    return text[start : start + 3000]


def test_api_doc_gives_every_ignored_field_a_reason():
    section = ignored_section()
    for field in IGNORED:
        assert f"`{field}`" in section


def test_neutral_values_of_refused_fields_are_accepted(tok):
    neutral = {"response_format": {"type": "text"}, "modalities": ["text"], "tool_choice": "none", "tools": []}
    r, _ = http_post(tok, CHAT, body_for(CHAT, neutral))
    assert r.status_code == 200, r.text
    r, _ = http_post(tok, COMPLETIONS, body_for(COMPLETIONS, {"suffix": None}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        (COMPLETIONS, {"temprature": 0.2}, "temprature"),
        (CHAT, {"guided_grammar": "start: x"}, "guided_grammar"),
        (CHAT, {"stream_options": {"include_usage": True, "chunk_size": 3}}, "stream_options.chunk_size"),
        (
            CHAT,
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
            "messages.0.tool_calls",
        ),
        (CHAT, {"messages": [{"role": "critic", "content": "42"}]}, "messages.0.role"),
    ],
)
def test_unknown_parameters_are_refused_by_name(tok, endpoint, fields, param):
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    assert not scheduler.submitted


def test_models_retrieve_answers_the_served_model_and_404s_others(tok):
    app = OpenAIApi(RefusingScheduler(), tok, "org/served", health=None).app()  # type: ignore[arg-type]

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            return [await client.get(path) for path in ("/v1/models/org/served", "/v1/models/other", "/v1/nope")]

    served, other, nowhere = asyncio.run(go())
    assert served.status_code == 200 and served.json()["id"] == "org/served"
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    message = nowhere.json()["error"]["message"]
    assert nowhere.status_code == 404 and "GET /v1/nope" in message and "POST /v1/responses" in message


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content.0",
            "content parts of type 'image_url' are not supported",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ],
)
def test_unsupported_content_and_stream_options_without_stream_say_so(tok, fields, param, says):
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert says in r.json()["error"]["message"] and not scheduler.submitted


def test_text_parts_are_joined(tok):
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, {"messages": [{"role": "user", "content": parts}]}))
    _, same = http_post(tok, CHAT, body_for(CHAT, {"messages": [{"role": "user", "content": "Hello"}]}))
    assert r.status_code == 200 and scheduler.prompts == same.prompts
