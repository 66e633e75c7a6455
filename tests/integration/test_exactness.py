"""Greedy output through the real services equals the target model's own greedy decoding."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from references import PROMPTS as ALL_PROMPTS
from references import api_text, greedy_references
from stack import base_url, complete_texts

from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

PROMPTS = list(ALL_PROMPTS[:9])
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def references(tok, tiny_target) -> dict[str, list[int]]:
    return greedy_references(tok, tiny_target, PROMPTS, MAX_TOKENS)


def grpc_generate(gateway, prompt: str, max_tokens: int = MAX_TOKENS) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        params = gateway_pb2.GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return stub.Generate(gateway_pb2.GenerateRequest(prompt=prompt, params=params), timeout=120)


@pytest.mark.parametrize("k", [0, 1, 4, 8])
def test_greedy_token_identical_one_at_a_time(gateway_for, references, k):
    gateway = gateway_for(k)
    for prompt in PROMPTS:
        reply = grpc_generate(gateway, prompt)
        assert list(reply.token_ids) == references[prompt], prompt
        assert reply.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
        assert reply.usage.completion_tokens == MAX_TOKENS


def concurrent_texts(gateway, prompts: list[str], **extra) -> list[str]:
    """Greedy completions of all prompts at once over HTTP."""

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=base_url(gateway), timeout=300) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    return asyncio.run(run())


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_token_identical_16_concurrent(gateway_for, references, tok, k):
    prompts = (PROMPTS * 2)[:16]
    for prompt, text in zip(prompts, concurrent_texts(gateway_for(k), prompts), strict=True):
        assert text == api_text(tok, references[prompt]), prompt


def test_ngram_drafter_is_exact(model_dirs, log_dir, references):
    import stack as st

    s = st.start_stack(model_dirs["target"], "ngram", log_dir, k=4)
    try:
        for prompt in PROMPTS[:4]:
            assert list(grpc_generate(s.gateway, prompt).token_ids) == references[prompt]
    finally:
        s.stop()


@pytest.mark.parametrize("pipeline", ["cohort", "ahead", "auto"])
@pytest.mark.parametrize("concurrency", [1, 16])
def test_greedy_token_identical_in_every_pipeline(gateway_for, references, tok, pipeline, concurrency):
    """The pipelines change when drafts are made, never what is committed (the drafter here is a
    different model, so drafts are often wrong and ahead blocks often thrown away)."""
    prompts = (PROMPTS * 2)[:concurrency]
    texts = concurrent_texts(gateway_for(4), prompts, pipeline=pipeline)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == api_text(tok, references[prompt]), prompt


@pytest.mark.parametrize("chunk", ["1", "5"])
@pytest.mark.parametrize("pipeline", ["sequential", "ahead"])
def test_greedy_token_identical_with_chunked_prefill(gateway_for, references, tok, chunk, pipeline):
    """Prompts prefilled a few tokens a round on both services, beside running sequences: the same tokens."""
    gateway = gateway_for(4, "--prefill-chunk-tokens", chunk, "--pipeline", pipeline)
    prompts = (PROMPTS * 2)[:12]
    for prompt, text in zip(prompts, complete_texts(base_url(gateway), prompts, MAX_TOKENS), strict=True):
        assert text == api_text(tok, references[prompt]), prompt
    assert list(grpc_generate(gateway, PROMPTS[0]).token_ids) == references[PROMPTS[0]]


def counter(gateway, name: str) -> float:
    text = httpx.get(base_url(gateway) + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


# Token trees: siblings beside each chain, checked in the same verify; the path through one
# commits what the chain would have committed with its correction. Fan-out: branches beside each
# draft-ahead block, verified only where the committed tokens end in exactly the verdict each
# assumed. Either way the text is the target's. (request fields, gateway flags, counter of use)
WIDENED = {
    "trees": ({"speculative_siblings": 2}, ("--speculative-siblings", "2"), "num_sibling_tokens"),
    "fan-out": (
        {"pipeline": "ahead", "speculative_branches": 2},
        ("--pipeline", "ahead", "--speculative-branches", "2"),
        "num_branches",
    ),
}


@pytest.mark.parametrize("widened", list(WIDENED))
@pytest.mark.parametrize(("concurrency", "by"), [(1, "request"), (16, "request"), (16, "gateway flag")])
def test_greedy_token_identical_with_trees_and_fan_out(gateway_for, references, tok, widened, concurrency, by):
    """Asked for per request, or by the gateway's flags for its fixed k."""
    fields, flags, used = WIDENED[widened]
    flag = by == "gateway flag"
    gateway = gateway_for(4, *flags) if flag else gateway_for(4)
    before = counter(gateway, f"specd_spec_decode_{used}_total")
    refusals = gateway.output().count("drafter refused")
    prompts = (PROMPTS * 2)[:concurrency]
    for prompt, text in zip(prompts, concurrent_texts(gateway, prompts, **({} if flag else fields)), strict=True):
        assert text == api_text(tok, references[prompt]), prompt
    assert counter(gateway, f"specd_spec_decode_{used}_total") > before
    assert counter(gateway, "specd_spec_decode_num_refused_draft_blocks_total") == 0
    assert gateway.output().count("drafter refused") == refusals  # every task drafted as asked
