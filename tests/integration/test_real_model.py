"""The embedded SmolLM2-135M through `specd up` (its Q4_1 GGUF; the default drafter there: the suffix
drafter, k = 4). As README starts it (int8 activations against the GGUF's blocks, as llama.cpp computes
them): speculative output equals the same stack's target-only, structured output validates, seeds hold.
With float32 activations (`--verifier-activations float32`): the output and issue #13's parameters are
exact against the target run in this process (HF forwards in float32), checked with the `openai` SDK."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from unittest.mock import ANY

import httpx
import jsonschema
import openai
import pytest
import stack as st
import torch
from hostile_probe import describe, hostile, measure
from target_reference import penalized_greedy, raw_logprobs

from gateway.api.choices import choice_seed
from specd.engine import checkpoints, gemv, models

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[str]:
    """`specd up` with its defaults but for the ports; yields the API's base URL."""
    with st.specd_up(tmp_path_factory.mktemp("up") / "up.log", "-k", "4") as (base, _):
        yield base


@pytest.fixture(scope="module")
def up_float32(tmp_path_factory) -> Iterator[str]:
    """`specd up` with float32 activations: the products an HF float32 forward takes."""
    log = tmp_path_factory.mktemp("up-float32") / "up.log"
    with st.specd_up(log, "-k", "4", "--verifier-activations", "float32") as (base, _):
        yield base


@pytest.fixture(scope="module")
def target() -> tuple[Any, Any]:
    """The embedded model's tokenizer and float32 weights, as the verifier serves them."""
    return checkpoints.load_tokenizer("embedded"), models.load_model("embedded", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def client(up) -> openai.OpenAI:
    return openai.OpenAI(base_url=up + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client_float32(up_float32) -> openai.OpenAI:
    return openai.OpenAI(base_url=up_float32 + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(prompt, add_special_tokens=False)


def test_specd_up_serves_the_embedded_model_exactly(up_float32, target):
    up = up_float32
    tokenizer, model = target
    assert httpx.get(up + "/v1/models").json()["data"][0] == {
        "id": NAME,
        "object": "model",
        "created": ANY,
        "owned_by": "specd",
    }
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    reply = httpx.post(
        up + "/v1/chat/completions",
        json={"model": NAME, "messages": messages, "max_tokens": 40, "temperature": 0},
        timeout=300,
    ).json()
    text = reply["choices"][0]["message"]["content"]
    ids = chat_ids(tokenizer, messages)
    out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    assert text == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert "Paris" in text
    assert reply["usage"]["completion_tokens"] == len(out[0]) - len(ids)


INT8_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colours.",
    "Write a haiku about the sea.",
]


def test_the_default_stack_speculates_exactly_in_int8(client, up):
    """README's stack takes int8 activations where the CPU sums int8 (/v1/models says so):
    speculating (k = 4, and auto) its greedy tokens and their logprobs are its own target-only
    ones, bit for bit."""
    kernel = gemv.load()
    int8 = kernel is not None and kernel.int8_supported()
    assert httpx.get(up + "/v1/models").json()["data"][0].get("activations") == ("int8" if int8 else None)

    def ask(question: str, k: int | str) -> tuple[str, list[float]]:
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
            logprobs=True,
            extra_body={"num_speculative_tokens": k, "ignore_eos": True},
        )
        return reply.choices[0].message.content or "", [c.logprob for c in reply.choices[0].logprobs.content]

    for question in INT8_QUESTIONS:
        alone = ask(question, 0)
        assert ask(question, 4) == alone, question
        assert ask(question, "auto") == alone, question


def test_logprobs_are_the_targets_own_log_softmax(client_float32, target):
    """(a) Every returned logprob, and the top alternatives, within 1e-4 of an HF float32 forward."""
    client = client_float32
    tokenizer, model = target
    for question in ("Name three colours.",):
        messages = [{"role": "user", "content": question}]
        ids = chat_ids(tokenizer, messages)
        reply = client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        greedy = penalized_greedy(model, ids, 10)
        reference = raw_logprobs(model, [*ids, *greedy])
        content = reply.choices[0].logprobs.content
        assert [c.token for c in content] == [tokenizer.decode([t]) for t in greedy]
        for j, (token, entry) in enumerate(zip(greedy, content, strict=True)):
            row = reference[len(ids) - 1 + j]
            assert abs(entry.logprob - float(row[token])) < TOLERANCE, (question, j)
            top = row.topk(3)
            assert [a.token for a in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in top.indices]
            assert all(
                abs(a.logprob - float(v)) < TOLERANCE for a, v in zip(entry.top_logprobs, top.values, strict=True)
            )


PENALTIES: list[dict[str, Any]] = [
    {"presence_penalty": 1.5, "frequency_penalty": 1.0},
    {"repetition_penalty": 1.6},
    {"logit_bias": {"30": 8.0, "28": 6.0}},  # token ids 30 and 28: "." and "," in this vocabulary
]
PENALTY_PROMPT = "List the days of the week: Monday, Tuesday,"
PENALTY_TOKENS = 10


@pytest.fixture(scope="module")
def unpenalised(target) -> list[int]:
    tokenizer, model = target
    return penalized_greedy(model, tokenizer.encode(PENALTY_PROMPT), PENALTY_TOKENS)


@pytest.mark.parametrize("penalties", PENALTIES, ids=["presence-frequency", "repetition", "logit_bias"])
def test_penalised_and_biased_greedy_equals_the_target_alone(client_float32, target, unpenalised, penalties):
    """(b) The same formulas applied to the target alone give the same tokens."""
    client = client_float32
    tokenizer, model = target
    prompt = PENALTY_PROMPT
    ids = tokenizer.encode(prompt)
    want = penalized_greedy(
        model,
        ids,
        PENALTY_TOKENS,
        presence=penalties.get("presence_penalty", 0.0),
        frequency=penalties.get("frequency_penalty", 0.0),
        repetition=penalties.get("repetition_penalty", 1.0),
        bias={int(k): v for k, v in penalties.get("logit_bias", {}).items()},
    )
    assert want != unpenalised, "the parameters changed nothing: a weak test"
    extra: dict[str, Any] = {"ignore_eos": True}
    if "repetition_penalty" in penalties:
        extra["repetition_penalty"] = penalties["repetition_penalty"]
    sdk = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    reply = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=PENALTY_TOKENS, temperature=0, logprobs=0, extra_body=extra, **sdk
    )
    assert reply.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in want]


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


