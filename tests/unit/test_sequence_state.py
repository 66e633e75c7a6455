"""A sequence's life as a state machine: the table is the whole truth of which moves are legal."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.failures import GenerationError
from gateway.round.detokenize import TextStream
from gateway.round.membership import DRAFTER_TRANSITIONS, DrafterMembership, DrafterState, MembershipError
from gateway.round.state import (
    LIFE_TRANSITIONS,
    Failed,
    GenerationParams,
    Life,
    SequenceLife,
    _Sequence,
    fail,
    opened,
    phase,
    prefill_left,
)
from specd.engine.params import SamplingParams


class Tokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def sequence() -> _Sequence:
    return _Sequence("s", [1, 2], GenerationParams(4, SamplingParams()), 4, TextStream(Tokenizer(), ()), tokens=[1, 2])


@pytest.mark.parametrize("event", sorted(LIFE_TRANSITIONS))
@pytest.mark.parametrize("start", list(Life))
def test_every_life_move_is_allowed_exactly_where_the_table_says(event: str, start: Life) -> None:
    allowed, to = LIFE_TRANSITIONS[event]
    life = SequenceLife(start)
    if start in allowed:
        life.move(event)
        assert life.state is to
    else:
        with pytest.raises(MembershipError):
            life.move(event)
        assert life.state is start


def test_the_life_table_has_an_entry_and_an_end_for_every_state() -> None:
    entered = {to for _, to in LIFE_TRANSITIONS.values()}
    left = set().union(*(allowed for allowed, _ in LIFE_TRANSITIONS.values()))
    assert entered | {Life.WAITING} == set(Life)  # every state is reached (WAITING by submitting)
    assert left == set(Life) - {Life.DONE, Life.FAILED}  # only the two endings are final


@pytest.mark.parametrize("event", sorted(DRAFTER_TRANSITIONS))
@pytest.mark.parametrize("start", list(DrafterState))
def test_every_drafter_move_is_allowed_exactly_where_the_table_says(event: str, start: DrafterState) -> None:
    allowed, to = DRAFTER_TRANSITIONS[event]
    m = DrafterMembership(start)
    if start in allowed:
        m._move(event)
        assert m.state is to
    else:
        with pytest.raises(MembershipError):
            m._move(event)
        assert m.state is start


def test_a_sequence_s_phases_through_a_chunked_open_and_a_drafter_join() -> None:
    s = sequence()
    assert phase(s) == "waiting" and not s.done
    opened(s, 30)
    assert phase(s) == "prefilling" and s.prefill_pending == 30
    prefill_left(s, 10)
    assert phase(s) == "prefilling"
    prefill_left(s, 0)
    assert phase(s) == "target-only"
    s.drafter.want()
    assert phase(s) == "joining"
    s.drafter.opened(2)
    s.drafter_prefill_pending = 5
    assert phase(s) == "joining"  # open on the drafter, still prefilling there
    s.drafter_prefill_pending = 0
    assert phase(s) == "drafting"
    s.drafter.park()
    assert phase(s) == "parked"
    s.life.move("finish")
    assert phase(s) == "done" and s.done


def test_failing_ends_a_sequence_once_and_tells_its_client() -> None:
    s = sequence()
    error = GenerationError(503, "gone", "service_unavailable")
    fail(s, error)
    fail(s, GenerationError(500, "second"))
    assert s.life.state is Life.FAILED and s.done
    assert s.events.qsize() == 1 and s.events.get_nowait() == Failed(error)
    with pytest.raises(MembershipError):
        opened(s, 0)  # a failed sequence is never opened


def test_a_finished_sequence_cannot_fail_or_finish_again() -> None:
    s = sequence()
    opened(s, 0)
    s.life.move("finish")
    fail(s, GenerationError(500, "late"))
    assert s.life.state is Life.DONE and s.events.empty()
    with pytest.raises(MembershipError):
        s.life.move("finish")


def test_only_the_state_machines_assign_a_state() -> None:
    """Every change of a sequence's life or drafter standing goes through a table's move."""
    gateway = Path(__file__).resolve().parents[2] / "src" / "gateway"
    machines = {gateway / "round" / "state.py", gateway / "round" / "membership.py"}
    assigning = re.compile(r"(drafter\.state|life\.state|\.life)\s*=[^=]")
    offenders = [
        f"{path.relative_to(gateway)}:{n}"
        for path in gateway.rglob("*.py")
        if path not in machines
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if assigning.search(line)
    ]
    assert offenders == []
