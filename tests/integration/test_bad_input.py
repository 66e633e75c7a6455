"""Bad input at every layer: the HTTP API fuzzed from its OpenAPI schema, malformed round
messages and oversized messages over real gRPC. Refusals are clean and touch no other
sequence."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
import schemathesis
import stack as st
from hypothesis import HealthCheck, Phase, given, settings
from never_grammars import NEVER

from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

INVALID = common_pb2.ERROR_CODE_INVALID_ARGUMENT
NOT_FOUND = common_pb2.ERROR_CODE_NOT_FOUND
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
FUZZ_EXAMPLES = 25  # per operation and generation mode: the whole fuzz stays well under a minute
FUZZ_BUDGET_S = 60


def test_http_api_fuzzed_from_its_openapi_schema(gateway_for):
    gateway = gateway_for(4, "--max-waiting", "64")
    url = st.base_url(gateway)
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    started = time.monotonic()
    seen: dict[int, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        # Negative data needs something to break: only the POST operations have a body.
        modes = list(schemathesis.GenerationMode) if operation.method.upper() == "POST" else ["positive"]
        for mode in modes:

            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)).map(served_model))
            def check(case) -> None:
                response = case.call(base_url=url, timeout=60)
                seen[response.status_code] = seen.get(response.status_code, 0) + 1
                assert response.status_code < 500 or (response.status_code == 503 and case.path == "/health"), (
                    f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
                )
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert isinstance(error["message"], str) and error["message"]
                    assert error["type"] in ("invalid_request_error", "rate_limit_error", "server_error")

            check()
    elapsed = time.monotonic() - started
    print(f"schemathesis: {sum(seen.values())} requests in {elapsed:.1f}s, status codes {seen}")
    assert elapsed < FUZZ_BUDGET_S
    assert any(400 <= code < 500 for code in seen) and 200 in seen


FUZZ_MAX_TOKENS = 8


def served_model(case):
    """Generated bodies name a random model, which only ever reaches the 404: most name ours.
    Valid token budgets are capped, or one request could generate the whole context window."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if "model" in body and hash(repr(body)) % 4:
        body["model"] = "target"
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None or (type(value) is int and value > FUZZ_MAX_TOKENS):
            body[name] = FUZZ_MAX_TOKENS
    return case


def open_good(stub, sequence_id: str, prompt: list[int]) -> None:
    reply = stub.OpenVerifySequences(
        verifier_pb2.OpenVerifySequencesRequest(
            sequences=[common_pb2.SequenceSpec(sequence_id=sequence_id, prompt_token_ids=prompt, sampling=GREEDY)]
        ),
        timeout=30,
    )
    assert reply.results[0].error.code == 0, reply


def verify_round(stub, tasks: list[verifier_pb2.VerifyTask], round_id: int = 1) -> verifier_pb2.VerifyResponse:
    replies = list(stub.Verify(iter([verifier_pb2.VerifyRequest(round_id=round_id, tasks=tasks)]), timeout=30))
    return replies[0]


def test_malformed_verify_rounds_refused_per_sequence(backends, tok):
    verifier, _ = backends
    vocab = len(tok)
    prompt = tok.encode("The capital of France is")
    with grpc.insecure_channel(verifier.address) as ch:
        stub = verifier_pb2_grpc.VerifierServiceStub(ch)
        open_good(stub, "good", prompt)
        open_good(stub, "twin", prompt)
        open_good(stub, "victim", prompt)
        try:
            n = len(prompt)
            dist = common_pb2.SparseDistribution
            bad = [
                verifier_pb2.VerifyTask(sequence_id="victim", num_committed=n, draft_token_ids=[vocab + 5]),
                verifier_pb2.VerifyTask(sequence_id="victim", num_committed=n, draft_token_ids=[-1]),
                verifier_pb2.VerifyTask(sequence_id="victim", num_committed=n, draft_token_ids=[1] * 999),
                verifier_pb2.VerifyTask(sequence_id="victim", num_committed=n + 7),
                verifier_pb2.VerifyTask(
                    sequence_id="victim",
                    num_committed=n,
                    draft_token_ids=[5],
                    draft_distributions=[dist(token_ids=[5, 6], probs=[0.9, 0.9])],  # sums to 1.8
                ),
                verifier_pb2.VerifyTask(
                    sequence_id="victim",
                    num_committed=n,
                    draft_token_ids=[5],
                    draft_distributions=[dist(token_ids=[5, 5], probs=[0.5, 0.5])],  # repeats an id
                ),
                verifier_pb2.VerifyTask(
                    sequence_id="victim",
                    num_committed=n,
                    draft_token_ids=[5],
                    draft_distributions=[dist(token_ids=[5], probs=[-1.0])],
                ),
                verifier_pb2.VerifyTask(
                    sequence_id="victim",
                    num_committed=n,
                    draft_token_ids=[5, 6],
                    draft_distributions=[dist(token_ids=[5], probs=[1.0])],  # one for two tokens
                ),
                verifier_pb2.VerifyTask(sequence_id="nope", num_committed=n),
            ]
            for round_id, task in enumerate(bad, start=1):
                good = verifier_pb2.VerifyTask(sequence_id="good", num_committed=n + round_id - 1)
                reply = verify_round(stub, [good, task], round_id)
                assert reply.results[0].error.code == 0, reply
                expected = NOT_FOUND if task.sequence_id == "nope" else None
                code = reply.results[1].error.code
                assert code != 0 and (expected is None or code == expected), (task, reply.results[1])
            # A duplicate id in one round: the first is served, the second refused.
            reply = verify_round(
                stub,
                [
                    verifier_pb2.VerifyTask(sequence_id="twin", num_committed=n),
                    verifier_pb2.VerifyTask(sequence_id="twin", num_committed=n),
                ],
            )
            assert reply.results[0].error.code == 0 and reply.results[1].error.code == INVALID
            twin_token = reply.results[0].next_token_id
            # The victim is untouched by all of it: its first clean round matches its twin's.
            reply = verify_round(stub, [verifier_pb2.VerifyTask(sequence_id="victim", num_committed=n)])
            assert reply.results[0].error.code == 0, reply
            assert reply.results[0].next_token_id == twin_token
        finally:
            stub.CloseVerifySequences(
                verifier_pb2.CloseVerifySequencesRequest(sequence_ids=["good", "twin", "victim"]), timeout=30
            )


