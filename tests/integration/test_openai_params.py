"""Logprobs, penalties and logit bias through real services with speculation on, against
the target alone (plain HF forwards of the same float32 model)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import stack as st
import tinymodels
from target_reference import penalized_greedy, raw_logprobs

from specd.proto.speculative.v1 import gateway_pb2, gateway_pb2_grpc

MODEL = "target"
PROMPT = "The capital of France is"
MAX_TOKENS = 20
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def close_stack(tmp_path_factory, tok, tiny_target, model_dirs, log_dir):
    """A drafter close to the target: most drafts are accepted, some rejected, both paths matter."""
    draft = tinymodels.save(tinymodels.perturbed(tiny_target, 0.02, seed=3), tok, tmp_path_factory.mktemp("close"))
    s = st.start_stack(model_dirs["target"], draft, log_dir, k=4)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(close_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=close_stack.base_url + "/v1", api_key="unused", max_retries=0)


def accepted_tokens(stack: st.Stack) -> float:
    for line in httpx.get(stack.base_url + "/metrics").text.splitlines():
        if line.startswith("specd_spec_decode_num_accepted_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no acceptance counter")


def same(a, b) -> bool:
    """Equal ids and texts, logprobs within TOLERANCE. Two requests need not batch alike: a
    stream and a whole reply verify different blocks, so the same row's float32 sums can
    round differently in the last place."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < TOLERANCE
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def check(reference, prompt_len: int, entries: list[tuple[int, float, list[tuple[int, float]]]], top: int) -> None:
    """Each entry (token id, logprob, top alternatives) against the reference row of its position."""
    assert len(entries) == MAX_TOKENS
    for j, (token, logprob, alternatives) in enumerate(entries):
        row = reference[prompt_len - 1 + j]
        assert abs(logprob - float(row[token])) < TOLERANCE, (j, logprob, float(row[token]))
        values, ids = row.topk(top)
        assert [t for t, _ in alternatives] == ids.tolist()
        assert all(abs(v - float(w)) < TOLERANCE for (_, v), w in zip(alternatives, values, strict=True))