WORD = {"type": "string", "maxLength": 16}
JSON_CASES: list[tuple[str, dict[str, Any]]] = [
    ("What is the capital of France?", _object(city=WORD)),
    ("Name a fruit and its colour.", _object(fruit=WORD, colour=WORD)),
    ("How many legs does a spider have?", _object(legs={"type": "integer", "minimum": 0, "maximum": 100})),
    ("Is water wet?", _object(answer={"type": "boolean"})),
    ("Pick a primary colour.", _object(colour={"enum": ["red", "yellow", "blue"]})),
    ("Describe a cat.", _object(name=WORD, age={"type": "integer", "minimum": 0, "maximum": 30})),
    ("Give two even numbers.", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}),
    ("Is the sun a star? Answer yes or no.", {"enum": ["yes", "no"]}),
    ("What year did World War II end?", _object(year={"type": "integer", "minimum": 1900, "maximum": 2000})),
    ("Name a planet.", _object(planet=WORD)),
    ("What is 2 + 2?", _object(result={"type": "integer", "minimum": 0, "maximum": 10})),
    ("Name an animal that can fly.", _object(animal=WORD, flies={"type": "boolean"})),
    ("Temperature of boiling water in Celsius?", _object(celsius={"type": "number", "minimum": 0, "maximum": 200})),
    ("Name a day of the week.", _object(day={"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]})),
    ("Three colours, please.", {"type": "array", "items": WORD, "minItems": 1, "maxItems": 3}),
    ("A user with an id.", _object(user=_object(id={"type": "integer", "minimum": 1, "maximum": 999}, name=WORD))),
    ("How are you feeling?", _object(mood={"enum": ["good", "bad", "okay"]}, why=WORD)),
    ("What language is spoken in Spain?", _object(language=WORD)),
    ("Is 7 a prime number?", _object(prime={"type": "boolean"}, number={"const": 7})),
    ("Name a musical instrument.", {"type": "string", "maxLength": 12}),
]


def test_json_schema_outputs_validate_with_speculation_on(client):
    """(c) 20 of 20 json_schema replies parse and validate, speculating (k = 4, adaptive)."""

    def ask(case: tuple[str, dict[str, Any]]) -> tuple[str | None, str | None]:
        question, schema = case
        reply = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": question + " Answer in JSON."}],
            max_tokens=48,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            },
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, JSON_CASES))
    for (question, schema), (text, finish) in zip(JSON_CASES, replies, strict=True):
        assert finish == "stop", (question, text)
        jsonschema.validate(json.loads(text or ""), schema)


