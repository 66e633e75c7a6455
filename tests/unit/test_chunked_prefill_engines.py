"""Chunked prefill in the engines: a prompt cached a chunk at a time verifies and drafts as if whole."""

from __future__ import annotations

import pytest

from specd.engine.errors import ErrorKind
from specd.engine.params import LogprobsRequest, SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i + 3) % 500 + 10 for i in range(37)]


def verify_steps(engine, sid: str, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        n = len(engine.table.get(sid).committed)
        (result,), _ = engine.verify([VerifyTask(sid, n, [])])
        assert result.error is None
        out.append(result.next_token)
    return out


@pytest.mark.parametrize("first, chunk", [(0, 5), (3, 8), (10, 100)])
def test_verifier_chunked_prefill_matches_whole_prefill(make_verifier, first, chunk):
    whole, chunked = make_verifier(max_sequences=2), make_verifier(max_sequences=2)
    assert whole.open([SequenceSpec("a", PROMPT, GREEDY)])[0] == [None]
    assert chunked.open([SequenceSpec("a", PROMPT, GREEDY, prefill_tokens=first)])[0] == [None]
    pending = chunked.table.pending(chunked.table.get("a"))
    assert pending == len(PROMPT) - 1 - first
    while pending:
        (result,), _ = chunked.verify([VerifyTask("a", len(PROMPT), [], prefill_tokens=chunk)])
        assert result.error is None and result.num_accepted == 0
        assert result.prefill_pending == max(0, pending - chunk)
        pending = result.prefill_pending
    assert chunked.table.get("a").cached == PROMPT[:-1]
    assert verify_steps(chunked, "a", 6) == verify_steps(whole, "a", 6)


def test_verifier_prefill_task_beside_a_decode_task(make_verifier):
    engine = make_verifier(max_sequences=2)
    assert engine.open([SequenceSpec("d", PROMPT[:5], GREEDY), SequenceSpec("p", PROMPT, GREEDY, prefill_tokens=0)])[
        0
    ] == [None, None]
    results, _ = engine.verify([VerifyTask("d", 5, []), VerifyTask("p", len(PROMPT), [], prefill_tokens=16)])
    assert results[0].error is None and results[0].next_token >= 0 and results[0].prefill_pending == 0
    assert results[1].error is None and results[1].prefill_pending == len(PROMPT) - 1 - 16
    assert engine.table.get("p").committed == PROMPT  # a prefill commits nothing


def test_verifier_prefill_task_with_drafts_or_a_wrong_count_is_refused(make_verifier):
    engine = make_verifier(max_sequences=2)
    engine.open([SequenceSpec("p", PROMPT, GREEDY, prefill_tokens=0)])
    results, _ = engine.verify([VerifyTask("p", len(PROMPT), [5], prefill_tokens=4)])
    assert results[0].error.kind is ErrorKind.INVALID_ARGUMENT
    results, _ = engine.verify([VerifyTask("p", len(PROMPT) + 1, [], prefill_tokens=4)])
    assert results[0].error.kind is ErrorKind.FAILED_PRECONDITION
    assert engine.table.get("p").cached == []


def test_verifier_prompt_logprobs_open_prefills_whole(make_verifier):
    engine = make_verifier(max_sequences=2)
    spec = SequenceSpec("p", PROMPT, GREEDY, logprobs=LogprobsRequest(0, True), prefill_tokens=0)
    assert engine.open([spec])[0] == [None]
    assert engine.table.pending(engine.table.get("p")) == 0
    assert len(engine.take_prompt_logprobs("p")) == len(PROMPT) - 1


def test_drafter_chunked_prefill_drafts_as_if_whole(make_drafter):
    whole, chunked = make_drafter(max_sequences=2), make_drafter(max_sequences=2)
    whole.open([SequenceSpec("a", PROMPT, GREEDY)])
    chunked.open([SequenceSpec("a", PROMPT, GREEDY, prefill_tokens=4)])
    pending = len(PROMPT) - 1 - 4
    while pending:
        (p,), _ = chunked.draft([DraftTask("a", [], len(PROMPT), 0, (), prefill_tokens=10)])
        assert p.error is None and p.tokens == [] and p.prefill_pending == max(0, pending - 10)
        pending = p.prefill_pending
    (a,), _ = whole.draft([DraftTask("a", [], len(PROMPT), 4)])
    (b,), _ = chunked.draft([DraftTask("a", [], len(PROMPT), 4)])
    assert a.tokens == b.tokens and len(a.tokens) == 4


def test_drafter_prefill_task_that_drafts_is_refused(make_drafter):
    engine = make_drafter(max_sequences=2)
    engine.open([SequenceSpec("a", PROMPT, GREEDY, prefill_tokens=0)])
    (p,), _ = engine.draft([DraftTask("a", [], len(PROMPT), 2, (), prefill_tokens=10)])
    assert p.error.kind is ErrorKind.INVALID_ARGUMENT


def test_ngram_drafter_has_nothing_to_prefill(make_ngram):
    engine = make_ngram(max_sequences=2)
    engine.open([SequenceSpec("a", PROMPT, GREEDY, prefill_tokens=0)])
    assert engine.table.pending(engine.table.get("a")) == 0
