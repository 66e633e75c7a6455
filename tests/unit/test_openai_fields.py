"""Nothing silent: every field of the openai SDK's request types is implemented, refused
with a 400 naming it, or accepted and ignored for a reason docs/api.md states."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_harness import CHAT, COMPLETIONS, RefusingScheduler, body_for, http_post
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from gateway.api.openai_api import OpenAIApi
from gateway.api.protocol import IGNORED, REFUSED, ChatCompletionRequest, CompletionRequest
from gateway.server import made_weights
from specd.proto.speculative.v1 import common_pb2

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


def test_the_model_card_says_when_the_weights_are_made(tok):
    def pool(weights: str) -> Any:
        return types.SimpleNamespace(info=common_pb2.ModelInfo(model_id="m", weights=weights))

    assert made_weights(pool(""), pool("")) == "" and made_weights(pool(""), None) == ""
    made = made_weights(pool("synthetic (seed 0)"), pool("synthetic (seed 0, agreement 0.8)"))
    assert made == "target synthetic (seed 0); drafter synthetic (seed 0, agreement 0.8)"
    api = OpenAIApi(RefusingScheduler(), tok, "served", health=None)  # type: ignore[arg-type]
    app = api.app()

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            plain = (await client.get("/v1/models")).json()["data"][0]
            api.weights = made
            return [
                plain,
                (await client.get("/v1/models")).json()["data"][0],
                (await client.get("/v1/models/served")).json(),
            ]

    plain, listed, retrieved = asyncio.run(go())
    assert "weights" not in plain
    assert listed["weights"] == retrieved["weights"] == made


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


TOOLS_A = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}}]
TOOLS_B = [{"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}}]


def effect(endpoint: str, field: str) -> tuple[dict[str, Any], dict[str, Any], str]:
    """For an implemented field: a request without it (or with another value), the same request
    with it, and where the difference must show: "scheduler" (the prompt, the parameters or the
    number of sequences the scheduler is given) or "reply" (a field of the response's form only)."""
    logprobs = 2 if endpoint == COMPLETIONS else True
    required = {"tool_choice": "required", "tools": TOOLS_A}
    table: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
        "best_of": ({}, {"best_of": 3}, "scheduler"),
        "echo": ({}, {"echo": True}, "reply"),
        "frequency_penalty": ({}, {"frequency_penalty": 0.5}, "scheduler"),
        "logit_bias": ({}, {"logit_bias": {"5": 10}}, "scheduler"),
        "logprobs": ({}, {"logprobs": logprobs}, "scheduler"),
        "max_completion_tokens": ({"max_tokens": None}, {"max_tokens": None, "max_completion_tokens": 7}, "scheduler"),
        "max_tokens": ({}, {"max_tokens": 9}, "scheduler"),
        "messages": ({}, {"messages": [{"role": "user", "content": "Bye"}]}, "scheduler"),
        "model": ({}, {"model": "another-model"}, "reply"),
        "n": ({}, {"n": 2}, "scheduler"),
        "parallel_tool_calls": (required, {**required, "parallel_tool_calls": False}, "scheduler"),
        "presence_penalty": ({}, {"presence_penalty": 0.5}, "scheduler"),
        "prompt": ({}, {"prompt": "Bye"}, "scheduler"),
        "response_format": ({}, {"response_format": {"type": "json_object"}}, "scheduler"),
        "seed": ({}, {"seed": 7}, "scheduler"),
        "stop": ({}, {"stop": ["x"]}, "scheduler"),
        "stream": ({}, {"stream": True}, "reply"),
        "stream_options": ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}, "reply"),
        "temperature": ({}, {"temperature": 0.3}, "scheduler"),
        "tool_choice": ({"tools": TOOLS_A, "tool_choice": "none"}, required, "scheduler"),
        "tools": (required, {**required, "tools": TOOLS_B, "tool_choice": "required"}, "scheduler"),
        "top_logprobs": ({"logprobs": True}, {"logprobs": True, "top_logprobs": 3}, "scheduler"),
        "top_p": ({}, {"top_p": 0.5}, "scheduler"),
    }
    return table[field]


IMPLEMENTED = [(e, f) for e, _, f in CASES if f not in REFUSED and f not in IGNORED]


@pytest.mark.parametrize(
    ("endpoint", "field"), IMPLEMENTED, ids=[f"{'chat' if e == CHAT else 'completions'}-{f}" for e, f in IMPLEMENTED]
)
def test_every_implemented_field_changes_what_the_gateway_does(tok, endpoint, field):
    """A field declared and documented but never wired through would pass the test above; not this one."""
    without, with_it, where = effect(endpoint, field)
    a, sa = http_post(tok, endpoint, {k: v for k, v in body_for(endpoint, without).items() if v is not None})
    b, sb = http_post(tok, endpoint, {k: v for k, v in body_for(endpoint, with_it).items() if v is not None})
    assert a.status_code == 200, a.text
    if where == "scheduler":
        assert b.status_code == 200, b.text
        assert (sa.prompts, sa.submitted) != (sb.prompts, sb.submitted), f"{field} changes nothing the scheduler gets"
    else:
        assert (a.status_code, a.text) != (b.status_code, b.text), f"{field} changes nothing in the reply"
