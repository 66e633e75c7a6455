"""Structured output through real services: every reply parses and validates.

The tiny models have random weights, so left alone they write garbage; only the grammar can
make their output valid JSON, which makes this a real test of the masks. Greedy and seeded
outputs must also be the same with speculation on and off (the masked target distribution is
the one sampled from), and the drafter, masked by the same grammar, must be mostly accepted.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
import stack as st
import tinymodels

from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

MODEL = "target"
MAX_TOKENS = 160

S = {"type": "string", "maxLength": 8}
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
        },
        "required": ["color", "hex"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "string", "pattern": "^[a-z]{3,6}$"},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "boolean"},
    {"type": "null"},
    {"const": {"version": 1}},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000}, "tag": S},
                "required": ["id", "tag"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "boolean"}, {"type": "string", "maxLength": 4}]},
    {
        "type": "object",
        "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["kind", "x"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"items": {"type": "array", "items": S, "maxItems": 2}},
        "required": ["items"],
        "additionalProperties": False,
    },
    {"type": "string", "format": "date"},
    {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["a", "b"]}],
        "items": False,
    },
    {
        "type": "object",
        "properties": {"a": {"type": "null"}, "b": {"enum": [1, 2, 3]}, "c": {"type": "boolean"}},
        "required": ["a", "b", "c"],
        "additionalProperties": False,
    },
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"q": {"type": "string", "enum": ["x", "y"]}},
        "required": ["q"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Is it raining?",
    "Pick a colour.",
    "Some small numbers:",
    "Flags:",
    "Answer yes, no or maybe.",
    "A short word:",
    "A two-digit number:",
    "True or false?",
    "Nothing:",
    "The version object:",
    "A user record:",
    "Either:",
    "A point:",
    "A list of items:",
    "A date:",
    "A pair:",
    "Three fields:",
    "Zero to three, or null:",
    "Pick x or y.",
]
SAMPLINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234},
    "sampled": {"temperature": 1.0},
}


@pytest.fixture(scope="module")
def close_stack(tmp_path_factory, tok, tiny_target, model_dirs, log_dir):
    """A drafter close to the target, so drafts are accepted and rejected both."""
    draft = tinymodels.save(tinymodels.perturbed(tiny_target, 0.02, seed=3), tok, tmp_path_factory.mktemp("close"))
    s = st.start_stack(model_dirs["target"], draft, log_dir, k=4)
    yield s
    s.stop()


def response_format(i: int) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": f"schema_{i}", "schema": SCHEMAS[i], "strict": True}}


def chat(stack: st.Stack, i: int, sampling: dict[str, Any], k: int, pipeline: str = "sequential") -> dict[str, Any]:
    body = {
        "pipeline": pipeline,
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[i]}],
        "max_tokens": MAX_TOKENS,
        "response_format": response_format(i),
        "num_speculative_tokens": k,
        **sampling,
    }
    r = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def accepted_and_drafted(stack: st.Stack) -> tuple[float, float]:
    values = {}
    for line in httpx.get(stack.base_url + "/metrics").text.splitlines():
        for name in ("specd_spec_decode_num_accepted_tokens_total", "specd_spec_decode_num_draft_tokens_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[-1])
    return values["specd_spec_decode_num_accepted_tokens_total"], values["specd_spec_decode_num_draft_tokens_total"]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_every_output_parses_and_validates_with_speculation_on_and_off(close_stack, sampling):
    replies: dict[tuple[int, str], list[str]] = {}
    accepted0, drafted0 = accepted_and_drafted(close_stack)
    # Draft-ahead too: its drafter follows assumed tokens, which the grammar must roll back.
    runs = [(0, "sequential"), (4, "sequential")] + ([(4, "ahead")] if sampling != "sampled" else [])
    for k, pipeline in runs:
        with ThreadPoolExecutor(4) as pool:
            choices = list(
                pool.map(
                    lambda i, k=k, p=pipeline: chat(close_stack, i, SAMPLINGS[sampling], k, p), range(len(SCHEMAS))
                )
            )
        for i, choice in enumerate(choices):
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop", (i, text)
            jsonschema.validate(json.loads(text), SCHEMAS[i])
        replies[k, pipeline] = [c["message"]["content"] for c in choices]
    if sampling != "sampled":
        # Greedy and seeded: exactly what target-only constrained decoding emits.
        assert replies[4, "sequential"] == replies[0, "sequential"]
        assert replies[4, "ahead"] == replies[0, "sequential"]
    accepted, drafted = accepted_and_drafted(close_stack)
    assert drafted > drafted0 and (accepted - accepted0) / (drafted - drafted0) > 0.5


def test_openai_sdk_json_schema_and_json_object(close_stack, tok):
    client = openai.OpenAI(base_url=close_stack.base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "A user record as JSON."}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, response_format=response_format(11)
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS[11])
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=response_format(11),
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == (
        reply.choices[0].message.content
    )
    # json_object: any JSON object. Pushed hard towards "}", the reply is "{}" and then EOS,
    # the only token the grammar allows after it; a random model left alone may nest for long,
    # so only what finishes must parse.
    close = str(tok.convert_tokens_to_ids("}"))
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        logit_bias={close: 100},
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert json.loads(reply.choices[0].message.content) == {}
    for seed in range(2):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=48,
            temperature=0.8,
            seed=seed,
            response_format={"type": "json_object"},
        )
        choice = reply.choices[0]
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schemas": {}}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_response_formats_are_400_naming_the_parameter(close_stack, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}
    r = httpx.post(close_stack.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_grpc_json_schema(close_stack):
    """GenerationParams.json_schema constrains as response_format does; bad schemas are INVALID_ARGUMENT."""
    prompt = "A user record:"
    params = gateway_pb2.GenerationParams(max_tokens=MAX_TOKENS, temperature=0, json_schema=json.dumps(SCHEMAS[11]))
    with grpc.insecure_channel(f"127.0.0.1:{close_stack.gateway.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        reply = stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=300)
        assert reply.finish_reason == gateway_pb2.FINISH_REASON_STOP
        jsonschema.validate(json.loads(reply.text), SCHEMAS[11])
        for bad in ("{not json", '{"type": "nope"}'):
            params = gateway_pb2.GenerationParams(max_tokens=4, json_schema=bad)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# vLLM's guided_regex and guided_choice: bounded patterns, so a random model's output ends.
GUIDED: list[tuple[str, dict[str, Any]]] = [
    ("A date:", {"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}),
    ("A code:", {"guided_regex": r"[A-Z]{2,3}-[0-9]{1,4}"}),
    ("Yes or no?", {"guided_regex": r"(yes|no)[.!]"}),
    ("Pick a colour.", {"guided_choice": ["red", "green", "blue"]}),
    ("Quote:", {"guided_choice": ['say "hi"', "a\\b", "x/y", "naïve"]}),
    ("Size?", {"guided_choice": ["S", "M", "L", "XL", "XXL"]}),
]


def guided_ok(text: str, fields: dict[str, Any]) -> bool:
    if "guided_regex" in fields:
        return re.fullmatch(fields["guided_regex"], text) is not None
    return text in fields["guided_choice"]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_guided_regex_and_choice_hold_with_speculation_on_and_off(close_stack, sampling, endpoint):
    def run(k: int) -> list[str]:
        out = []
        for prompt, fields in GUIDED:
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 48, "num_speculative_tokens": k}
            body |= (
                {"prompt": prompt} if endpoint == "completions" else {"messages": [{"role": "user", "content": prompt}]}
            )
            r = httpx.post(
                f"{close_stack.base_url}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                json={**body, **fields, **SAMPLINGS[sampling]},
                timeout=300,
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and guided_ok(text, fields), (fields, text)
            out.append(text)
        return out

    off, on = run(0), run(4)
    if sampling != "sampled":
        assert on == off  # greedy and seeded: what target-only guided decoding emits


def test_guided_choice_with_several_sampled_choices(close_stack):
    fields = GUIDED[5][1]
    # Seeded, so the response is reproducible: unseeded, all 8 choices once drew the same size.
    # Each choice gets a seed of its own (gateway.api.choices), so they still differ.
    body = {"model": MODEL, "prompt": "Size?", "max_tokens": 8, "temperature": 1.5, "n": 8, "seed": 11, **fields}
    r = httpx.post(close_stack.base_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert all(t in fields["guided_choice"] for t in texts) and len(set(texts)) > 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_regex": "(?=a)b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": "red"}, "guided_choice"),
        ({"guided_choice": ["a"], "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_guided_fields_are_400_naming_the_parameter(close_stack, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}
    r = httpx.post(close_stack.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_grpc_guided_regex_and_choice(close_stack):
    with grpc.insecure_channel(f"127.0.0.1:{close_stack.gateway.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for prompt, fields in GUIDED[1:5]:
            params = gateway_pb2.GenerationParams(max_tokens=48, temperature=0.8, seed=5, **fields)
            reply = stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=300)
            assert reply.finish_reason == gateway_pb2.FINISH_REASON_STOP and guided_ok(reply.text, fields)
        bad = gateway_pb2.GenerationParams(max_tokens=4, guided_regex="a+", guided_choice=["a"])
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(gateway_pb2.GenerateRequest(prompt="x", params=bad), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "guided_choice" in caught.value.details()


# -- tool calling: calls forced by grammar -------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "paint", "description": "Pick a colour", "parameters": SCHEMAS[2]}},
    {"type": "function", "function": {"name": "point", "parameters": SCHEMAS[13]}},
]


def test_openai_sdk_named_and_required_tool_calls_stream_and_not(close_stack):
    client = openai.OpenAI(base_url=close_stack.base_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Paint something."}]
    common: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    named = {"type": "function", "function": {"name": "paint"}}
    for k in (0, 4):
        reply = client.chat.completions.create(
            **common, tools=TOOLS, tool_choice=named, extra_body={"num_speculative_tokens": k}
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None  # as OpenAI answers a named call
        (call,) = choice.message.tool_calls
        assert call.function.name == "paint" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[2])
        if k == 0:
            arguments = call.function.arguments
        assert call.function.arguments == arguments  # greedy: the same with speculation
    chunks = [c for c in client.chat.completions.create(**common, tools=TOOLS, tool_choice=named, stream=True)]
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # The arguments come in pieces as they are generated; the first piece brings the call's id and name.
    assert len(streamed) > 1 and streamed[0].id and streamed[0].function.name == "paint"
    assert all(tc.index == 0 and tc.id is None and tc.function.name is None for tc in streamed[1:])
    assert "".join(tc.function.arguments for tc in streamed) == arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    cut = client.chat.completions.create(**common | {"max_tokens": 3}, tools=TOOLS, tool_choice=named)
    assert cut.choices[0].finish_reason == "length"
    assert arguments.startswith(cut.choices[0].message.tool_calls[0].function.arguments)

    for parallel in (False, True):
        reply = client.chat.completions.create(
            **common, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        stream = client.chat.completions.create(
            **common, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, stream=True
        )
        streamed = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        # Each call's id and name once its name is whole, then its arguments in pieces as generated.
        assert len(streamed) > len(calls)
        merged: list[list[str]] = []
        for tc in streamed:
            if tc.id is not None:
                assert tc.index == len(merged) and tc.function.name
                merged.append([tc.function.name, tc.function.arguments or ""])
            else:
                assert tc.index == len(merged) - 1 and tc.function.name is None
                merged[-1][1] += tc.function.arguments
        assert merged == [[c.function.name, c.function.arguments] for c in calls]


def test_a_tool_result_goes_back_to_the_model(close_stack):
    """The call, and what the tool answered, are part of the next request's conversation."""
    call = {"id": "call_1", "type": "function", "function": {"name": "paint", "arguments": '{"color": "red"}'}}
    messages = [
        {"role": "user", "content": "Paint something."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "painted"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, "tools": TOOLS}
    replies = []
    for tool_result in ("painted", "the paint ran out"):
        messages[2]["content"] = tool_result
        r = httpx.post(close_stack.base_url + "/v1/chat/completions", json=body | {"tool_choice": "none"}, timeout=60)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert "tool_calls" not in message
        replies.append(r.json()["usage"]["prompt_tokens"])
    assert replies[0] != replies[1]  # the tool's answer is in the prompt
    r = httpx.post(close_stack.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # "auto": no parser
    assert "chat template" in r.json()["error"]["message"]  # and a template that drops the tools


def test_auto_tool_calls_are_read_from_what_the_model_writes(close_stack, model_dirs, log_dir):
    """A second gateway over the same services, with the hermes parser. The random-weight target
    writes a call only when made to, so a regex makes its text one hermes block after a sentence;
    the gateway must read the call out of it, whole and streamed, with speculation on and off."""
    args = ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4", "--tool-call-parser", "hermes"]
    # The target's own (SmolLM2's) template drops tools, which refuses "auto": serve one that renders them.
    args += ["--chat-template", str(Path(__file__).resolve().parents[1] / "tools_chat_template.jinja")]
    gateway = st.start_gateway(close_stack.verifier, close_stack.drafter, args, log_dir)
    try:
        client = openai.OpenAI(base_url=st.base_url(gateway) + "/v1", api_key="unused", max_retries=0)
        block = r'<tool_call>\{"name": "paint", "arguments": \{"color": "(red|green|blue)", "hex": "#[0-9a-f]{6}"\}\}'
        common: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Paint something."}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "tools": TOOLS,  # no tool_choice: OpenAI's default with tools, "auto"
        }
        forced = {"guided_regex": r"Let me paint\.\n" + block + "</tool_call>"}
        arguments = None
        for k in (0, 4):
            reply = client.chat.completions.create(**common, extra_body=forced | {"num_speculative_tokens": k})
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me paint."
            (call,) = choice.message.tool_calls
            assert call.function.name == "paint" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[2])
            arguments = arguments or call.function.arguments
            assert call.function.arguments == arguments  # greedy: the same with speculation
        chunks = list(client.chat.completions.create(**common, stream=True, extra_body=forced))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "Let me paint."
        streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert [(tc.index, tc.function.name, tc.function.arguments) for tc in streamed] == [(0, "paint", arguments)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        # Text with no whole block stays text, as the model wrote it.
        cut = client.chat.completions.create(**common, extra_body={"guided_regex": "Maybe " + block})
        assert cut.choices[0].finish_reason == "stop" and not cut.choices[0].message.tool_calls
        assert cut.choices[0].message.content.startswith('Maybe <tool_call>{"name": "paint"')
    finally:
        gateway.stop()