def test_malformed_opens_and_draft_rounds(backends, tok):
    _, drafter = backends
    vocab = len(tok)
    with grpc.insecure_channel(drafter.address) as ch:
        stub = drafter_pb2_grpc.DrafterServiceStub(ch)

        def spec(**kwargs) -> common_pb2.SequenceSpec:
            return common_pb2.SequenceSpec(**{"sampling": GREEDY, **kwargs})

        reply = stub.OpenDraftSequences(
            drafter_pb2.OpenDraftSequencesRequest(
                sequences=[
                    spec(sequence_id="ok", prompt_token_ids=[1, 2, 3]),
                    spec(sequence_id="", prompt_token_ids=[1, 2]),
                    spec(sequence_id="empty", prompt_token_ids=[]),
                    spec(sequence_id="oov", prompt_token_ids=[1, vocab]),
                    spec(sequence_id="neg", prompt_token_ids=[1, -3]),
                    spec(sequence_id="long", prompt_token_ids=[1] * 5000),
                    spec(
                        sequence_id="hot",
                        prompt_token_ids=[1, 2],
                        sampling=common_pb2.SamplingParams(temperature=-1.0),
                    ),
                    spec(sequence_id="ok", prompt_token_ids=[1, 2, 3]),  # duplicate id
                ]
            ),
            timeout=30,
        )
        codes = [r.error.code for r in reply.results]
        assert codes == [0] + [INVALID] * 7, reply
        try:
            task = drafter_pb2.DraftTask
            rounds = [
                task(sequence_id="ok", new_token_ids=[vocab], num_committed=4, num_draft_tokens=2),
                task(sequence_id="ok", new_token_ids=[4], num_committed=4, num_draft_tokens=10_000),
                task(sequence_id="ok", new_token_ids=[4], num_committed=9, num_draft_tokens=2),
                task(sequence_id="ok", new_token_ids=[4] * 600, num_committed=603, num_draft_tokens=2),
            ]
            for round_id, t in enumerate(rounds, start=1):
                replies = list(stub.Draft(iter([drafter_pb2.DraftRequest(round_id=round_id, tasks=[t])]), timeout=30))
                assert replies[0].proposals[0].error.code != 0, (t, replies[0])
            # After every refusal the sequence is as it was: a valid round still fits exactly.
            good = task(sequence_id="ok", new_token_ids=[4], num_committed=4, num_draft_tokens=2)
            replies = list(stub.Draft(iter([drafter_pb2.DraftRequest(round_id=9, tasks=[good])]), timeout=30))
            assert replies[0].proposals[0].error.code == 0 and len(replies[0].proposals[0].token_ids) == 2
        finally:
            stub.CloseDraftSequences(drafter_pb2.CloseDraftSequencesRequest(sequence_ids=["ok"]), timeout=30)


def test_oversized_message_is_refused(log_dir):
    """The message size limit is deliberate: a larger message is refused, the service lives on."""
    drafter = st.start_backend("drafter", ["--drafter", "ngram", "--max-message-bytes", "4096"], log_dir)
    try:
        with grpc.insecure_channel(drafter.address) as ch:
            stub = drafter_pb2_grpc.DrafterServiceStub(ch)
            big = common_pb2.SequenceSpec(sequence_id="big", prompt_token_ids=list(range(1, 3000)), sampling=GREEDY)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenDraftSequences(drafter_pb2.OpenDraftSequencesRequest(sequences=[big]), timeout=10)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            small = common_pb2.SequenceSpec(sequence_id="small", prompt_token_ids=[1, 2, 3], sampling=GREEDY)
            reply = stub.OpenDraftSequences(drafter_pb2.OpenDraftSequencesRequest(sequences=[small]), timeout=10)
            assert reply.results[0].error.code == 0
    finally:
        drafter.stop()


@pytest.mark.parametrize(("fields", "param"), NEVER)
def test_a_constraint_that_can_never_match_is_a_400_from_a_running_gateway(gateway_for, fields, param):
    """Issue 39, item 7, over real processes: refused at admission with one line naming the parameter,
    never a 500 from the round, never a native backtrace; the gateway serves on."""
    url = st.base_url(gateway_for(4))
    body = {"model": st.MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"] and ".rs:" not in error["message"], error
    ok = httpx.post(url + "/v1/completions", json={"model": st.MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200, ok.text
