"""Per-request speculation statistics (--per-request-spec-decode-metrics), in vLLM's shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from api_harness import CHAT, COMPLETIONS, ScriptedScheduler, body_for, http_post
from fake_backends import FakeDrafter, FakeVerifier

from gateway.api.spec_metrics import speculative_decoding
from gateway.round.scheduler import Finished, GenerationParams, Scheduler
from specd.engine.params import SamplingParams

STEPS = ((4, 4), (4, 1), (2, 0))  # drafted, accepted per verify step


def test_the_summary_counts_steps_drafts_and_acceptance_by_position():
    m = speculative_decoding([STEPS[:2], STEPS[2:]], 4, "summary")
    assert m == {
        "mean_acceptance_length": 1 + 5 / 3,
        "draft_acceptance_rate": 5 / 10,
        "acceptance_histogram": [1, 1, 0, 0, 1],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 5,
        "num_draft_tokens": 10,
        "num_spec_tokens": 4,
        "acceptance_rate_per_position": [2 / 3, 1 / 3, 1 / 3, 1 / 3],
    }
    detailed = speculative_decoding([STEPS], 4, "detailed")
    assert detailed["per_step_accepted"] == [4, 1, 0] and detailed["per_step_drafted"] == [4, 4, 2]
    empty = speculative_decoding([()], 4, "summary")
    assert empty["num_spec_steps"] == 0 and empty["mean_acceptance_length"] == 1.0
    assert empty["acceptance_histogram"] == [0] * 5


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_responses_carry_them_only_when_the_flag_is_on(tok, endpoint):
    body = body_for(endpoint, {"n": 2})
    r, _ = http_post(tok, endpoint, body, ScriptedScheduler(["a", "b"], spec_steps=STEPS))
    assert "metrics" not in r.json()
    r, _ = http_post(tok, endpoint, body, ScriptedScheduler(["a", "b"], spec_steps=STEPS), spec_metrics="summary")
    assert r.status_code == 200, r.text
    # Both choices' steps: the request's statistics.
    assert r.json()["metrics"]["speculative_decoding"] == speculative_decoding([STEPS, STEPS], 4, "summary")


def _chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_carries_them_in_its_last_chunk(tok, include_usage):
    body = body_for(CHAT, {"stream": True, "stream_options": {"include_usage": include_usage}})
    r, _ = http_post(tok, CHAT, body, ScriptedScheduler(["a"], spec_steps=STEPS), spec_metrics="detailed")
    chunks = _chunks(r.text)
    assert [c for c in chunks if "metrics" in c] == [chunks[-1]]
    assert chunks[-1]["choices"] == [] and ("usage" in chunks[-1]) == include_usage
    assert chunks[-1]["metrics"]["speculative_decoding"]["per_step_accepted"] == [4, 1, 0]
    r, _ = http_post(tok, CHAT, body, ScriptedScheduler(["a"], spec_steps=STEPS))
    assert not any("metrics" in c for c in _chunks(r.text))


def test_the_scheduler_reports_each_verify_step_of_a_sequence():
    drafter = FakeDrafter()  # wrong at every fourth position
    verifier = FakeVerifier(drafter=drafter)
    sched = Scheduler(_Chars(), verifier, drafter, 4, 8, [], speculative_mode="fixed")

    async def main() -> Finished:
        sched.start()
        try:
            seq = sched.submit([3, 4, 5], GenerationParams(24, SamplingParams(temperature=0.0)))
            async for event in sched.events(seq):
                last = event
            assert isinstance(last, Finished)
            return last
        finally:
            await sched.stop()

    finished = asyncio.run(main())
    drafted = [t for r in verifier.requests for t in r.tasks if t.draft_token_ids]
    assert [d for d, _ in finished.spec_steps] == [len(t.draft_token_ids) for t in drafted]
    assert sum(a for _, a in finished.spec_steps) == sched.metrics.num_accepted_tokens._value.get()
    assert 0 < sum(a for _, a in finished.spec_steps) < sum(d for d, _ in finished.spec_steps)


class _Chars:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)
