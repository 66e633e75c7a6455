"""`--pipeline auto` in the scheduler, with in-process fake backends: exact output, visible choices."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_backends import EOS, FakeDrafter, FakeVerifier, reference
from test_scheduler import GREEDY, PROMPTS, CharTokenizer, collect

from gateway.round.observer import RoundOutcome
from gateway.round.scheduler import GenerationParams, Scheduler


def auto_scheduler(verifier: Any, drafter: Any, speculative_mode: str = "auto") -> Scheduler:
    return Scheduler(
        CharTokenizer(), verifier, drafter, 4, 16, [EOS], speculative_mode=speculative_mode, pipeline="auto"
    )


def run(sched: Scheduler, requests: list[tuple[list[int], str | None]], max_tokens: int) -> list[list[int]]:
    """Generate greedily; each request is (prompt, the pipeline it names or None)."""

    async def main() -> list[Any]:
        sched.start()
        try:
            seqs = [sched.submit(p, GenerationParams(max_tokens, GREEDY, pipeline=mode)) for p, mode in requests]
            return await asyncio.gather(*(collect(sched, s) for s in seqs))
        finally:
            await sched.stop()

    return [ids for ids, _ in asyncio.run(main())]


def record_outcomes(sched: Scheduler) -> list[RoundOutcome]:
    outcomes: list[RoundOutcome] = []
    real = sched.observer.observe
    sched.observer.observe = lambda o: outcomes.append(o) or real(o)  # type: ignore[method-assign]
    return outcomes


def rounds_by_pipeline(sched: Scheduler) -> dict[str, float]:
    family = next(m for m in sched.metrics.registry.collect() if m.name == "specd_pipeline_rounds")
    return {s.labels["pipeline"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("speculative_mode", ["auto", "fixed"])
@pytest.mark.parametrize("n", [1, 6])
def test_auto_pipeline_is_token_identical_to_target_only(speculative_mode: str, n: int) -> None:
    drafter = FakeDrafter()
    verifier = FakeVerifier(drafter=drafter)
    sched = auto_scheduler(verifier, drafter, speculative_mode)
    outputs = run(sched, [(p, None) for p in PROMPTS[:n]], 30)
    assert outputs == [reference(p, 30) for p in PROMPTS[:n]]
    assert verifier.stale_blocks == 0  # only blocks drafted after exactly the committed tokens
    assert verifier.committed == {} and drafter.committed == {}
    assert set(rounds_by_pipeline(sched)) <= {"sequential", "cohort", "ahead"}


# With several sequences draft-ahead pays only while nearly every block stands: one miss
# puts a draft exchange before the verify. (Cohorts cannot win with these fakes: an
# exchange costs the same whatever the batch, so two half-batch phases cost what one
# sequential round of the whole batch does.)
@pytest.mark.parametrize(("n", "wrong"), [(1, lambda n: n % 9 == 8), (4, lambda n: False)])
def test_a_drafter_as_slow_as_the_verifier_gets_overlapped(n: int, wrong: Any) -> None:
    """The fakes' exchanges are sleeps, so they overlap perfectly: once both services are
    timed and acceptance is learnt, auto must leave sequential for draft-ahead, and stay exact."""
    # Sleeps long enough that a loaded test machine's scheduling noise is small beside them.
    drafter = FakeDrafter(wrong=wrong, delay_s=0.02)
    verifier = FakeVerifier(delay_s=0.02, drafter=drafter)
    sched = auto_scheduler(verifier, drafter)
    outcomes = record_outcomes(sched)
    outputs = run(sched, [(p, None) for p in PROMPTS[:n]], 120)
    assert outputs == [reference(p, 120) for p in PROMPTS[:n]]
    assert verifier.stale_blocks == 0
    # Sequential rounds until both services are timed and acceptance is learnt (longer on a
    # loaded machine), then overlapped ones: most of the run's second half.
    chosen = [o.pipeline for o in outcomes]
    late = chosen[len(chosen) // 2 :]
    assert sum(p in ("ahead", "cohort") for p in late) > len(late) / 2, "".join(p[0] for p in chosen)
    counts = rounds_by_pipeline(sched)
    assert counts == {p: float(chosen.count(p)) for p in set(chosen)}  # the metric counts every round
    assert outcomes[0].pipeline == "sequential"  # before anything is timed
    assert sched.policy.overlap.samples > 0  # the overlap it relies on was measured


def test_requests_that_name_a_pipeline_keep_it_under_auto() -> None:
    drafter = FakeDrafter(wrong=lambda n: n % 9 == 8, delay_s=0.02)
    verifier = FakeVerifier(delay_s=0.02, drafter=drafter)
    sched = auto_scheduler(verifier, drafter)
    outcomes = record_outcomes(sched)
    requests: list[tuple[list[int], str | None]] = [(PROMPTS[0], None), (PROMPTS[1], "sequential")]
    outputs = run(sched, requests, 60)
    assert outputs == [reference(p, 60) for p, _ in requests]
    # Every round both ran in shows the named one beside what auto chose.
    both = [o.pipeline for o in outcomes if len(o.verdicts) == 2]
    assert both and all("sequential" in p.split("+") for p in both)
    assert any(p == "ahead+sequential" for p in both)


def test_a_draft_ahead_round_times_its_verify_apart_from_the_drafting_beside_it() -> None:
    """The policy prices draft-ahead's verifies and drafting as they ran beside each other: the
    round must time the verify's reply apart from its wait for a slower draft exchange, and
    keep the draft exchange's own times."""
    drafter = FakeDrafter(wrong=lambda n: False, delay_s=0.05)
    verifier = FakeVerifier(delay_s=0.005, drafter=drafter)
    sched = Scheduler(CharTokenizer(), verifier, drafter, 4, 16, [EOS], speculative_mode="fixed", pipeline="ahead")
    outcomes = record_outcomes(sched)
    assert run(sched, [(PROMPTS[0], None)], 20) == [reference(PROMPTS[0], 20)]
    beside = [o.times for o in outcomes if o.ahead_drafted]
    assert beside
    for times in beside:
        assert 0 < times.verify_reply_ns < times.verify_ns
        assert times.verify_ns - times.verify_reply_ns > 0.02e9  # the rest of the 0.05 s draft exchange
        assert times.overlap_ns >= 0.05e9 and times.overlap_forward_ns == 1_000_000  # as the drafter reported


