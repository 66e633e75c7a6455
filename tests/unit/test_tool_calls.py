"""Tool calling: the choice a request makes, the JSON its output must be, and the calls read back."""

from __future__ import annotations

import enum
import json
from typing import Any

import jsonschema
import pydantic
import pytest
from api_harness import CHAT, ScriptedScheduler, body_for, http_post

from gateway.api.tool_calls import NO_PARAMETERS, CallArrayStream, tool_choice
from gateway.api.validation import InvalidParameter
from specd.engine.grammar import GrammarError, canonical, schema_problem

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time"}},
]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_a_named_function_forces_its_arguments():
    choice = tool_choice(TOOLS, named("weather"), None)
    assert choice is not None and choice.forced and choice.schema() == WEATHER
    (call,) = choice.calls('{"city": "Oslo"}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    # Cut short by max_tokens: the partial arguments, as OpenAI returns them with finish_reason "length".
    assert choice.calls('{"city": "Os')[0]["function"]["arguments"] == '{"city": "Os'
    assert tool_choice(TOOLS, "required", None).calls('[{"name": "time", "param') is None
    assert tool_choice(TOOLS, named("time"), None).schema() == NO_PARAMETERS


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_forces_an_array_of_calls_to_the_declared_tools(parallel):
    choice = tool_choice(TOOLS, "required", parallel)
    assert choice is not None and choice.mode == "required"
    schema = choice.schema()
    one = [{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}]
    two = [*one, {"name": "time", "parameters": {}}]
    jsonschema.validate(one, schema)
    for bad in ([], [{"name": "weather", "parameters": {"unit": "c"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel is False:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    else:
        jsonschema.validate(two, schema)
    calls = choice.calls(json.dumps(two))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo", "unit": "c"}),
        ("time", {}),
    ]
    assert len({c["id"] for c in calls}) == 2


# Laid out as the grammar forces it (specd.engine.grammar.JSON_OPTIONS): ", " and ": ", no other spaces.
ARRAY = (
    '[{"name": "weather", "parameters": {"city": "Os\\"lo} [", "unit": "c"}}, '
    '{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"nested": [{"a": [1, {}]}], "s": "]}"}}]'
)


def merged(pieces: list[dict[str, Any]]) -> list[tuple[str, str]]:
    calls: list[list[str]] = []
    for piece in pieces:
        if "id" in piece:
            assert piece["index"] == len(calls) and piece["type"] == "function" and piece["id"].startswith("call_")
            calls.append([piece["function"]["name"], piece["function"]["arguments"]])
        else:
            assert piece["index"] == len(calls) - 1 and set(piece["function"]) == {"arguments"}
            calls[-1][1] += piece["function"]["arguments"]
    return [(name, arguments) for name, arguments in calls]


def test_required_calls_stream_as_generated_and_read_as_the_whole_text_does():
    items = json.loads(ARRAY)
    want = [(item["name"], json.dumps(item["parameters"])) for item in items]
    whole = CallArrayStream()
    assert merged(whole.feed(ARRAY)) == want and whole.whole
    choice = tool_choice(TOOLS, "required", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice.calls(ARRAY)] == want
    for step in (1, 2, 3, 7):
        stream = CallArrayStream()
        pieces = [p for i in range(0, len(ARRAY), step) for p in stream.feed(ARRAY[i : i + step])]
        assert merged(pieces) == want and stream.whole
        # The id and name come as soon as the name is whole, before any of its arguments.
        assert "id" in pieces[0] and pieces[0]["function"]["arguments"] == ""


def test_required_calls_cut_short_keep_what_was_written():
    cut = ARRAY[: ARRAY.index('"time"') + 30]
    stream = CallArrayStream()
    assert merged(stream.feed(cut)) == [("weather", '{"city": "Os\\"lo} [", "unit": "c"}'), ("time", "{}")]
    assert not stream.whole
    choice = tool_choice(TOOLS, "required", None)
    assert [c["function"]["name"] for c in choice.calls(cut)] == ["weather", "time"]
    assert choice.calls('[{"name": "wea') is None  # no call named yet: the output stays text


def test_required_calls_stop_reading_where_the_layout_breaks():
    stream = CallArrayStream()
    assert merged(stream.feed('[{"name": "time", "parameters": {}}; {"name": "x"')) == [("time", "{}")]
    assert stream.state == "broken" and not stream.whole and stream.feed(', "parameters": {}}]') == []


def test_none_shows_the_tools_and_forces_nothing():
    choice = tool_choice(TOOLS, "none", None)
    assert choice is not None and not choice.forced
    assert tool_choice(None, None, None) is None and tool_choice([], "none", None) is None


@pytest.mark.parametrize("choice", [None, "auto"])  # OpenAI's default with tools is "auto"
def test_auto_forces_nothing_and_leaves_the_calls_to_the_model(choice):
    read = tool_choice(TOOLS, choice, False)
    assert read is not None and read.mode == "auto" and not read.forced
    assert read.most_calls == 1 and tool_choice(TOOLS, choice, None).most_calls is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        (TOOLS, named("nope"), None, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "time", "x": 1}}, None, "tool_choice"),
        (TOOLS, "always", None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        (None, None, True, "parallel_tool_calls"),
        ([{"type": "function", "function": {"name": "has space"}}], "required", None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], "required", None, "tools"),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], "required", None, "tools"),
        ([{"type": "code", "function": {"name": "f"}}], "required", None, "tools"),
        ([TOOLS[1], TOOLS[1]], "required", None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], named("f"), None, "tools"),
    ],
)
def test_bad_tool_requests_name_the_parameter(tools, choice, parallel, param):
    with pytest.raises(InvalidParameter) as raised:
        tool_choice(tools, choice, parallel)
    assert raised.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "12 C"}]}, "messages.0.tool_call_id"),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages.0.tool_calls",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_over_http_are_400_naming_the_parameter(tok, fields, param):
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not scheduler.submitted


