"""Property tests of round messages (hypothesis, bounded): whatever garbage shares a round
with a sequence, that sequence's result and state are what they would be alone, and a
refused task leaves its own sequence as it was."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.engine.errors import EngineError
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, SparseDist, VerifyTask

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [11, 22, 33, 44, 55, 11, 22]
LIMITS = {"max_sequences": 4, "max_context": 96, "max_draft_tokens": 4}
IDS = ["w", "victim", "nope", ""]
FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def tokens(vocab_size: int, max_size: int = 6) -> st.SearchStrategy[list[int]]:
    edge = st.sampled_from([-1, -(2**31), vocab_size, vocab_size + 1, 2**31 - 1])
    return st.lists(st.one_of(st.integers(0, vocab_size - 1), edge), max_size=max_size)


def sparse(vocab_size: int) -> st.SearchStrategy[SparseDist]:
    return st.builds(
        SparseDist,
        st.lists(st.integers(-2, vocab_size + 2), max_size=4),
        st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=4),
    )


def verify_tasks(vocab_size: int) -> st.SearchStrategy[VerifyTask]:
    return st.builds(
        VerifyTask,
        st.sampled_from(IDS),
        st.integers(-3, 40),
        tokens(vocab_size),
        st.lists(sparse(vocab_size), max_size=3),
    )


def draft_tasks(vocab_size: int) -> st.SearchStrategy[DraftTask]:
    return st.builds(
        DraftTask, st.sampled_from(IDS), tokens(vocab_size, 4), st.integers(-3, 40), st.integers(-2, 2**32 - 1)
    )


def state_of(engine, sid: str) -> tuple[list[int], list[int], int]:
    s = engine.table.get(sid)
    return list(s.committed), list(s.cached), s.slot


def open_all(engine, *ids: str) -> None:
    errors, _ = engine.open([SequenceSpec(i, list(PROMPT), GREEDY) for i in ids])
    assert errors == [None] * len(ids)


@FUZZ
@given(data=st.data())
def test_verify_round_garbage_touches_no_other_sequence(make_verifier, vocab_size, data):
    dirty, clean = make_verifier(**LIMITS), make_verifier(**LIMITS)
    open_all(dirty, "w", "victim")
    open_all(clean, "w")
    for round_no in range(3):
        garbage = data.draw(st.lists(verify_tasks(vocab_size), max_size=4), label=f"round {round_no}")
        drafts = [100 + round_no, 200 + round_no]
        witness = VerifyTask("w", len(dirty.table.get("w").committed), drafts)
        victim_before = state_of(dirty, "victim")
        results, _ = dirty.verify([witness, *garbage])
        alone, _ = clean.verify([VerifyTask("w", witness.num_committed, drafts)])
        assert (results[0].error, results[0].num_accepted, results[0].next_token) == (
            None,
            alone[0].num_accepted,
            alone[0].next_token,
        )
        assert state_of(dirty, "w")[:2] == state_of(clean, "w")[:2]
        served = [(t, r) for t, r in zip(garbage, results[1:], strict=True) if r.error is None]
        for task, result in zip(garbage, results[1:], strict=True):
            if task.sequence_id in ("w", "nope", ""):
                assert isinstance(result.error, EngineError)  # a duplicate or an unknown id
        assert len(served) <= 1  # only the first task of the victim can be served in a round
        committed, _, slot = state_of(dirty, "victim")
        if served:
            task, result = served[0]
            grown = [*task.draft_tokens[: result.num_accepted], result.next_token]
            assert committed == victim_before[0] + grown
        else:
            assert (committed, slot) == (victim_before[0], victim_before[2])


@FUZZ
@given(data=st.data())
def test_draft_round_garbage_touches_no_other_sequence(make_drafter, vocab_size, data):
    dirty, clean = make_drafter(**LIMITS), make_drafter(**LIMITS)
    open_all(dirty, "w", "victim")
    open_all(clean, "w")
    for round_no in range(3):
        garbage = data.draw(st.lists(draft_tasks(vocab_size), max_size=4), label=f"round {round_no}")
        new = [300 + round_no]
        witness = DraftTask("w", new, len(dirty.table.get("w").committed) + 1, 3)
        victim_before = state_of(dirty, "victim")
        proposals, _ = dirty.draft([witness, *garbage])
        alone, _ = clean.draft([DraftTask("w", new, witness.num_committed, 3)])
        assert proposals[0].error is None and proposals[0].tokens == alone[0].tokens
        assert state_of(dirty, "w")[0] == state_of(clean, "w")[0]
        served = [t for t, p in zip(garbage, proposals[1:], strict=True) if p.error is None]
        for task, proposal in zip(garbage, proposals[1:], strict=True):
            if task.sequence_id in ("w", "nope", "") or task.num_draft_tokens < 0:
                assert isinstance(proposal.error, EngineError)
            elif proposal.error is None:
                assert len(proposal.tokens) == task.num_draft_tokens
        assert len(served) <= 1
        committed = state_of(dirty, "victim")[0]
        assert committed == victim_before[0] + (list(served[0].new_tokens) if served else [])
