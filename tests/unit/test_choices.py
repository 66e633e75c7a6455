"""A request's several choices: all admitted or none, one failure fails and frees them all,
per-choice seeds, and best_of's ranking."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backends import FakeVerifier, reference
from test_scheduler import GREEDY, scheduler

from gateway.api.choices import Choices, Outcome, best, choice_params, choice_seed, merged
from gateway.failures import GenerationError
from gateway.round.scheduler import Delta, Failed, Finished, GenerationParams
from specd.engine.params import LogprobsRequest, SamplingParams, TokenLogprob
from specd.proto.speculative.v1 import common_pb2


class FailsOne(FakeVerifier):
    """Fails one sequence (by its position among the opened ones) after a few rounds."""

    def __init__(self, victim: int, after_rounds: int = 3) -> None:
        super().__init__()
        self.victim, self.after_rounds = victim, after_rounds
        self.opened: list[str] = []

    async def open(self, specs: list[Any]) -> list[Any]:
        self.opened.extend(s.sequence_id for s in specs)
        return await super().open(specs)

    async def verify(self, request: Any) -> Any:
        reply = await super().verify(request)
        if len(self.requests) > self.after_rounds:
            for result in reply.results:
                if result.sequence_id == self.opened[self.victim]:
                    result.ClearField("next_token_id")
                    result.error.code = common_pb2.ERROR_CODE_INTERNAL
                    result.error.message = "boom"
        return reply


def test_one_failed_choice_fails_the_request_and_frees_the_others() -> None:
    verifier = FailsOne(victim=1)
    sched = scheduler(verifier, None, k=0)

    async def main() -> list[tuple[int, Any]]:
        sched.start()
        try:
            seqs = sched.submit_group([3, 4, 5], [GenerationParams(200, GREEDY)] * 3)
            events = [(i, e) async for i, e in merged(sched, seqs)]
            # The others are closed on the verifier at the next round boundary.
            for _ in range(100):
                if not verifier.committed and sched.idle:
                    break
                await asyncio.sleep(0.01)
            return events
        finally:
            await sched.stop()

    events = asyncio.run(main())
    assert isinstance(events[-1][1], Failed) and events[-1][0] == 1
    assert not any(isinstance(e, Finished) for _, e in events)
    assert verifier.committed == {} and sched.idle


def test_choices_are_admitted_all_or_none() -> None:
    sched = scheduler(FakeVerifier(), None, k=0, max_waiting=4)
    with pytest.raises(GenerationError) as refused:
        sched.submit_group([1, 2], [GenerationParams(4, GREEDY)] * 5)
    assert refused.value.status == 400 and "--max-waiting" in refused.value.message
    sched.submit_group([1, 2], [GenerationParams(4, GREEDY)] * 2)
    with pytest.raises(GenerationError) as full:
        sched.submit_group([1, 2], [GenerationParams(4, GREEDY)] * 3)
    assert full.value.status == 429 and len(sched.waiting) == 2  # nothing of it was queued
    # A choice that cannot fit refuses the request before any of its choices is queued.
    with pytest.raises(GenerationError):
        sched.submit_group([1, 2], [GenerationParams(4, GREEDY), GenerationParams(10**6, GREEDY)])
    assert len(sched.waiting) == 2


def test_every_choice_runs_to_its_own_end() -> None:
    sched = scheduler(FakeVerifier(), None, k=0)

    async def main() -> dict[int, list[int]]:
        sched.start()
        try:
            seqs = sched.submit_group([3, 4, 5], [GenerationParams(n, GREEDY) for n in (5, 9, 2)])
            out: dict[int, list[int]] = {0: [], 1: [], 2: []}
            async for i, e in merged(sched, seqs):
                if isinstance(e, Delta):
                    out[i].extend(e.token_ids)
            return out
        finally:
            await sched.stop()

    out = asyncio.run(main())
    assert out == {0: reference([3, 4, 5], 5), 1: reference([3, 4, 5], 9), 2: reference([3, 4, 5], 2)}


def test_choice_seeds_are_distinct_reproducible_and_keep_choice_zero() -> None:
    assert choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < 2**64 for s in seeds)
    assert seeds == [choice_seed(7, i) for i in range(64)]
    assert choice_seed(2**64 - 1, 3) != choice_seed(0, 3)
    sampled = GenerationParams(8, SamplingParams(temperature=1.0, seed=7), logprobs=LogprobsRequest(2, prompt=True))
    params = choice_params(sampled, Choices(3))
    assert [p.sampling.seed for p in params] == seeds[:3]
    # Only choice 0 asks for the prompt's logprobs: the prompt is the same for all.
    assert [p.logprobs for p in params] == [LogprobsRequest(2, True), LogprobsRequest(2), LogprobsRequest(2)]
    unseeded = choice_params(GenerationParams(8, SamplingParams(temperature=1.0)), Choices(2, best_of=4))
    assert [p.sampling.seed for p in unseeded] == [None] * 4
    assert all(p.logprobs == LogprobsRequest() for p in unseeded)  # ranking needs them


def outcome(text: str, *lps: float) -> Outcome:
    return Outcome(text, Finished("length", 3, len(lps)), [TokenLogprob(1, v) for v in lps])


def test_best_of_keeps_the_highest_cumulative_logprobs_in_order() -> None:
    outs = [outcome("a", -1.0, -2.0), outcome("b", -0.5), outcome("c", -0.1, -0.1, -0.1), outcome("d", -0.5)]
    assert [o.text for o in best(outs, Choices(2, best_of=4))] == ["c", "b"]  # ties: the earlier
    assert [o.text for o in best(outs, Choices(3))] == ["a", "b", "c"]  # n alone is not ranked