def test_forced_calls_reach_the_scheduler_as_their_json_schema(tok):
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, {"tools": TOOLS, "tool_choice": named("weather")}))
    assert r.status_code == 200, r.text
    (params,) = scheduler.submitted
    assert json.loads(params.json_schema) == {**WEATHER, "additionalProperties": False}  # closed: see json_schemas
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, {"tools": TOOLS, "tool_choice": "none"}))
    assert r.status_code == 200 and scheduler.submitted[0].json_schema == ""


def test_a_conversation_with_calls_and_their_results_is_accepted(tok):
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
    ]
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, {"messages": messages, "tools": TOOLS, "tool_choice": "none"}))
    assert r.status_code == 200, r.text
    assert scheduler.submitted


def sse_deltas(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:])["choices"] for line in text.splitlines() if line.startswith("data: {")]


def test_required_calls_stream_over_http_piece_by_piece(tok):
    pieces = [ARRAY[i : i + 5] for i in range(0, len(ARRAY), 5)]
    body = body_for(CHAT, {"tools": TOOLS, "tool_choice": "required", "stream": True, "max_tokens": 200})
    r, _ = http_post(tok, CHAT, body, ScriptedScheduler(pieces))
    assert r.status_code == 200, r.text
    choices = [c[0] for c in sse_deltas(r.text) if c]
    streamed = [tc for c in choices for tc in c["delta"].get("tool_calls", [])]
    assert merged(streamed) == [(item["name"], json.dumps(item["parameters"])) for item in json.loads(ARRAY)]
    assert len(streamed) > 6 and choices[-1]["finish_reason"] == "tool_calls"
    assert not any(c["delta"].get("content") for c in choices)
    cut = ScriptedScheduler(['[{"name": "wea'], reason="length")  # no call named: the text as it is
    r, _ = http_post(tok, CHAT, body, cut)
    choices = [c[0] for c in sse_deltas(r.text) if c]
    assert "".join(c["delta"].get("content") or "" for c in choices) == '[{"name": "wea'
    assert choices[-1]["finish_reason"] == "length"


class Unit(enum.Enum):
    C = "c"
    F = "f"


class Place(pydantic.BaseModel):
    city: str
    country: str | None = None


class WeatherArgs(pydantic.BaseModel):
    place: Place
    unit: Unit


# As Pydantic (and so the Agents SDK's function_tool) writes them: $defs and #/$defs refs.
PYDANTIC_TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WeatherArgs.model_json_schema()}},
    {"type": "function", "function": {"name": "place", "parameters": Place.model_json_schema()}},
    TOOLS[1],
]
GOOD_CALLS = '[{"name": "weather", "parameters": {"place": {"city": "Oslo", "country": null}, "unit": "c"}}]'


@pytest.mark.parametrize("parallel", [None, False])
def test_required_compiles_each_tools_own_defs(tok, grammars, parallel):
    assert "$defs" in PYDANTIC_TOOLS[0]["function"]["parameters"]
    choice = tool_choice(PYDANTIC_TOOLS, "required", parallel)
    assert choice is not None
    schema = choice.schema()
    jsonschema.validate(json.loads(GOOD_CALLS), schema)
    for bad in (GOOD_CALLS.replace('"c"', '"k"'), GOOD_CALLS.replace('"city"', '"town"')):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(bad), schema)
    matcher = grammars.matcher(canonical(schema))
    matcher.push(tok.encode(GOOD_CALLS, add_special_tokens=False))
    assert matcher.allowed()[tok.eos_token_id]
    refused = grammars.matcher(canonical(schema))
    with pytest.raises(GrammarError):
        refused.push(tok.encode(GOOD_CALLS.replace('"c"', '"k"'), add_special_tokens=False))


def test_named_and_auto_take_pydantic_schemas(tok, grammars):
    named_choice = tool_choice(PYDANTIC_TOOLS, named("weather"), None)
    assert named_choice is not None and named_choice.schema() == WeatherArgs.model_json_schema()
    matcher = grammars.matcher(canonical(named_choice.schema()))
    matcher.push(tok.encode('{"place": {"city": "Oslo"}, "unit": "f"}', add_special_tokens=False))
    auto = tool_choice(PYDANTIC_TOOLS, "auto", None)
    assert auto is not None and auto.mode == "auto" and not auto.forced


def test_pydantic_tools_over_http_reach_the_scheduler_compiled(tok):
    for choice in ("required", named("weather")):
        r, scheduler = http_post(tok, CHAT, body_for(CHAT, {"tools": PYDANTIC_TOOLS, "tool_choice": choice}))
        assert r.status_code == 200, r.text
        assert schema_problem(scheduler.submitted[0].json_schema) is None