def test_chat_logprobs_equal_the_targets_log_softmax(client, close_stack, tok, tiny_target):
    before = accepted_tokens(close_stack)
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True}
    reply = client.chat.completions.create(**kwargs, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    greedy = penalized_greedy(tiny_target, prompt_ids, MAX_TOKENS)
    reference = raw_logprobs(tiny_target, [*prompt_ids, *greedy])
    # Chat names tokens by their text: the greedy ids' texts, each with the target's values.
    assert [c.token for c in content] == [tok.decode([t]) for t in greedy]
    for j, (t, c) in enumerate(zip(greedy, content, strict=True)):
        row = reference[len(prompt_ids) - 1 + j]
        assert abs(c.logprob - float(row[t])) < TOLERANCE, (j, c.logprob, float(row[t]))
        top = row.topk(3)
        assert [a.token for a in c.top_logprobs] == [tok.decode([int(i)]) for i in top.indices]
        assert all(abs(a.logprob - float(v)) < TOLERANCE for a, v in zip(c.top_logprobs, top.values, strict=True))
    assert any(c.logprob < -1e-3 for c in content), "greedy logprobs must be real values, not 0.0"

    streamed = [
        entry
        for chunk in client.chat.completions.create(
            **kwargs, top_logprobs=3, stream=True, extra_body={"ignore_eos": True}
        )
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert same([(c.token, c.logprob) for c in streamed], [(c.token, c.logprob) for c in content])
    assert accepted_tokens(close_stack) > before, "no draft was accepted: accepted positions went unchecked"


def test_completions_logprobs_and_echo(client, tok, tiny_target):
    prompt_ids = tok.encode(PROMPT)
    greedy = penalized_greedy(tiny_target, prompt_ids, MAX_TOKENS)
    reference = raw_logprobs(tiny_target, [*prompt_ids, *greedy])
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2}
    reply = client.completions.create(**kwargs, echo=True, extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    n = len(prompt_ids)
    assert reply.choices[0].text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    everything = [*prompt_ids, *greedy]
    assert lp.tokens == [tok.decode([t]) for t in everything]
    for j in range(1, len(everything)):
        want = float(reference[j - 1, everything[j]])
        assert abs(lp.token_logprobs[j] - want) < TOLERANCE, (j, lp.token_logprobs[j], want)
        top = reference[j - 1].topk(2)
        expected = {tok.decode([int(t)]): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        assert set(expected) <= set(lp.top_logprobs[j])
        assert all(abs(lp.top_logprobs[j][k] - v) < TOLERANCE for k, v in expected.items())
    assert lp.text_offset[n] == len(PROMPT) or lp.text_offset[n] == sum(len(t) for t in lp.tokens[:n])

    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert same(streamed, lp.token_logprobs[n:])


def test_grpc_logprobs_streamed_and_whole(close_stack, tok, tiny_target):
    prompt_ids = tok.encode(PROMPT)
    greedy = penalized_greedy(tiny_target, prompt_ids, MAX_TOKENS)
    reference = raw_logprobs(tiny_target, [*prompt_ids, *greedy])
    params = gateway_pb2.GenerationParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=4, prompt_logprobs=True
    )
    with grpc.insecure_channel(f"127.0.0.1:{close_stack.gateway.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        whole = stub.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, params=params), timeout=120)
        chunks = list(stub.GenerateStream(gateway_pb2.GenerateStreamRequest(prompt=PROMPT, params=params), timeout=120))
    assert list(whole.token_ids) == greedy
    entries = [(e.token_id, e.logprob, [(a.token_id, a.logprob) for a in e.top]) for e in whole.logprobs]
    assert [e[0] for e in entries] == greedy
    check(reference, len(prompt_ids), entries, 4)
    assert [e.token_id for e in whole.prompt_logprobs] == prompt_ids[1:]
    for j, e in enumerate(whole.prompt_logprobs):
        assert abs(e.logprob - float(reference[j, prompt_ids[j + 1]])) < TOLERANCE

    def flat(e):
        return (e.token_id, e.token, e.logprob, [(a.token_id, a.token, a.logprob) for a in e.top])

    assert same([flat(e) for c in chunks for e in c.logprobs], [flat(e) for e in whole.logprobs])
    assert same([flat(e) for c in chunks for e in c.prompt_logprobs], [flat(e) for e in whole.prompt_logprobs])


# The tiny random target repeats itself after this prompt, so every penalty has work to do.
PENALTY_PROMPT = "Q: What is 2 + 2?\nA:"
BAN_FIRST = "ban-first"  # logit_bias of -100 on the target's own first greedy token
PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 1.2},
    {"repetition_penalty": 1.8},
    {"logit_bias": BAN_FIRST},
    {"presence_penalty": 0.6, "frequency_penalty": 0.9, "repetition_penalty": 1.3, "logit_bias": {"28": 3.0}},
]


@pytest.mark.parametrize("penalties", PENALTIES, ids=["presence", "frequency", "repetition", "bias", "all"])
def test_penalised_and_biased_greedy_equals_the_target_alone(client, close_stack, tok, tiny_target, penalties):
    prompt_ids = tok.encode(PENALTY_PROMPT)
    if penalties.get("logit_bias") == BAN_FIRST:
        penalties = {"logit_bias": {str(penalized_greedy(tiny_target, prompt_ids, 1)[0]): -100.0}}
    reference_kwargs = {
        "presence": penalties.get("presence_penalty", 0.0),
        "frequency": penalties.get("frequency_penalty", 0.0),
        "repetition": penalties.get("repetition_penalty", 1.0),
        "bias": {int(k): v for k, v in penalties.get("logit_bias", {}).items()},
    }
    want = penalized_greedy(tiny_target, prompt_ids, MAX_TOKENS, **reference_kwargs)
    assert want != penalized_greedy(tiny_target, prompt_ids, MAX_TOKENS), "the penalty changed nothing: a weak test"
    extra = {"ignore_eos": True}
    if "repetition_penalty" in penalties:
        extra["repetition_penalty"] = penalties["repetition_penalty"]
    sdk = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
    reply = client.completions.create(
        model=MODEL, prompt=PENALTY_PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0, extra_body=extra, **sdk
    )
    assert reply.choices[0].logprobs.tokens == [tok.decode([t]) for t in want]
    grpc_params = gateway_pb2.GenerationParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logit_bias={int(k): v for k, v in penalties.get("logit_bias", {}).items()},
        **{k: v for k, v in penalties.items() if k != "logit_bias"},
    )
    with grpc.insecure_channel(f"127.0.0.1:{close_stack.gateway.grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        whole = stub.Generate(gateway_pb2.GenerateRequest(prompt=PENALTY_PROMPT, params=grpc_params), timeout=120)
    assert list(whole.token_ids) == want
