"""POST /v1/responses over the chat path: the request as the chat request it means, and the
reply in the Responses API's shape, whole and streamed (checked against the openai SDK's types)."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from api_harness import CHAT, MODEL, GatewayScheduler, ScriptedScheduler, http_post
from openai.types.responses import Response, ResponseStreamEvent

from gateway.api.responses_api import IGNORED, REFUSED, ResponsesRequest

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "name": "weather", "description": "Weather now", "parameters": WEATHER, "strict": True}]
EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)


class PromptScheduler(ScriptedScheduler):
    """Also records the prompts that reach it."""

    def __init__(self, pieces: list[str], reason: str = "stop") -> None:
        super().__init__(pieces, reason)
        self.prompts: list[list[int]] = []

    def submit(self, prompt: list[int], params: Any, carrier: Any = None) -> Any:
        self.prompts.append(prompt)
        return super().submit(prompt, params, carrier)


def post(tok, fields: dict[str, Any], pieces: list[str] | None = None, reason: str = "stop", path: str = RESPONSES):
    scheduler = PromptScheduler(pieces or ["Hel", "lo"], reason)
    r, _ = http_post(tok, path, {"model": MODEL} | fields, scheduler)
    return r, scheduler


def events(text: str) -> list[dict[str, Any]]:
    out = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    for i, event in enumerate(out):
        EVENTS.validate_python(event)  # each is one of the SDK's event types, whole
        assert event["sequence_number"] == i
    return out


def test_a_string_input_is_a_user_message_after_the_instructions(tok):
    fields = {"input": "Hi", "instructions": "Be brief", "max_output_tokens": 9, "seed": 3, "num_speculative_tokens": 0}
    r, scheduler = post(tok, fields)
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    assert response.output_text == "Hello" and response.status == "completed"
    assert response.usage is not None and response.usage.output_tokens == 2
    (params,) = scheduler.submitted
    assert params.max_tokens == 9 and params.sampling.seed == 3 and params.speculation == 0
    chat = {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]}
    _, same = post(tok, chat | {"max_tokens": 9}, path=CHAT)
    assert scheduler.prompts == same.prompts


def test_items_are_the_conversation_a_chat_request_would_send(tok):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 12 C.", "annotations": []}]},
    ]  # fmt: skip
    r, scheduler = post(tok, {"input": items, "tools": TOOLS, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
        {"role": "assistant", "content": "It is 12 C."},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    _, same = post(tok, {"messages": messages, "tools": chat_tools, "tool_choice": "none"}, path=CHAT)
    assert scheduler.prompts == same.prompts


def test_text_format_json_schema_is_the_chat_response_format(tok):
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}
    r, scheduler = post(tok, {"input": "Hi", "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    assert json.loads(scheduler.submitted[0].json_schema)["properties"] == WEATHER["properties"]


CALLS = '[{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}, {"name": "weather", "parameters": {"city": "Bergen", "unit": "f"}}]'  # noqa: E501


def test_required_calls_are_function_call_items_whole_and_streamed(tok):
    pieces = [CALLS[i : i + 7] for i in range(0, len(CALLS), 7)]
    r, _ = post(tok, {"input": "Hi", "tools": TOOLS, "tool_choice": "required"}, pieces)
    assert r.status_code == 200, r.text
    whole = Response.model_validate(r.json())
    assert [(o.type, o.name, json.loads(o.arguments)) for o in whole.output] == [  # type: ignore[union-attr]
        ("function_call", "weather", {"city": "Oslo", "unit": "c"}),
        ("function_call", "weather", {"city": "Bergen", "unit": "f"}),
    ]
    r, _ = post(tok, {"input": "Hi", "tools": TOOLS, "tool_choice": "required", "stream": True}, pieces)
    streamed = events(r.text)
    kinds = [e["type"] for e in streamed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == 2 and kinds.count("response.function_call_arguments.done") == 2
    args: dict[int, str] = {}
    for e in streamed:
        if e["type"] == "response.function_call_arguments.delta":
            args[e["output_index"]] = args.get(e["output_index"], "") + e["delta"]
    final = streamed[-1]["response"]["output"]
    assert [args[0], args[1]] == [o["arguments"] for o in final] == [o.arguments for o in whole.output]  # type: ignore[union-attr]
    assert streamed[-1]["response"]["usage"]["output_tokens"] == len(pieces)


def test_a_named_call_streams_its_arguments(tok):
    body = {"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "weather"}, "stream": True}
    r, scheduler = post(tok, body, ['{"city": ', '"Oslo", "unit": "c"}'])
    streamed = events(r.text)
    (done,) = [e for e in streamed if e["type"] == "response.function_call_arguments.done"]
    assert done["name"] == "weather" and json.loads(done["arguments"]) == {"city": "Oslo", "unit": "c"}
    assert json.loads(scheduler.submitted[0].json_schema)["required"] == ["city", "unit"]


def test_text_streams_and_max_output_tokens_makes_it_incomplete(tok):
    r, _ = post(tok, {"input": "Hi", "stream": True, "max_output_tokens": 2}, ["Hel", "lo"], reason="length")
    streamed = events(r.text)
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "Hello"
    last = streamed[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    r, _ = post(tok, {"input": "Hi", "max_output_tokens": 2}, ["Hel", "lo"], reason="length")
    assert Response.model_validate(r.json()).status == "incomplete"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": TOOLS}, "tool_choice"),  # auto without --tool-call-parser, as on chat
        ({"temprature": 0.5}, "temprature"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": ["weather"]}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nope"}}}}, "response_format"),
    ],
)
def test_what_is_not_implemented_is_a_400_naming_it(tok, fields, param):
    r, scheduler = post(tok, {"input": "Hi"} | fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not scheduler.submitted


def test_neutral_values_of_refused_fields_are_accepted(tok):
    fields = {"store": False, "truncation": "disabled", "reasoning": {"effort": None}, "include": [], "metadata": {}}
    r, _ = post(tok, {"input": "Hi"} | fields)
    assert r.status_code == 200, r.text


def sdk_fields() -> list[str]:
    from openai.types.responses import response_create_params as params

    keys: set[str] = set()
    for name in ("ResponseCreateParamsNonStreaming", "ResponseCreateParamsStreaming"):
        cls = getattr(params, name)
        keys |= set(cls.__required_keys__) | set(cls.__optional_keys__)
    return sorted(keys)


# A value each field not implemented could carry from a client that relies on it.
SAMPLES: dict[str, Any] = {
    "store": True,
    "previous_response_id": "resp_1",
    "conversation": "conv_1",
    "background": True,
    "include": ["reasoning.encrypted_content"],
    "truncation": "auto",
    "reasoning": {"effort": "high"},
    "prompt": {"id": "pmpt_1"},
    "max_tool_calls": 3,
    "top_logprobs": 5,
    "context_management": [{"type": "compaction"}],
}


@pytest.mark.parametrize("field", sdk_fields())
def test_every_sdk_field_is_implemented_refused_or_ignored(tok, field):
    """Nothing silent: an SDK field specd does not implement is a 400 naming it."""
    if field in REFUSED:
        r, scheduler = post(tok, {"input": "Hi", field: SAMPLES[field]})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    elif field in IGNORED or field in ResponsesRequest.model_fields:
        assert field in ResponsesRequest.model_fields
    else:
        r, scheduler = post(tok, {"input": "Hi", field: {"x": 1}})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter", r.text
        assert not scheduler.submitted


def test_specds_speculation_fields_mean_what_they_mean_on_chat(tok):
    fields = {"pipeline": "ahead", "speculative_siblings": 2, "speculative_branches": 3, "num_speculative_tokens": 4}
    r, scheduler = post(tok, {"input": "Hi"} | fields)
    assert r.status_code == 200, r.text
    (params,) = scheduler.submitted
    assert (params.pipeline, params.siblings, params.branches, params.speculation) == ("ahead", 2, 3, 4)
    # What the gateway refuses on chat it refuses here: branches outside the ahead pipeline.
    refused = {"input": "Hi", "model": MODEL, "pipeline": "sequential", "speculative_branches": 2}
    r, _ = http_post(tok, RESPONSES, refused, GatewayScheduler(tok))
    assert r.status_code == 400 and r.json()["error"]["param"] == "speculative_branches", r.text
