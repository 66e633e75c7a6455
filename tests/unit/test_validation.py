"""One table of bad parameters, refused alike over HTTP (400, OpenAI error body) and gRPC
(INVALID_ARGUMENT), through the gateway's API layers over a scheduler that must never
see them."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest
from api_harness import (
    CHAT,
    COMPLETIONS,
    MODEL,
    GatewayScheduler,
    body_for,
    grpc_generate,
    grpc_generate_stream,
    http_post,
)

from gateway.api.validation import RequestedParams, generation_params
from specd.engine.params import LogprobsRequest

NO_GRPC = None  # the proto's own type cannot carry this value
NO_HTTP = None  # a gRPC-only parameter (HTTP's echo is its completions-only form)

# (parameter named in the refusal, HTTP body fields, endpoint, gRPC GenerationParams fields)
BAD: list[tuple[str, dict[str, Any] | None, str, dict[str, Any] | None]] = [
    ("temperature", {"temperature": math.inf}, COMPLETIONS, {"temperature": math.inf}),
    ("temperature", {"temperature": 1e300}, CHAT, {"temperature": 1e300}),
    ("temperature", {"temperature": math.nan}, COMPLETIONS, {"temperature": math.nan}),
    ("temperature", {"temperature": -0.5}, CHAT, {"temperature": -0.5}),
    ("temperature", {"temperature": 101.0}, COMPLETIONS, {"temperature": 101.0}),
    ("top_p", {"top_p": 0.0}, COMPLETIONS, {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}, CHAT, {"top_p": 1.5}),
    ("top_k", {"top_k": 2**31}, COMPLETIONS, NO_GRPC),
    ("top_k", {"top_k": 2**40}, CHAT, NO_GRPC),
    ("top_k", {"top_k": -100}, COMPLETIONS, {"top_k": -100}),
    ("min_p", {"min_p": -0.01}, CHAT, {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}, COMPLETIONS, {"min_p": 1.5}),
    ("min_p", {"min_p": math.nan}, CHAT, {"min_p": math.nan}),
    ("max_tokens", {"max_tokens": 0}, COMPLETIONS, {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}, CHAT, NO_GRPC),
    ("max_tokens", {"max_tokens": 2**31}, COMPLETIONS, NO_GRPC),
    ("max_completion_tokens", {"max_tokens": 5, "max_completion_tokens": 7}, CHAT, NO_GRPC),
    ("seed", {"seed": -1}, COMPLETIONS, NO_GRPC),
    ("seed", {"seed": 2**64}, CHAT, NO_GRPC),
    ("presence_penalty", {"presence_penalty": 2.5}, CHAT, {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": math.inf}, COMPLETIONS, {"presence_penalty": math.inf}),
    ("frequency_penalty", {"frequency_penalty": -3.0}, COMPLETIONS, {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}, CHAT, {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}, COMPLETIONS, {"repetition_penalty": -1.0}),
    ("logit_bias", {"logit_bias": {"5": 101.0}}, CHAT, {"logit_bias": {5: 101.0}}),
    ("logit_bias", {"logit_bias": {"5": -math.inf}}, COMPLETIONS, {"logit_bias": {5: -math.inf}}),
    ("logit_bias", {"logit_bias": {"99999999": 1.0}}, COMPLETIONS, {"logit_bias": {99999999: 1.0}}),
    ("logit_bias", {"logit_bias": {"-1": 1.0}}, CHAT, {"logit_bias": {-1: 1.0}}),
    ("logit_bias", {"logit_bias": {"dog": 1.0}}, CHAT, NO_GRPC),
    (
        "logit_bias",
        {"logit_bias": {str(i): 1.0 for i in range(301)}},
        CHAT,
        {"logit_bias": dict.fromkeys(range(301), 1.0)},
    ),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}, CHAT, {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": 2}, CHAT, {"top_logprobs": 2}),
    ("prompt_logprobs", NO_HTTP, CHAT, {"prompt_logprobs": True}),
    ("logprobs", {"logprobs": 6}, COMPLETIONS, NO_GRPC),
    ("logprobs", {"logprobs": -1}, COMPLETIONS, NO_GRPC),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}, CHAT, {"stop": ["a", "b", "c", "d", "e"]}),
    ("n", {"n": 0}, CHAT, {"n": 0}),
    ("n", {"n": 9}, CHAT, {"n": 9}),
    ("n", {"n": 2**31}, COMPLETIONS, {"n": 2**31}),
    ("n", {"n": 2.5}, COMPLETIONS, NO_GRPC),
    ("best_of", {"best_of": 9}, COMPLETIONS, NO_GRPC),
    ("best_of", {"n": 3, "best_of": 2}, COMPLETIONS, NO_GRPC),
    ("best_of", {"best_of": 2, "stream": True}, COMPLETIONS, NO_GRPC),
    ("num_speculative_tokens", {"num_speculative_tokens": -1}, COMPLETIONS, NO_GRPC),
    ("speculative_siblings", {"speculative_siblings": -1}, CHAT, NO_GRPC),
    ("speculative_siblings", {"speculative_siblings": "two"}, COMPLETIONS, NO_GRPC),
    ("speculative_branches", {"speculative_branches": -1}, COMPLETIONS, NO_GRPC),
    ("speculative_branches", {"speculative_branches": 1.5}, CHAT, NO_GRPC),
    ("speculative_branches", {"speculative_branches": True}, COMPLETIONS, NO_GRPC),
    ("prompt", {"prompt": "\ud800"}, COMPLETIONS, NO_GRPC),
    ("messages", {"messages": [{"role": "user", "content": "\udfff"}]}, CHAT, NO_GRPC),
]


@pytest.mark.parametrize(
    ("param", "fields", "endpoint", "grpc_fields"), BAD, ids=[f"{r[0]}-{i}" for i, r in enumerate(BAD)]
)
def test_bad_value_refused_over_http_and_grpc(tok, param, fields, endpoint, grpc_fields):
    if fields is not None:
        r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param and param in error["message"], error
        assert not scheduler.submitted
    if grpc_fields is not None:
        aborted, scheduler = grpc_generate(tok, grpc_fields)
        assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT, aborted
        assert param in aborted.details
        assert not scheduler.submitted


def test_same_message_over_both_apis(tok):
    r, _ = http_post(tok, COMPLETIONS, body_for(COMPLETIONS, {"top_k": -100}))
    aborted, _ = grpc_generate(tok, {"top_k": -100})
    assert aborted is not None and r.json()["error"]["message"] == aborted.details


@pytest.mark.parametrize("n", [0, 9])
def test_bad_n_refused_alike_over_http_and_both_grpc_calls(tok, n):
    r, _ = http_post(tok, CHAT, body_for(CHAT, {"n": n, "stream": True}))
    for call in (grpc_generate, grpc_generate_stream):
        aborted, scheduler = call(tok, {"n": n})
        assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT, aborted
        assert aborted.details == r.json()["error"]["message"] and not scheduler.submitted


def test_grpc_n_reaches_the_scheduler_as_http_n_does(tok):
    """The same choices, with the same per-choice seeds and logprobs requests, from either API."""
    # 0.5: a float32 (the proto's) and a double (JSON's) hold it exactly, so the params compare equal.
    fields = {"n": 3, "seed": 5, "temperature": 0.5, "max_tokens": 4, "logprobs": True}
    r, from_http = http_post(tok, CHAT, body_for(CHAT, fields))
    assert r.status_code == 200, r.text
    aborted, from_grpc = grpc_generate(tok, fields)
    assert aborted is None
    assert len(from_grpc.submitted) == 3 and from_http.submitted == from_grpc.submitted
    assert len({p.sampling.seed for p in from_grpc.submitted}) == 3


def test_grpc_n_unset_or_one_submits_one_choice(tok):
    for fields in ({}, {"n": 1}):
        aborted, scheduler = grpc_generate(tok, {"seed": 5, **fields})
        assert aborted is None and [p.sampling.seed for p in scheduler.submitted] == [5]


def test_grpc_max_tokens_unset_means_the_context_window_like_http_chat(tok):
    aborted, scheduler = grpc_generate(tok, {"temperature": 0.0})
    assert aborted is None and scheduler.submitted[0].max_tokens is None
    r, scheduler = http_post(tok, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and scheduler.submitted[0].max_tokens is None


@pytest.mark.parametrize(
    "fields",
    [{"max_completion_tokens": 7}, {"max_tokens": 7}, {"max_tokens": 7, "max_completion_tokens": 7}],
)
def test_chat_takes_either_token_budget_or_both_when_they_agree(tok, fields):
    r, scheduler = http_post(tok, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert r.status_code == 200, r.text
    assert scheduler.submitted[0].max_tokens == 7


@pytest.mark.parametrize(
    ("endpoint", "fields", "want"),
    [
        (CHAT, {"logprobs": True, "top_logprobs": 3}, LogprobsRequest(3, False)),
        (CHAT, {"logprobs": True}, LogprobsRequest(0, False)),
        (CHAT, {"logprobs": False}, None),
        (COMPLETIONS, {"logprobs": 2}, LogprobsRequest(2, False)),
        (COMPLETIONS, {"logprobs": 0, "echo": True}, LogprobsRequest(0, True)),
        (COMPLETIONS, {"echo": True}, None),
    ],
)
def test_logprobs_requests(tok, endpoint, fields, want):
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields))
    assert r.status_code == 200, r.text
    assert scheduler.submitted[0].logprobs == want


def test_good_values_reach_the_scheduler_identically_from_both_apis(tok):
    http = {
        "temperature": 0.5,
        "top_p": 0.75,
        "top_k": -1,
        "min_p": 0.125,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.25,
        "logit_bias": {"5": 2.5, "7": -100},
        "logprobs": True,
        "top_logprobs": 20,
        "max_tokens": 9,
    }
    r, from_http = http_post(tok, CHAT, body_for(CHAT, http))
    assert r.status_code == 200, r.text
    grpc_fields = {**http, "logit_bias": {5: 2.5, 7: -100.0}}
    aborted, from_grpc = grpc_generate(tok, grpc_fields)
    assert aborted is None
    assert from_http.submitted == from_grpc.submitted
    params = from_http.submitted[0]
    assert params.penalties.logit_bias == ((5, 2.5), (7, -100.0)) and params.sampling.top_k == 0
    assert params.sampling.min_p == 0.125


def test_validator_is_the_one_place_ranges_live():
    from gateway.api.validation import InvalidParameter

    with pytest.raises(InvalidParameter) as info:
        generation_params(RequestedParams(top_k=2**31), vocab_size=10)
    assert info.value.param == "top_k" and info.value.status == 400


def test_guided_choice_is_bounded_before_it_is_compiled():
    from gateway.api.validation import InvalidParameter
    from specd.engine.ranges import MAX_GUIDED_CHOICE_CHARS, MAX_GUIDED_CHOICES

    fits = [f"c{i}" for i in range(MAX_GUIDED_CHOICES)]
    assert generation_params(RequestedParams(guided_choice=fits), 1000).grammar
    for refused in ([*fits, "one more"], ["x" * (MAX_GUIDED_CHOICE_CHARS // 2)] * 3):
        with pytest.raises(InvalidParameter, match="guided_choice takes at most") as exc:
            generation_params(RequestedParams(guided_choice=refused), 1000)
        assert exc.value.param == "guided_choice" and exc.value.status == 400


@pytest.mark.parametrize("temperature", [math.inf, math.nan, 100.5, -1.0])
def test_the_services_refuse_what_the_gateway_refuses(temperature):
    from specd.engine.params import SamplingParams, validate_sampling

    assert generation_params_problem(temperature) == validate_sampling(SamplingParams(temperature=temperature))
    assert validate_sampling(SamplingParams(temperature=100.0)) is None


def generation_params_problem(temperature: float) -> str:
    from gateway.api.validation import InvalidParameter

    with pytest.raises(InvalidParameter) as exc:
        generation_params(RequestedParams(temperature=temperature), 1000)
    return exc.value.message


def test_speculative_siblings_reach_the_scheduler_from_either_api() -> None:
    from gateway.api.grpc_api import requested
    from gateway.api.protocol import CompletionRequest
    from specd.proto.speculative.v1 import gateway_pb2

    by_grpc = requested(gateway_pb2.GenerationParams(speculative_siblings=2))
    assert generation_params(by_grpc, 100).siblings == 2
    assert generation_params(requested(gateway_pb2.GenerationParams()), 100).siblings is None
    by_http = CompletionRequest(model=MODEL, prompt="x", speculative_siblings=3)
    assert generation_params(by_http.requested(), 100).siblings == 3


def test_speculative_branches_reach_the_scheduler_from_either_api() -> None:
    from gateway.api.grpc_api import requested
    from gateway.api.protocol import ChatCompletionRequest
    from specd.proto.speculative.v1 import gateway_pb2

    by_grpc = requested(gateway_pb2.GenerationParams(speculative_branches=2))
    assert generation_params(by_grpc, 100).branches == 2
    assert generation_params(requested(gateway_pb2.GenerationParams(speculative_branches=0)), 100).branches == 0
    assert generation_params(requested(gateway_pb2.GenerationParams()), 100).branches is None
    by_http = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}], speculative_branches=3)
    assert generation_params(by_http.requested(), 100).branches == 3


# -- speculative_siblings and speculative_branches that could never apply ----------------------
# A positive value the rounds would only drop (decide._width) is a 400 naming the field, from
# the gateway's own scheduler, which knows its flags: (param, body fields, gateway flags).
FORCED_TOOL = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}},
}
NEVER_APPLY: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # The services follow one history for penalties and structured output: chains only.
    ("speculative_siblings", {"speculative_siblings": 2, "presence_penalty": 0.5}, {}),
    ("speculative_siblings", {"speculative_siblings": 1, "frequency_penalty": -0.5}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "repetition_penalty": 1.1}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "logit_bias": {"5": 1.0}}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "min_tokens": 2}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "response_format": {"type": "json_object"}}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "guided_regex": "a+"}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "guided_choice": ["yes", "no"]}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "guided_json": {"type": "object"}}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, **FORCED_TOOL}, {}),
    ("speculative_branches", {"pipeline": "ahead", "speculative_branches": 2, "presence_penalty": 0.5}, {}),
    ("speculative_branches", {"speculative_branches": 2, "guided_regex": "a+"}, {"pipeline": "ahead"}),
    ("speculative_branches", {"pipeline": "auto", "speculative_branches": 1, **FORCED_TOOL}, {}),
    # Only the ahead pipeline fans out (auto, when it picks ahead).
    ("speculative_branches", {"speculative_branches": 2}, {}),
    ("speculative_branches", {"pipeline": "sequential", "speculative_branches": 2}, {"pipeline": "ahead"}),
    ("speculative_branches", {"pipeline": "cohort", "speculative_branches": 1}, {}),
    ("speculative_branches", {"speculative_branches": 2}, {"pipeline": "cohort"}),
    # No drafting at all: the request turned it off, or the gateway has no drafter or k.
    ("speculative_siblings", {"num_speculative_tokens": 0, "speculative_siblings": 2}, {}),
    ("speculative_branches", {"num_speculative_tokens": 0, "pipeline": "ahead", "speculative_branches": 2}, {}),
    ("speculative_siblings", {"speculative_siblings": 1}, {"k": 0, "drafter": False}),
    ("speculative_siblings", {"speculative_siblings": 1}, {"drafter": False}),
    ("speculative_branches", {"pipeline": "ahead", "speculative_branches": 1}, {"k": 0, "drafter": False}),
    ("speculative_branches", {"speculative_branches": 1}, {"drafter": False, "pipeline": "auto"}),
]

MAY_APPLY: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"speculative_siblings": 2}, {}),
    ({"speculative_siblings": 9}, {}),  # more than k: at most k
    ({"speculative_siblings": 2, "pipeline": "cohort"}, {}),
    ({"speculative_siblings": 2, "pipeline": "ahead"}, {}),  # a block drafted before its verify
    ({"speculative_siblings": 2, "pipeline": "auto", "num_speculative_tokens": "auto"}, {}),
    ({"speculative_siblings": 2}, {"pipeline": "ahead"}),
    ({"speculative_siblings": 2, "num_speculative_tokens": 1}, {}),
    ({"speculative_branches": 2, "pipeline": "ahead"}, {}),
    ({"speculative_branches": 9, "pipeline": "ahead"}, {}),  # more than MAX_BRANCHES: at most 8
    ({"speculative_branches": 2, "pipeline": "auto"}, {}),
    ({"speculative_branches": 2}, {"pipeline": "ahead"}),
    ({"speculative_branches": 2}, {"pipeline": "auto"}),
    ({"speculative_branches": 2, "speculative_siblings": 2, "pipeline": "ahead"}, {}),
    # 0 or unset is always fine.
    ({"speculative_branches": 0, "speculative_siblings": 0, "presence_penalty": 0.5}, {}),
    ({"speculative_branches": 0, "guided_regex": "a+"}, {}),
    ({"speculative_siblings": 0, "speculative_branches": 0, "num_speculative_tokens": 0}, {}),
    ({"speculative_siblings": 0, "speculative_branches": 0}, {"k": 0, "drafter": False}),
    ({"presence_penalty": 0.5, "guided_regex": "a+"}, {"siblings": 2, "branches": 2, "pipeline": "ahead"}),
    ({"num_speculative_tokens": 0}, {"siblings": 2, "branches": 2, "pipeline": "ahead"}),
    ({}, {"k": 0, "drafter": False, "siblings": 2}),
]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("param", "fields", "flags"), NEVER_APPLY, ids=[f"{i}" for i in range(len(NEVER_APPLY))])
def test_a_width_that_can_never_apply_is_refused(tok, endpoint, param, fields, flags):
    if endpoint == COMPLETIONS and {"tools", "response_format"} & set(fields):
        pytest.skip("chat's fields")
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields), GatewayScheduler(tok, **flags))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert error["param"] == param and param in error["message"], error
    assert not scheduler.submitted and not scheduler.waiting


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(("fields", "flags"), MAY_APPLY, ids=[f"{i}" for i in range(len(MAY_APPLY))])
def test_a_width_that_may_apply_is_taken_at_most(tok, endpoint, fields, flags):
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields), GatewayScheduler(tok, **flags))
    assert r.status_code == 200, r.text
    assert len(scheduler.submitted) == 1


GRPC_NEVER_APPLY = [
    ("speculative_siblings", {"speculative_siblings": 2, "presence_penalty": 0.5}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "min_tokens": 2}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "json_schema": '{"type": "object"}'}, {}),
    ("speculative_siblings", {"speculative_siblings": 2, "num_speculative_tokens": 0}, {}),
    ("speculative_siblings", {"speculative_siblings": 2}, {"drafter": False}),
    ("speculative_branches", {"speculative_branches": 2, "guided_choice": ["a", "b"], "pipeline": "ahead"}, {}),
    ("speculative_branches", {"speculative_branches": 2}, {}),
    ("speculative_branches", {"speculative_branches": 2, "pipeline": "cohort"}, {"pipeline": "ahead"}),
    ("speculative_branches", {"speculative_branches": 1, "pipeline": "ahead"}, {"k": 0, "drafter": False}),
]


@pytest.mark.parametrize(("param", "fields", "flags"), GRPC_NEVER_APPLY)
def test_a_width_that_can_never_apply_is_invalid_argument_over_grpc(tok, param, fields, flags):
    aborted, scheduler = grpc_generate(tok, fields, GatewayScheduler(tok, **flags))
    assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT, aborted
    assert param in aborted.details and not scheduler.submitted


def test_same_width_refusal_over_both_apis(tok):
    fields = {"speculative_branches": 2, "pipeline": "cohort"}
    r, _ = http_post(tok, COMPLETIONS, body_for(COMPLETIONS, fields), GatewayScheduler(tok))
    aborted, _ = grpc_generate(tok, fields, GatewayScheduler(tok))
    assert aborted is not None and r.json()["error"]["message"] == aborted.details


@pytest.mark.parametrize(
    "fields",
    [
        {"speculative_siblings": 2, "pipeline": "sequential"},
        {"speculative_branches": 2, "pipeline": "ahead"},
        {"speculative_branches": 2, "pipeline": "auto", "adaptive_speculation": True},
        {"speculative_siblings": 0, "presence_penalty": 0.5},
        {"speculative_branches": 0},
    ],
)
def test_a_width_that_may_apply_is_taken_over_grpc(tok, fields):
    aborted, scheduler = grpc_generate(tok, fields, GatewayScheduler(tok))
    assert aborted is None and len(scheduler.submitted) == 1


@pytest.mark.parametrize("mode", ["tree", "fanout"])
@pytest.mark.parametrize("pipeline", ["sequential", "cohort", "ahead", "auto"])
def test_what_specd_bench_sends_is_taken_whatever_the_gateways_pipeline(tok, mode, pipeline):
    from specd.tools.bench import mode_extra

    fields = mode_extra(mode, 4)
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields), GatewayScheduler(tok, pipeline=pipeline))
    assert r.status_code == 200, r.text
    assert len(scheduler.submitted) == 1


def test_a_number_of_drafts_past_the_gateways_k_names_its_parameter(tok):
    r, _ = http_post(tok, CHAT, body_for(CHAT, {"num_speculative_tokens": 5}), GatewayScheduler(tok))
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_speculative_tokens", r.text


@pytest.mark.parametrize(("spec", "status"), [(2, 400), (0, 200), ("auto", 200), (None, 200)])
def test_without_a_drafter_only_target_only_requests_are_taken(tok, spec, status):
    fields = {} if spec is None else {"num_speculative_tokens": spec}
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields), GatewayScheduler(tok, drafter=False))
    assert r.status_code == status, r.text
    if status == 400:
        error = r.json()["error"]
        assert error["param"] == "num_speculative_tokens" and "no drafter" in error["message"], error
        assert not scheduler.submitted


@pytest.mark.parametrize(
    ("flags", "k_limit", "warned"),
    [
        ({"speculative_siblings": 2}, 4, []),
        ({"speculative_branches": 2, "pipeline": "ahead"}, 4, []),
        ({"speculative_branches": 2, "pipeline": "auto"}, 4, []),
        ({"speculative_branches": 2, "pipeline": "sequential"}, 4, ["--speculative-branches"]),
        (
            {"speculative_siblings": 2, "speculative_branches": 2},
            0,
            ["--speculative-siblings", "--speculative-branches"],
        ),
        ({}, 0, []),
    ],
)
def test_width_flags_a_gateway_can_never_use_are_logged(flags, k_limit, warned):
    from gateway.config import GatewayConfig
    from gateway.server import idle_widths

    lines = idle_widths(GatewayConfig(**flags), k_limit)
    assert [line.split()[0] for line in lines] == warned
