"""n and best_of through real services: each choice its own sequence, exact under speculation.

Choice i of a seeded request is the n = 1 output for `choice_seed(seed, i)`, with speculation
on or off; streamed choices interleave, each tagged with its index; best_of keeps the
candidates with the highest cumulative target logprob; usage counts every generated token;
nothing is left open on the services, whether a request ends, fails or is abandoned. The gRPC
API's GenerationParams.n gives the choices the HTTP API gives, unary and streamed.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import httpx
import openai
import pytest
import stack as st
from stack import base_url

from gateway.api.choices import choice_seed
from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

MODEL = "target"
BASE: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "ignore_eos": True}


def post(gateway: st.Service, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base_url(gateway) + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def texts(reply: dict[str, Any]) -> list[str]:
    assert [c["index"] for c in reply["choices"]] == list(range(len(reply["choices"])))
    return [c["text"] for c in reply["choices"]]


def open_on_verifier(verifier: st.Service) -> int:
    with grpc.insecure_channel(verifier.address) as ch:
        stub = verifier_pb2_grpc.VerifierServiceStub(ch)
        return stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=5).open_sequences


def wait_none_open(verifier: st.Service, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while open_on_verifier(verifier):
        assert time.monotonic() < deadline, "the verifier still holds sequences"
        time.sleep(0.2)


@pytest.mark.parametrize("k", [0, 4])
def test_seeded_choices_are_the_single_choice_outputs_of_their_seeds(gateway_for, k):
    gateway = gateway_for(k)
    request = {**BASE, "temperature": 1.0, "seed": 11}
    reply = post(gateway, "/v1/completions", {**request, "n": 4})
    got = texts(reply)
    singles = [
        texts(post(gateway_for(0), "/v1/completions", {**request, "seed": choice_seed(11, i)}))[0] for i in range(4)
    ]
    assert got == singles
    assert singles[0] == texts(post(gateway_for(0), "/v1/completions", request))[0]  # choice 0 keeps the seed
    assert len(set(got)) == 4  # independent randomness per choice
    assert reply["usage"]["completion_tokens"] == 4 * 8
    assert reply["usage"]["prompt_tokens"] == post(gateway, "/v1/completions", request)["usage"]["prompt_tokens"]


def test_unseeded_sampled_choices_differ_and_greedy_ones_agree(gateway_for):
    gateway = gateway_for(4)
    sampled = texts(post(gateway, "/v1/completions", {**BASE, "temperature": 1.0, "n": 4}))
    assert len(set(sampled)) > 1
    greedy = texts(post(gateway, "/v1/completions", {**BASE, "temperature": 0.0, "n": 3}))
    assert greedy == [texts(post(gateway_for(0), "/v1/completions", {**BASE, "temperature": 0.0}))[0]] * 3


def test_streamed_choices_interleave_tagged_with_their_index(gateway_for):
    gateway = gateway_for(4)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 5,
        "n": 3,
    }
    whole = post(gateway, "/v1/chat/completions", body)
    client = openai.OpenAI(base_url=base_url(gateway) + "/v1", api_key="unused")
    parts: dict[int, str] = {}
    roles: dict[int, int] = {}
    finishes: dict[int, str] = {}
    order: list[int] = []
    usage = None
    sdk = {k: v for k, v in body.items() if k != "ignore_eos"}
    stream = client.chat.completions.create(
        **sdk, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            order.append(c.index)
            if c.delta.role:
                roles[c.index] = roles.get(c.index, 0) + 1
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert [parts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert roles == {0: 1, 1: 1, 2: 1} and finishes == {0: "length", 1: "length", 2: "length"}
    assert order != sorted(order)  # interleaved as they are generated, not one after another
    assert usage is not None and usage.completion_tokens == 24 == whole["usage"]["completion_tokens"]


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(gateway_for):
    gateway = gateway_for(4)
    request = {**BASE, "temperature": 1.0, "seed": 21, "logprobs": 0}
    # The candidates of best_of=5 are the n=5 choices of the same seed.
    candidates = post(gateway, "/v1/completions", {**request, "n": 5})["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in candidates]
    ranked = sorted(range(5), key=lambda i: -scores[i])
    reply = post(gateway, "/v1/completions", {**request, "n": 2, "best_of": 5})
    assert texts(reply) == [candidates[i]["text"] for i in ranked[:2]]
    assert reply["usage"]["completion_tokens"] == 5 * 8  # the dropped candidates count too
    # Without logprobs asked for, the same choices come back, without them.
    plain = post(gateway, "/v1/completions", {**BASE, "temperature": 1.0, "seed": 21, "n": 2, "best_of": 5})
    assert texts(plain) == texts(reply) and all(c["logprobs"] is None for c in plain["choices"])


def test_echo_with_logprobs_gives_every_choice_the_prompt(gateway_for):
    gateway = gateway_for(4)
    reply = post(
        gateway, "/v1/completions", {**BASE, "temperature": 1.0, "seed": 2, "n": 2, "echo": True, "logprobs": 1}
    )
    single = post(gateway, "/v1/completions", {**BASE, "temperature": 1.0, "seed": 2, "echo": True, "logprobs": 1})
    assert reply["choices"][0]["text"] == single["choices"][0]["text"]
    want = single["choices"][0]["logprobs"]
    head = len(want["tokens"]) - 8  # the echoed prompt's tokens
    for choice in reply["choices"]:
        got = choice["logprobs"]
        assert choice["text"].startswith(BASE["prompt"])
        assert got["tokens"][:head] == want["tokens"][:head]
        assert got["text_offset"] == sorted(got["text_offset"]) and len(got["tokens"]) == head + 8
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:head] == pytest.approx(want["token_logprobs"][1:head], abs=1e-4)
    assert reply["choices"][0]["logprobs"]["tokens"] == want["tokens"]


def test_abandoned_stream_frees_every_choice(gateway_for, backends):
    verifier, _ = backends
    gateway = gateway_for(4)
    body = {**BASE, "max_tokens": 200, "n": 4, "stream": True, "temperature": 1.0}
    with httpx.stream("POST", base_url(gateway) + "/v1/completions", json=body, timeout=60) as r:
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 4:
                break  # leave mid-generation
    wait_none_open(verifier)


def test_too_many_choices_are_refused_naming_the_parameter(gateway_for):
    gateway = gateway_for(4)
    for body, param in [
        ({**BASE, "n": 9}, "n"),
        ({**BASE, "n": 3, "best_of": 2}, "best_of"),
        ({**BASE, "best_of": 3, "stream": True}, "best_of"),
    ]:
        r = httpx.post(base_url(gateway) + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


GRPC_BASE: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True}


def grpc_generate(gateway: st.Service, **params: Any) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        request = gateway_pb2.GenerateRequest(
            prompt=BASE["prompt"], params=gateway_pb2.GenerationParams(**GRPC_BASE, **params)
        )
        return gateway_pb2_grpc.GatewayServiceStub(ch).Generate(request, timeout=120)


def grpc_stream(gateway: st.Service, **params: Any) -> list[gateway_pb2.GenerateStreamResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as ch:
        request = gateway_pb2.GenerateStreamRequest(
            prompt=BASE["prompt"], params=gateway_pb2.GenerationParams(**GRPC_BASE, **params)
        )
        return list(gateway_pb2_grpc.GatewayServiceStub(ch).GenerateStream(request, timeout=120))


def test_grpc_n_greedy_choices_are_the_single_choice_output(gateway_for, backends):
    gateway = gateway_for(4)
    single = grpc_generate(gateway, temperature=0.0)
    assert not single.choices  # a client that does not set n gets the reply it always got
    reply = grpc_generate(gateway, temperature=0.0, n=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [(c.text, list(c.token_ids)) for c in reply.choices] == [(single.text, list(single.token_ids))] * 2
    assert (reply.text, list(reply.token_ids)) == (single.text, list(single.token_ids))  # choice 0, as before n
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens and reply.usage.completion_tokens == 2 * 8
    wait_none_open(backends[0])


def test_grpc_n_seeded_choices_differ_reproduce_and_match_http(gateway_for, backends):
    gateway = gateway_for(4)
    sampled = {"temperature": 1.0, "seed": 11, "n": 2}
    first, second = grpc_generate(gateway, **sampled), grpc_generate(gateway, **sampled)
    got = [c.text for c in first.choices]
    assert len(got) == 2 and got[0] != got[1]  # each choice draws its own randomness
    assert [list(c.token_ids) for c in first.choices] == [list(c.token_ids) for c in second.choices]
    # The same per-choice seeds as the HTTP API: choice i is the n = 1 output of choice_seed(11, i).
    assert got == texts(post(gateway, "/v1/completions", {**BASE, **sampled}))
    assert got[1] == grpc_generate(gateway, temperature=1.0, seed=choice_seed(11, 1)).text
    streamed = grpc_stream(gateway, **sampled)
    assert {c.index for c in streamed} == {0, 1}
    for i, choice in enumerate(first.choices):
        mine = [c for c in streamed if c.index == i]
        assert "".join(c.text for c in mine) == choice.text
        assert [t for c in mine for t in c.token_ids] == list(choice.token_ids)
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert mine[-1].usage.completion_tokens == 8
    wait_none_open(backends[0])


def test_grpc_bad_n_is_invalid_argument(gateway_for):
    gateway = gateway_for(4)
    for n, call in [(9, grpc_generate), (0, grpc_generate), (9, grpc_stream)]:
        with pytest.raises(grpc.RpcError) as info:
            call(gateway, temperature=0.0, n=n)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (n, call)
        assert info.value.details().startswith("n must be"), info.value.details()
