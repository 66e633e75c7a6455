"""The drafter-membership state machine and the pure round functions."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from gateway.round.hidden_log import HiddenLog
from gateway.round.membership import MAX_REJOINS, DrafterMembership, DrafterState, MembershipError
from gateway.round.messages import (
    Block,
    DraftItem,
    ProtocolError,
    Verdict,
    draft_request,
    read_drafts,
    read_guesses,
    read_verdicts,
    verify_request,
)
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2


def test_the_happy_path() -> None:
    m = DrafterMembership()
    assert m.state is DrafterState.OFF and not m.on_drafter and not m.drafting
    m.want()
    assert m.pending and not m.on_drafter
    m.opened(10)
    assert m.drafting and m.on_drafter and m.synced == 10
    m.synced_to(14)
    m.park()
    assert m.on_drafter and not m.drafting
    m.park()  # parking twice is harmless: two refusals in one round
    m.drafter_down()
    assert m.pending


def test_refused_is_for_good() -> None:
    m = DrafterMembership()
    m.want()
    m.refused()
    assert m.state is DrafterState.OFF
    with pytest.raises(MembershipError):
        m.opened(3)


def test_lost_rejoins_a_few_times_then_gives_up() -> None:
    m = DrafterMembership()
    m.want()
    for _ in range(MAX_REJOINS):
        m.opened(5)
        m.lost()
        assert m.pending
    m.opened(5)
    m.lost()
    assert m.state is DrafterState.OFF


@pytest.mark.parametrize(
    ("setup", "event"),
    [
        ([], "opened"),
        ([], "park"),
        ([], "lost"),
        ([], "drafter_down"),
        (["want"], "want"),
        (["want"], "park"),
        (["want"], "synced_to"),
        (["want", "opened"], "want"),
        (["want", "opened"], "opened"),
        (["want", "opened"], "refused"),
    ],
)
def test_transitions_that_make_no_sense_are_refused(setup: list[str], event: str) -> None:
    m = DrafterMembership()
    for step in setup:
        getattr(m, step)(*([1] if step in ("opened", "synced_to") else []))
    with pytest.raises(MembershipError):
        getattr(m, event)(*([1] if event in ("opened", "synced_to") else []))


@dataclass
class Seq:
    id: str
    tokens: list[int]
    drafter: DrafterMembership = field(default_factory=DrafterMembership)
    hidden: HiddenLog | None = None


def test_block_validity() -> None:
    plain = Block([7, 8], [], base=3)
    assert plain.valid_for([1, 2, 3]) and not plain.valid_for([1, 2, 3, 4])
    ahead = Block([9], [], base=5, tail=(3, 4, 5))
    assert ahead.valid_for([1, 2, 3, 4, 5])
    assert not ahead.valid_for([1, 2, 3, 4, 6])  # the guess at the verifier's token missed
    assert not ahead.valid_for([1, 2, 3, 4])


def test_requests_carry_what_each_sequence_needs() -> None:
    a, b = Seq("a", [1, 2, 3, 4]), Seq("b", [5, 6])
    a.drafter.want()
    a.drafter.opened(2)
    b.drafter.want()
    b.drafter.opened(2)
    req = draft_request(7, [DraftItem(a, 3), DraftItem(b, 2, assumed=(9, 9))], {"b": {"traceparent": "x"}})
    assert req.round_id == 7
    assert [list(t.new_token_ids) for t in req.tasks] == [[3, 4], []]
    assert [t.num_committed for t in req.tasks] == [4, 2]
    assert [list(t.assumed_token_ids) for t in req.tasks] == [[], [9, 9]]
    assert [t.guess_first for t in req.tasks] == [False, True]  # a draft-ahead guesses first
    assert dict(req.tasks[1].trace_context) == {"traceparent": "x"}
    blocks = {"a": Block([11, 12, 13], [], base=4)}
    vreq = verify_request(7, [a, b], blocks, {"a": 2, "b": 0}, {})
    assert [list(t.draft_token_ids) for t in vreq.tasks] == [[11, 12], []]


def test_read_drafts_sorts_lost_refused_and_bad_proposals() -> None:
    seqs = [Seq(x, [1]) for x in "abcd"]
    items = [DraftItem(s, 2) for s in seqs]
    reply = drafter_pb2.DraftResponse()
    reply.proposals.add(sequence_id="a", token_ids=[4, 5])
    reply.proposals.add(sequence_id="b").error.code = common_pb2.ERROR_CODE_NOT_FOUND
    reply.proposals.add(sequence_id="c").error.code = common_pb2.ERROR_CODE_INVALID_ARGUMENT
    reply.proposals.add(sequence_id="d", token_ids=[1, 2, 3])  # more than asked
    v = read_drafts(items, reply)
    assert list(v.proposals) == ["a"]
    assert [s.id for s, _ in v.lost] == ["b"]
    assert [s.id for s, _ in v.refused] == ["c", "d"]
    reply.proposals[0].sequence_id = "z"
    assert read_drafts(items, reply).protocol_error


def test_read_guesses_counts_only_blocks_whose_assumption_held() -> None:
    a, b, c, d, e, f = (Seq(x, [1, 2]) for x in "abcdef")
    # Each ahead block assumed drafts 5, 6 accepted, then guessed 7 for the verifier's token.
    blocks = [(s, Block([8], [], base=5, tail=(5, 6, 7))) for s in (a, b, c, d, e, f)]
    verdicts = [
        Verdict(a, drafted=2, accepted=2, tokens=(5, 6, 7)),  # all accepted, guess right
        Verdict(b, drafted=2, accepted=2, tokens=(5, 6, 4)),  # all accepted, guess wrong
        Verdict(c, drafted=2, accepted=1, tokens=(5, 4)),  # a draft rejected: nothing said of the guess
        Verdict(d, drafted=2, drafts_refused=True),
        # A sibling of the second draft accepted in its place: the assumed chain did not hold.
        Verdict(f, drafted=2, accepted=2, tokens=(5, 3, 7), siblings=1, sibling_hit=True),
    ]  # e: no verdict at all
    assert [(s.id, hit) for s, hit in read_guesses(blocks, verdicts)] == [("a", True), ("b", False)]
    # A block drafted after the committed tokens alone (a cohort's) holds no guess.
    assert read_guesses([(a, Block([8], [], base=2))], verdicts[:1]) == []


def test_read_verdicts() -> None:
    seqs = [Seq(x, [1]) for x in "abc"]
    req = verifier_pb2.VerifyRequest()
    for s in seqs:
        req.tasks.add(sequence_id=s.id, num_committed=1, draft_token_ids=[5, 6])
    reply = verifier_pb2.VerifyResponse()
    reply.results.add(sequence_id="a", num_accepted=1, next_token_id=9)
    reply.results.add(sequence_id="b").error.code = common_pb2.ERROR_CODE_INVALID_ARGUMENT
    reply.results.add(sequence_id="c").error.code = common_pb2.ERROR_CODE_NOT_FOUND
    a, b, c = read_verdicts(req, reply, seqs)
    assert a.tokens == (5, 9) and a.accepted == 1 and a.drafted == 2
    assert b.drafts_refused and b.error is None
    assert c.error is not None and c.error.status == 503
    reply.results[0].num_accepted = 3
    with pytest.raises(ProtocolError):
        read_verdicts(req, reply, seqs)
    reply.results[0].sequence_id = "x"
    with pytest.raises(ProtocolError):
        read_verdicts(req, reply, seqs)
