"""Client JSON Schemas as the grammar engine gets them: undeclared keys (closed by default,
as vLLM's default backend) and tools' own $defs (relocated)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import pytest
from api_harness import CHAT, MODEL, RefusingScheduler, body_for

from gateway.api.json_schemas import closed, has_local_ref, relocated
from gateway.api.openai_api import OpenAIApi
from gateway.api.validation import json_schema
from specd.engine.grammar import GrammarError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
        "free": {"type": "object"},
        "const": {"const": {"properties": {"x": {}}}},
    },
}


def test_closed_forbids_undeclared_keys_unless_the_schema_allows_them():
    schema = closed(PERSON)
    good = {"name": "a", "address": {"city": "b"}, "tags": [{"k": "v"}], "extra": {"a": 1, "more": 2}, "free": {"x": 1}}
    jsonschema.validate(good, schema)
    jsonschema.validate({**good, "nickname": "x"}, PERSON)  # JSON Schema's own reading allows it
    for bad in ({**good, "nickname": "x"}, {**good, "address": {"city": "b", "zip": 1}}, {**good, "tags": [{"j": 1}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert schema["properties"]["const"] == PERSON["properties"]["const"]  # data, not a schema
    assert "additionalProperties" not in schema["properties"]["free"]  # lists nothing: any object
    assert PERSON["properties"]["address"] == {"type": "object", "properties": {"city": {"type": "string"}}}


def test_closed_leaves_objects_split_across_all_of_open():
    split = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "properties": {"a": {}, "b": {}}}
    jsonschema.validate({"a": 1, "b": 2}, closed(split))
    assert closed(split) == split


def test_relocated_refs_point_into_the_new_place():
    schema = {"$defs": {"U": {"enum": ["c"]}}, "properties": {"u": {"$ref": "#/$defs/U"}, "me": {"$ref": "#"}}}
    moved = relocated(schema, "tool")
    assert moved["properties"]["u"]["$ref"] == "#/$defs/tool/$defs/U"
    assert moved["properties"]["me"]["$ref"] == "#/$defs/tool"
    assert has_local_ref(schema) and not has_local_ref({"properties": {"u": {"enum": [{"$ref": "#"}]}}})


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


@pytest.mark.parametrize("undeclared", [False, True])
def test_the_grammar_allows_undeclared_keys_only_when_asked(tok, grammars, undeclared):
    text = json_schema(response_format(PERSON), undeclared_keys=undeclared)
    extra = tok.encode('{"name": "a", "nickname": "b"}', add_special_tokens=False)
    if undeclared:
        grammars.matcher(text).push(extra)
    else:
        with pytest.raises(GrammarError):
            grammars.matcher(text).push(extra)
    grammars.matcher(text).push(tok.encode('{"name": "a", "free": {"x": 1}}', add_special_tokens=False))


@pytest.mark.parametrize("undeclared", [False, True])
def test_the_gateway_flag_reaches_response_format_and_forced_tools(tok, undeclared):
    tool = {"type": "function", "function": {"name": "f", "parameters": PERSON}}
    for fields in (
        {"response_format": response_format(PERSON)},
        {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}},
    ):
        scheduler = RefusingScheduler()
        app = OpenAIApi(scheduler, tok, MODEL, health=None, undeclared_keys=undeclared).app()  # type: ignore[arg-type]

        async def go(app=app, fields=fields) -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
                return await client.post(CHAT, json=body_for(CHAT, fields))

        r = asyncio.run(go())
        assert r.status_code == 200, r.text
        sent = json.loads(scheduler.submitted[0].json_schema)
        assert ("additionalProperties" in sent) is not undeclared
