"""Sequences opened together with the same prompt (a request's n choices) share one prefill:
the first is fed, the others get its KV cache by copy, and everything after is as if each
had been prefilled on its own."""

from __future__ import annotations

from typing import Any

import tinymodels

from specd.engine.params import LogprobsRequest, SamplingParams
from specd.engine.tasks import SequenceSpec, VerifyTask

PROMPT = [5, 9, 14, 2, 7, 7, 30, 11]
OTHER = [3, 4, 5, 6]


def fed_rows(engine: Any) -> list[list[int]]:
    """Record the token rows every forward of `engine` feeds."""
    rows: list[list[int]] = []
    forward = engine.lm.forward

    def recording(batch: Any) -> Any:
        rows.extend(list(r.tokens) for r in batch)
        return forward(batch)

    engine.lm.forward = recording
    return rows


def decode(engine: Any, ids: list[str], steps: int) -> dict[str, list[int]]:
    """Target-only rounds for `ids`: the tokens each committed."""
    out: dict[str, list[int]] = {sid: [] for sid in ids}
    for _ in range(steps):
        tasks = [VerifyTask(sid, len(engine.table.get(sid).committed), [], None) for sid in ids]
        results, _ = engine.verify(tasks)
        for sid, r in zip(ids, results, strict=True):
            assert r.error is None, r.error
            out[sid].append(r.next_token)
    return out


def test_same_prompts_opened_together_are_prefilled_once(make_verifier) -> None:
    greedy = SamplingParams(temperature=0.0)
    shared = make_verifier()
    rows = fed_rows(shared)
    specs = [SequenceSpec(f"c{i}", PROMPT, greedy) for i in range(3)] + [SequenceSpec("o", OTHER, greedy)]
    assert shared.open(specs)[0] == [None] * 4
    assert rows == [PROMPT[:-1], OTHER[:-1]]  # one prefill of the shared prompt, one of the other
    # The prompt is prefilled once and copied; on a GPU the cache is backed whole whatever is written.
    assert shared.table.kv_bytes() == tinymodels.backed_kv_bytes(shared.table, 3 * (len(PROMPT) - 1) + len(OTHER) - 1)
    alone = make_verifier()
    for spec in specs:
        assert alone.open([spec])[0] == [None]
    ids = [s.sequence_id for s in specs]
    got, want = decode(shared, ids, 12), decode(alone, ids, 12)
    assert got == want
    assert got["c0"] == got["c1"] == got["c2"]


def test_seeded_choices_share_the_prefill_and_keep_their_own_randomness(make_verifier) -> None:
    specs = [SequenceSpec(f"c{i}", PROMPT, SamplingParams(temperature=1.0, seed=100 + i)) for i in range(3)]
    shared, alone = make_verifier(), make_verifier()
    rows = fed_rows(shared)
    assert shared.open(specs)[0] == [None] * 3
    assert rows == [PROMPT[:-1]]
    for spec in specs:
        alone.open([spec])
    ids = [s.sequence_id for s in specs]
    got = decode(shared, ids, 16)
    assert got == decode(alone, ids, 16)
    assert len({tuple(v) for v in got.values()}) == 3  # independent seeds, independent text


def test_a_prompt_already_open_is_not_shared_and_prompt_scoring_is_fed_each(make_verifier) -> None:
    engine = make_verifier()
    rows = fed_rows(engine)
    greedy = SamplingParams(temperature=0.0)
    engine.open([SequenceSpec("a", PROMPT, greedy)])
    engine.open([SequenceSpec("b", PROMPT, greedy)])  # a later open: its own prefill
    assert rows == [PROMPT[:-1], PROMPT[:-1]]
    del rows[:]
    scoring = SequenceSpec("s", PROMPT, greedy, logprobs=LogprobsRequest(top=1, prompt=True))
    assert engine.open([SequenceSpec("c", PROMPT, greedy), scoring])[0] == [None, None]
    assert rows == [PROMPT[:-1], PROMPT[:-1]]  # the one that scores its prompt is fed itself
    assert len(engine.table.get("s").prompt_logprobs or []) == len(PROMPT) - 1