def test_rounds_where_sequences_are_still_joining_the_drafter_run_a_choice_made_for_them() -> None:
    """Sequences waiting to join the drafter are offered to the policy as if ready, and draft
    nothing in the round that opens them: the round's ks and pipeline are then chosen again
    for the sequences that can draft, and that choice is the one the round is measured against."""
    # A verify dearer than a draft step, so that drafting pays once both are timed.
    drafter = FakeDrafter(wrong=lambda n: n % 9 == 8, delay_s=0.002)
    verifier = FakeVerifier(delay_s=0.03, drafter=drafter)
    sched = auto_scheduler(verifier, drafter)
    repeats: list[list[int]] = []
    real = sched.policy.choose

    def choose(
        candidates: Any, batch_size: int, pipelines: Any = ("sequential",), measurable: bool = True, again: bool = False
    ) -> list[int]:
        ks = real(candidates, batch_size, pipelines, measurable, again)
        if again:
            repeats.append(ks)
            assert all(k == 0 for c, k in zip(candidates, ks, strict=True) if c.cap == 0)
            choice = sched.policy.last_choice
            assert choice is None or choice.ks == ks
        return ks

    sched.policy.choose = choose  # type: ignore[method-assign]

    async def main() -> list[Any]:
        sched.start()
        try:
            out = []
            # The second wave meets a policy that drafts, in a batch larger than any it has drafted
            # for: its sequences open on the drafter after their first round, not beside their open.
            for wave in (PROMPTS[:2], PROMPTS[2:6]):
                seqs = [sched.submit(p, GenerationParams(30, GREEDY)) for p in wave]
                out += await asyncio.gather(*(collect(sched, s) for s in seqs))
            return out
        finally:
            await sched.stop()

    outputs = [ids for ids, _ in asyncio.run(main())]
    assert outputs == [reference(p, 30) for p in PROMPTS[:6]]
    assert repeats, "no round was chosen again while sequences were joining the drafter"