SEEDED: list[dict[str, Any]] = [
    {"prompt": "Once upon a time", "seed": 1, "temperature": 0.8},
    {"prompt": "The best way to learn", "seed": 2, "temperature": 1.0, "top_p": 0.9},
    {"prompt": "My favourite food is", "seed": 3, "temperature": 0.7, "top_k": 40},
    {"prompt": "In the year 3000,", "seed": 2**63 + 5, "temperature": 1.1},
]


def test_seeded_sampling_is_the_same_whatever_k_and_concurrency(client):
    """(d) Seeded outputs are identical for num_speculative_tokens 0, 4 and "auto", from 1 or 8 clients."""

    def sample(request: dict[str, Any], k: int | str) -> str:
        body = {k2: v for k2, v in request.items() if k2 != "top_k"}
        extra = {
            "num_speculative_tokens": k,
            "ignore_eos": True,
            **({"top_k": request["top_k"]} if "top_k" in request else {}),
        }
        return client.completions.create(model=NAME, max_tokens=8, extra_body=extra, **body).choices[0].text

    def run(k: int | str, clients: int) -> list[str]:
        requests = SEEDED * (2 if clients > 1 else 1)  # 8 at once: each request twice
        with ThreadPoolExecutor(clients) as pool:
            texts = list(pool.map(lambda r: sample(r, k), requests))
        assert texts[len(SEEDED) :] == texts[: len(SEEDED)] or clients == 1
        return texts[: len(SEEDED)]

    target_only = run(0, 1)
    assert len(set(target_only)) == len(SEEDED)
    for k, clients in [(4, 1), ("auto", 1), ("auto", 8)]:
        assert run(k, clients) == target_only, (k, clients)
    # Several choices: choice 0 keeps the seed, choice 1 is the reply to its derived seed.
    request = SEEDED[0]
    reply = client.completions.create(model=NAME, max_tokens=8, n=2, extra_body={"ignore_eos": True}, **request)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text == target_only[0]
    other = {**request, "seed": choice_seed(request["seed"], 1)}
    assert reply.choices[1].text == sample(other, 0)


@pytest.mark.parametrize("attack", [0, 1, 2])
def test_a_small_request_stays_within_twice_idle_while_hostile_requests_arrive(up, attack):
    """Issue 39, item 1, on the stack README starts: while two clients send one of the red-team's
    requests over and over (megabytes of prompt, 200,000 messages, 100,000 choices), a small greedy
    request's latency and a 24-token stream's stay within twice their idle values."""
    probe = asyncio.run(measure(up, [hostile(NAME)[attack]], NAME))
    print(describe(probe))
    assert probe.statuses and set(probe.statuses) == {400}, sorted(set(probe.statuses))
    assert probe.loaded < 2 * probe.idle, probe
    assert probe.loaded_stream.seconds < 2 * probe.idle_stream.seconds, probe
