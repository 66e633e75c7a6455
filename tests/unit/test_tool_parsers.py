"""tool_choice "auto": calls read out of the model's text (the hermes parser), whole and streamed."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any

import httpx
import pytest
from api_harness import CHAT, MODEL, RefusingScheduler, ScriptedScheduler, body_for, http_post, with_tools_template

from gateway.api.chat_templates import tools_problem
from gateway.api.openai_api import OpenAIApi
from gateway.api.tool_calls import tool_choice
from gateway.api.tool_parsers import CallStream, ParserUnusable, check_tokenizer, read_calls
from gateway.api.validation import InvalidParameter

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time"}},
]
AUTO = tool_choice(TOOLS, "auto", None)
ONE = tool_choice(TOOLS, "auto", False)
WEATHER = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'


def read(text: str, choice=AUTO) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = read_calls("hermes", choice, text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text",
    [
        "Plain text.",
        "  leading and trailing space \n\n",
        "",
        "a < b, and <tool is not a tag",
        "cut short: <tool_ca",
        'cut short inside: <tool_call>{"name": "weather", "argu',
        "<tool_call>not json</tool_call> and after",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',  # not a declared tool
        '<tool_call>{"name": "weather", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"arguments": {}}</tool_call>',
        "<tool_call>[]</tool_call>",
    ],
)
def test_text_without_a_whole_call_is_kept_exactly(text):
    assert read(text) == (text, [])


def test_a_call_alone_has_no_content():
    assert read(WEATHER) == (None, [("weather", {"city": "Oslo"})])
    _, calls = read_calls("hermes", AUTO, WEATHER)
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_text_before_and_between_calls_is_content_and_separators_are_not():
    text = f"Let me look that up.\n\n{WEATHER}\n{TIME}\n"
    assert read(text) == ("Let me look that up.", [("weather", {"city": "Oslo"}), ("time", {})])
    assert read(f"{WEATHER}\nDone: {TIME}") == ("Done:", [("weather", {"city": "Oslo"}), ("time", {})])


def test_other_shapes_of_a_call():
    items = '[{"name": "time", "arguments": {}}, {"name": "weather", "parameters": {"city": "Rome"}}]'
    array = f"<tool_call>{items}</tool_call>"
    assert read(array) == (None, [("time", {}), ("weather", {"city": "Rome"})])
    as_string = '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert read(as_string) == (None, [("weather", {"city": "Oslo"})])
    assert read('<tool_call>{"name": "time"}</tool_call>') == (None, [("time", {})])


def test_parallel_tool_calls_false_lets_one_call_out_and_keeps_the_rest_as_text():
    assert read(f"{WEATHER}\n{TIME}", ONE) == (TIME, [("weather", {"city": "Oslo"})])
    two = '<tool_call>[{"name": "time"}, {"name": "time"}]</tool_call>'
    assert read(two, ONE) == (two, [])


SAMPLES = [
    f"Checking.\n{WEATHER}\n{TIME}",
    f"{WEATHER}  trailing words <tool_c",
    "no calls < <tool_call <tool_call> unclosed",
    f"<tool_call>bad</tool_call>{TIME}\n\n",
    "  spaces\n then text \n",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_a_stream_cut_anywhere_reads_as_the_whole_text_does(text):
    whole = read(text)
    rng = random.Random(len(text))
    for trial in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        if trial == 0:
            cuts = list(range(1, len(text)))  # one character at a time
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = CallStream(["weather", "time"])
        out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
        content = "".join(p.text for p in out)
        calls = [(p.call["function"]["name"], json.loads(p.call["function"]["arguments"])) for p in out if p.call]
        assert ((content or None) if calls else content, calls) == whole, pieces


def test_a_stream_lets_content_out_as_soon_as_it_cannot_begin_a_call():
    stream = CallStream(["time"])
    assert [p.text for p in stream.feed("Hello <to")] == ["Hello"]  # the space waits for what follows
    assert [p.text for p in stream.feed("ol")] == []
    assert [p.text for p in stream.feed("s are fine")] == [" <tools are fine"]


def test_the_tokenizer_must_give_the_tags_back_as_text(tok):
    check_tokenizer("hermes", tok)  # the embedded tokenizer spells them out
    special = copy.deepcopy(tok)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    with pytest.raises(ParserUnusable, match="tool_call"):
        check_tokenizer("hermes", special)


AUTO_BODY = {"tools": TOOLS, "max_tokens": 64}


def test_auto_without_a_parser_is_a_400_that_names_the_flag(tok):
    r, scheduler = http_post(with_tools_template(tok), CHAT, body_for(CHAT, AUTO_BODY))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--tool-call-parser" in r.json()["error"]["message"] and not scheduler.submitted


def test_auto_replies_carry_the_calls_the_model_wrote(tok):
    pieces = ["I will check.", "\n<tool", '_call>\n{"name": "weather", ']
    pieces.append('"arguments": {"city": "Oslo"}}\n</tool_call>')
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, AUTO_BODY), ScriptedScheduler(pieces), "hermes")
    assert r.status_code == 200, r.text
    assert scheduler.submitted[0].json_schema == ""  # nothing forced
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    r, _ = http_post(tok, CHAT, body_for(CHAT, AUTO_BODY), ScriptedScheduler(["Just text."]), "hermes")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Just text."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    cut = ScriptedScheduler(["<tool_call>", '{"name": "wea'], reason="length")
    r, _ = http_post(tok, CHAT, body_for(CHAT, AUTO_BODY), cut, "hermes")
    assert r.json()["choices"][0]["message"]["content"] == '<tool_call>{"name": "wea'
    assert r.json()["choices"][0]["finish_reason"] == "length"


def sse_chunks(text: str) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_auto_streams_content_then_each_call_when_its_block_closes(tok):
    pieces = ["Sure", ".\n<tool_", 'call>{"name": "time"}</tool_call>\n', "<tool_call>", WEATHER[len("<tool_call>") :]]
    r, _ = http_post(tok, CHAT, body_for(CHAT, AUTO_BODY | {"stream": True}), ScriptedScheduler(pieces), "hermes")
    assert r.status_code == 200, r.text
    deltas = [c["choices"][0]["delta"] for c in sse_chunks(r.text)]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "time", "{}"),
        (1, "weather", '{"city": "Oslo"}'),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert sse_chunks(r.text)[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_is_refused_naming_a_template_that_drops_tools(tok):
    """The embedded SmolLM2 template renders neither tools nor calls: "auto" could never call."""
    assert "does not render `tools`" in tools_problem(tok)
    assert tools_problem(with_tools_template(tok)) == ""
    scheduler = RefusingScheduler()
    app = OpenAIApi(scheduler, tok, MODEL, health=None, tool_parser="hermes").app()  # type: ignore[arg-type]

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as client:
            return await client.post(CHAT, json=body_for(CHAT, AUTO_BODY))

    r = asyncio.run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "chat template" in r.json()["error"]["message"] and tok.name_or_path in r.json()["error"]["message"]
    assert not scheduler.submitted
    for forced in ("required", {"type": "function", "function": {"name": "weather"}}):
        r, _ = http_post(tok, CHAT, body_for(CHAT, AUTO_BODY | {"tool_choice": forced}))
        assert r.status_code == 200, r.text


STRICT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "loose", "parameters": {"type": "object", "required": ["x"]}}},
]


@pytest.mark.parametrize(
    ("arguments", "a_call"),
    [({"city": "Oslo"}, True), ({}, False), ({"city": 3}, False), ({"city": "Oslo", "extra": 1}, False)],
)
def test_a_strict_functions_call_is_a_call_only_if_its_arguments_match(arguments, a_call):
    text = json.dumps({"name": "weather", "arguments": arguments})
    block = f"<tool_call>{text}</tool_call>"
    content, calls = read(block, tool_choice(STRICT_TOOLS, "auto", None))
    assert (calls == [("weather", arguments)]) if a_call else (content == block and calls == [])


def test_a_functions_call_is_not_validated_unless_it_is_strict():
    block = '<tool_call>{"name": "loose", "arguments": {}}</tool_call>'
    assert read(block, tool_choice(STRICT_TOOLS, "auto", None)) == (None, [("loose", {})])


def test_a_strict_function_with_a_schema_that_cannot_validate_is_a_400():
    bad = [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "objet"}}}]
    with pytest.raises(InvalidParameter, match=r"tools\[0\]\.function\.parameters is not a JSON Schema"):
        tool_choice(bad, "auto", None)


def test_auto_replies_leave_an_invalid_strict_call_in_the_content(tok):
    body = {**AUTO_BODY, "tools": STRICT_TOOLS}
    wrong = '<tool_call>{"name": "weather", "arguments": {"town": "Oslo"}}</tool_call>'
    r, _ = http_post(tok, CHAT, body_for(CHAT, body), ScriptedScheduler([wrong]), "hermes")
    (choice,) = r.json()["choices"]
    assert choice["message"] == {"role": "assistant", "content": wrong}
    assert choice["finish_reason"] == "stop"
