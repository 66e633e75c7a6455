"""vLLM's extra request fields, as clients send them in extra_body: each applied or a 400 naming why."""

from __future__ import annotations

import copy
import json
from typing import Any

import grpc
import pytest
from api_harness import CHAT, COMPLETIONS, body_for, grpc_generate, http_post

from gateway.round.detokenize import TextStream

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEMPLATE = (
    "{% if greeting is defined %}[{{ greeting }}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or add_generation_prompt %}</>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def templated(tok) -> Any:
    served = copy.copy(tok)
    served.chat_template = TEMPLATE
    return served


def rendered(tok, fields: dict[str, Any]) -> str:
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields))
    assert r.status_code == 200, r.text
    return tok.decode(scheduler.prompts[0])


def test_chat_template_kwargs_reach_the_template(templated):
    assert rendered(templated, {"chat_template_kwargs": {"greeting": "hej"}}) == "[hej]<user>Hi</><assistant>"
    assert rendered(templated, {}) == "<user>Hi</><assistant>"


def test_add_generation_prompt_and_continue_final_message(templated):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    assert rendered(templated, {"add_generation_prompt": False}) == "<user>Hi"
    fields = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    assert rendered(templated, fields) == "<user>Hi</><assistant>Hel"  # no end of turn: the model goes on


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
        ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # last: user
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "guided_json"),
        ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"min_tokens": 2, "guided_json": SCHEMA}, "min_tokens"),  # a grammar may end before it
        ({"min_tokens": 2, "guided_choice": ["a"]}, "min_tokens"),
    ],
)
def test_what_cannot_be_applied_is_a_400_naming_it(tok, fields, param):
    r, scheduler = http_post(tok, CHAT, body_for(CHAT, fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and not scheduler.submitted


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("given", [SCHEMA, json.dumps(SCHEMA)])
def test_guided_json_is_the_json_schema_response_format(tok, endpoint, given):
    r, scheduler = http_post(tok, endpoint, body_for(endpoint, {"guided_json": given}))
    assert r.status_code == 200, r.text
    sent = json.loads(scheduler.submitted[0].json_schema)
    assert sent == {**SCHEMA, "additionalProperties": False}


def test_the_output_fields_reach_the_scheduler(tok):
    fields = {"skip_special_tokens": False, "include_stop_str_in_output": True, "min_tokens": 3}
    for endpoint in (CHAT, COMPLETIONS):
        r, scheduler = http_post(tok, endpoint, body_for(endpoint, fields))
        assert r.status_code == 200, r.text
        (params,) = scheduler.submitted
        assert not params.skip_special_tokens and params.include_stop
        assert params.penalties.min_tokens == 3  # the scheduler adds the eos ids (test_scheduler)


def stream_text(tok, text_ids: list[int], **options: Any) -> str:
    stream = TextStream(tok, ["lo w"], **options)
    for t in text_ids:
        stream.add(t)
        if stream.stopped:
            break
    return stream.take(final=True)


def test_include_stop_str_keeps_the_stop_string_and_skip_special_tokens_false_keeps_specials(tok):
    ids = tok.encode("Hello world, again", add_special_tokens=False)
    assert stream_text(tok, ids) == "Hel"
    assert stream_text(tok, ids, include_stop=True) == "Hello w"
    special = [tok.convert_tokens_to_ids("<|im_start|>"), *tok.encode("Hi", add_special_tokens=False)]
    assert stream_text(tok, special) == "Hi"
    assert stream_text(tok, special, skip_special_tokens=False) == "<|im_start|>Hi"


def test_grpc_takes_the_same_fields_with_the_same_checks(tok):
    fields = {"min_tokens": 3, "skip_special_tokens": False, "include_stop_str_in_output": True}
    aborted, scheduler = grpc_generate(tok, fields)
    assert aborted is None
    (params,) = scheduler.submitted
    assert params.penalties.min_tokens == 3 and not params.skip_special_tokens and params.include_stop
    _, defaults = grpc_generate(tok, {})
    assert defaults.submitted[0].skip_special_tokens and not defaults.submitted[0].include_stop
    aborted, scheduler = grpc_generate(tok, {"min_tokens": 5, "max_tokens": 4})
    assert aborted is not None and aborted.code == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in aborted.details
    assert not scheduler.submitted
