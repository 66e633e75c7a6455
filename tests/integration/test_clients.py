"""Client libraries as people use them, unmodified, against real processes: the openai SDK's
Responses API (plain and streamed), an OpenAI Agents SDK run on its default Responses model, and a
gRPC client that knows the gateway only through reflection v1, LangChain's ChatOpenAI."""

from __future__ import annotations

import asyncio
import enum
import json
from typing import Any, Literal

import agents
import grpc
import openai
import pydantic
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2
from langchain_openai import ChatOpenAI
from stack import base_url

MODEL = "target"


@pytest.fixture(scope="module")
def gateway(gateway_for):
    return gateway_for(4)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(gateway) + "/v1", api_key="unused", max_retries=0)


def test_responses_create_is_the_chat_completion_of_the_same_conversation(client):
    """Greedy, so the Responses reply is the chat reply token for token (the same path under it)."""
    common = {"model": MODEL, "temperature": 0}
    response = client.responses.create(**common, instructions="Be brief", input="Hello there", max_output_tokens=12)
    chat = client.chat.completions.create(
        **common,
        messages=[{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_responses_stream_events_add_up_to_the_whole_reply(client):
    common = {"model": MODEL, "temperature": 0, "input": "Tell me a story", "max_output_tokens": 16}
    whole = client.responses.create(**common)
    events = list(client.responses.create(**common, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]
    if kinds[-1] == "response.incomplete":  # cut by max_output_tokens, as OpenAI reports it
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


class Answer(pydantic.BaseModel):
    verdict: Literal["yes", "no"]
    sure: bool


def test_responses_parse_and_the_sdk_stream_helper_with_a_pydantic_format(client):
    """A closed schema ends the output with the object (no string to run on), so both complete."""
    common = {"model": MODEL, "temperature": 0, "input": "Is Oslo in Norway?", "max_output_tokens": 64}
    parsed = client.responses.parse(**common, text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer) and parsed.status == "completed"
    with client.responses.stream(**common, text_format=Answer) as stream:  # the SDK's accumulating helper
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed


class Unit(enum.Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


def test_an_agents_sdk_run_calls_an_enum_argument_tool_under_required(gateway):
    """The Agents SDK's default model is the Responses API; its function_tool writes the Enum as $defs."""
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise
    calls: list[tuple[str, Unit]] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Bergen"], unit: Unit) -> str:
        """The weather in a city."""
        calls.append((city, unit))
        return f"12 degrees {unit.value} in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=base_url(gateway) + "/v1", api_key="unused")
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        model=model,
        tools=[get_weather],
        # Every argument an enum and one call: the random-weight model's call ends within max_tokens.
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=64, temperature=0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    assert "$defs" in json.dumps(get_weather.params_json_schema)

    async def both() -> tuple[Any, Any]:
        whole = await agents.Runner.run(agent, "Weather in Oslo?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Oslo?")
        kinds = [event.type async for event in streamed.stream_events()]
        assert "raw_response_event" in kinds
        return whole, streamed

    whole, streamed = asyncio.run(both())
    assert len(calls) == 2 and all(isinstance(unit, Unit) for _, unit in calls)
    assert calls[0] == calls[1]  # greedy: the streamed run made the same call
    assert whole.final_output == streamed.final_output == f"12 degrees {calls[0][1].value} in {calls[0][0]}"


def test_a_grpc_client_finds_and_calls_the_gateway_by_reflection_v1(gateway):
    """As grpcurl does: list the services and fetch their descriptors over grpc.reflection.v1 (the
    messages are v1alpha's fields under v1's name), then call Generate from those descriptors alone."""
    method = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        ask = channel.stream_stream(
            method,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        (listed,) = ask(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for s in listed.list_services_response.service}
        assert {"speculative.v1.GatewayService", "grpc.reflection.v1.ServerReflection"} <= names
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="speculative.v1.GatewayService")
        (files,) = ask(iter([request]), timeout=10)
        pool = descriptor_pool.DescriptorPool()
        protos = [
            descriptor_pb2.FileDescriptorProto.FromString(b)
            for b in files.file_descriptor_response.file_descriptor_proto
        ]
        while protos:  # dependencies first
            ready = [p for p in protos if all(_has_file(pool, d) for d in p.dependency)]
            assert ready, "reflection left out a dependency"
            for p in ready:
                pool.Add(p)
                protos.remove(p)
        service = pool.FindServiceByName("speculative.v1.GatewayService")
        generate = service.FindMethodByName("Generate")
        request_class = message_factory.GetMessageClass(generate.input_type)
        response_class = message_factory.GetMessageClass(generate.output_type)
        call = channel.unary_unary(
            "/speculative.v1.GatewayService/Generate",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        reply = call(request_class(model=MODEL, prompt="Hello", params={"max_tokens": 4}), timeout=60)
        assert reply.usage.completion_tokens == 4 and len(reply.token_ids) == 4


def _has_file(pool: descriptor_pool.DescriptorPool, name: str) -> bool:
    try:
        pool.FindFileByName(name)
    except KeyError:
        return False
    return True


def test_vllm_extra_body_fields_through_the_services(client, tok):
    """min_tokens holds end-of-sequence back (biased to win at once) exactly under speculation;
    models.retrieve answers the served model."""
    assert client.models.retrieve(MODEL).id == MODEL
    outputs = []
    for k in (0, 4):
        reply = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=12,
            temperature=0,
            logit_bias={str(tok.eos_token_id): 100},
            extra_body={"min_tokens": 6, "num_speculative_tokens": k},
        )
        assert reply.choices[0].finish_reason == "stop" and reply.usage is not None
        outputs.append((reply.choices[0].text, reply.usage.completion_tokens))
    assert outputs[0] == outputs[1] and outputs[0][1] == 7  # six tokens, then the end-of-sequence


class Forecast(pydantic.BaseModel):
    """The forecast for a city."""

    city: Literal["Oslo", "Bergen"]
    unit: Unit
    daily: bool


def test_langchain_bind_tools_any_on_a_non_strict_tool_returns_valid_calls(gateway):
    """LangChain's tool_choice="any" is "required"; its non-strict schema says nothing about other
    keys, which the gateway's default (closed objects) keeps the model from inventing."""
    url = base_url(gateway) + "/v1"
    chat = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=64, max_retries=0)
    reply = chat.bind_tools([Forecast], tool_choice="any", parallel_tool_calls=False).invoke("Forecast for Oslo?")
    assert not reply.invalid_tool_calls
    (call,) = reply.tool_calls
    assert call["name"] == "Forecast"
    Forecast.model_validate(call["args"])
    via_responses = ChatOpenAI(
        model=MODEL, base_url=url, api_key="unused", temperature=0, max_tokens=8, max_retries=0, use_responses_api=True
    ).invoke("Hello")
    plain = chat.bind(max_tokens=8).invoke("Hello")
    assert via_responses.text == plain.text  # the same path under both APIs
