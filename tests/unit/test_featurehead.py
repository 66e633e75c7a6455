"""The feature drafter: the verifier's hidden states, their wire format, the gateway's log of them,
and a drafter that drafts from them exactly as its model computes."""

from __future__ import annotations

import pytest
import tinymodels
import torch

from drafter_service.engine import ModelDrafter
from gateway.round.hidden_log import HiddenLog
from gateway.round.membership import DrafterMembership
from gateway.round.messages import draft_request, read_verdicts, verify_request
from specd.engine import checkpoints, draftlm, featurehead, hidden_states, models
from specd.engine.errors import ErrorKind
from specd.engine.featurehead import FeatureTrack
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from specd.proto.speculative.v1 import verifier_pb2

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 17, 42, 8, 99, 3, 250, 61]


def target_states(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0].float()


def greedy(model, tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(tokens) :]


# -- the verifier ---------------------------------------------------------------------------


def test_verifier_returns_the_hidden_states_the_target_computed(make_verifier, tiny_target):
    """Row j of a verdict's hidden states is the target's last hidden state at hidden_start + j: the
    committed token it had not cached and then each accepted draft, nothing after a rejection."""
    verifier = make_verifier()
    errors, _ = verifier.open([SequenceSpec("a", PROMPT, GREEDY)])
    assert errors == [None]
    right = greedy(tiny_target, PROMPT, 4)
    wrong = (right[2] + 1) % int(tiny_target.config.vocab_size)
    # Round 1: the last prompt token, then three drafts of which the third is wrong.
    results, _ = verifier.verify([VerifyTask("a", len(PROMPT), [right[0], right[1], wrong], return_hidden=True)])
    r = results[0]
    assert r.error is None and r.num_accepted == 2 and r.next_token == right[2]
    assert r.hidden_start == len(PROMPT) - 1
    assert r.hidden is not None and r.hidden.dtype == torch.bfloat16
    assert r.hidden.shape == (3, tiny_target.config.hidden_size)  # last prompt token + 2 accepted drafts
    committed = PROMPT + right[:3]
    reference = target_states(tiny_target, committed)
    assert torch.allclose(r.hidden.float(), reference[len(PROMPT) - 1 : len(PROMPT) + 2], atol=2e-2, rtol=1e-2)
    # Round 2 goes on from the next position; a task that does not ask gets none.
    results, _ = verifier.verify([VerifyTask("a", len(committed), [], return_hidden=True)])
    assert results[0].hidden_start == len(committed) - 1 and results[0].hidden.shape[0] == 1
    reference = target_states(tiny_target, [*committed, results[0].next_token])
    assert torch.allclose(results[0].hidden.float()[0], reference[len(committed) - 1], atol=2e-2, rtol=1e-2)
    results, _ = verifier.verify([VerifyTask("a", len(committed) + 1, [])])
    assert results[0].hidden is None


def test_hidden_states_cross_the_wire_unchanged():
    rows = torch.randn(3, 16).to(torch.bfloat16)
    data = hidden_states.encode(rows)
    assert len(data) == 3 * 16 * 2
    assert torch.equal(hidden_states.decode(data, 16), rows)
    with pytest.raises(ValueError):
        hidden_states.decode(data[:-2], 16)
    with pytest.raises(ValueError):
        hidden_states.decode(data, 0)


# -- the gateway's log ----------------------------------------------------------------------


def rows_for(positions: range, width: int = 2) -> bytes:
    return b"".join(bytes([p % 256]) * (2 * width) for p in positions)


def test_hidden_log_keeps_positions_in_order_and_sends_what_is_new():
    log = HiddenLog(4)
    log.add(7, rows_for(range(7, 10)))
    assert (log.start, log.end) == (7, 10)
    log.add(10, rows_for(range(10, 12)))
    assert log.since(0) == (7, rows_for(range(7, 12)))
    assert log.since(9) == (9, rows_for(range(9, 12)))
    assert log.since(12) == (12, b"")
    log.add(11, rows_for(range(11, 13)))  # rows again from 11 replace what was there
    assert log.end == 13 and log.since(11) == (11, rows_for(range(11, 13)))
    log.add(20, rows_for(range(20, 21)))  # a gap: what cannot follow in order starts afresh
    assert (log.start, log.end) == (20, 21)
    log.add(21, b"\x00" * 3)  # not whole rows: dropped
    assert log.end == 21


class _Seq:
    def __init__(self, tokens: list[int], hidden: HiddenLog | None) -> None:
        self.id = "s"
        self.tokens = tokens
        self.drafter = DrafterMembership()
        self.hidden = hidden


def test_round_asks_for_hidden_states_and_forwards_the_new_ones_to_the_drafter():
    seq = _Seq(list(range(12)), HiddenLog(4))
    seq.drafter.want()
    seq.drafter.opened(10)
    request = verify_request(1, [seq], {}, {}, {})
    assert request.tasks[0].return_hidden_states
    reply = verifier_pb2.VerifyResponse(
        round_id=1,
        results=[
            verifier_pb2.VerifyResult(
                sequence_id="s", next_token_id=3, hidden_states=rows_for(range(9, 11)), hidden_start=9
            )
        ],
    )
    verdict = read_verdicts(request, reply, [seq])[0]
    assert (verdict.hidden_start, verdict.hidden_states) == (9, rows_for(range(9, 11)))
    seq.hidden.add(verdict.hidden_start, verdict.hidden_states)
    from gateway.round.messages import DraftItem

    task = draft_request(2, [DraftItem(seq, 4)], {}).tasks[0]
    assert (task.hidden_start, task.hidden_states) == (9, rows_for(range(9, 11)))
    seq.drafter.sent_hidden(11)
    task = draft_request(3, [DraftItem(seq, 4)], {}).tasks[0]
    assert task.hidden_states == b""
    # Without a drafter that reads them, nothing is asked for or sent.
    plain = _Seq(list(range(12)), None)
    assert not verify_request(1, [plain], {}, {}, {}).tasks[0].return_hidden_states


# -- the drafter ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head(tiny_target):
    vocab = torch.arange(int(tiny_target.config.vocab_size))
    model = featurehead.init_from_target(tiny_target, vocab)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        # Make the feature matter as much as the token, and the two differ from the target's layer.
        model.base_model.fc.weight.add_(torch.randn(model.base_model.fc.weight.shape, generator=gen) * 0.2)
    return model.eval()


def reference_drafts(
    model: featurehead.FeatureHeadLM, committed: list[int], prompt_len: int, real: dict[int, torch.Tensor], k: int
) -> list[int]:
    """Drafts computed without a cache: position j reads the real state at j - 1 (zeros in the prompt,
    the head's own prediction, rounded as the drafter keeps it, where no real one is known)."""
    tokens = list(committed)
    predicted: dict[int, torch.Tensor] = {}
    drafts = []
    with torch.inference_mode():
        for _ in range(k):
            feats = torch.zeros((1, len(tokens), model.feature_size))
            for j in range(prompt_len, len(tokens)):
                f = real.get(j - 1, predicted.get(j - 1))
                if f is not None:
                    feats[0, j] = f.float()
            out = model(torch.tensor([tokens]), feats)[0]
            predicted[len(tokens) - 1] = out[-1].to(torch.bfloat16)
            token = int(model.lm_head(out[-1]).argmax())
            drafts.append(token)
            tokens.append(token)
    return drafts


def test_feature_drafter_drafts_what_its_model_computes_from_the_verifiers_states(
    head, tiny_target, fingerprint, make_verifier
):
    """Round after round (rejections, a re-fed position whose state arrived late), the served drafts
    are those of the head run from scratch on the same tokens and states."""
    drafter = ModelDrafter(BatchedCausalLM(head, torch.device("cpu"), torch.float32), fingerprint, 4, 256, 8, 16)
    assert drafter.feature_size == head.feature_size
    verifier = make_verifier()
    spec = SequenceSpec("a", PROMPT, GREEDY)
    assert drafter.open([spec])[0] == [None] and verifier.open([spec])[0] == [None]
    committed = list(PROMPT)
    # The first token is the verifier's alone, with the state of the last prompt position.
    results, _ = verifier.verify([VerifyTask("a", len(committed), [], return_hidden=True)])
    committed.append(results[0].next_token)
    real = {results[0].hidden_start: results[0].hidden[0]}
    sent = hidden_states.encode(results[0].hidden)
    unsent, start = [committed[-1]], results[0].hidden_start
    accepted = 0
    for round_i in range(6):
        task = DraftTask("a", unsent, len(committed), 3, hidden_states=sent, hidden_start=start)
        if round_i == 2:
            task = DraftTask("a", unsent, len(committed), 3)  # this round's states are lost...
        proposals, _ = drafter.draft([task])
        assert proposals[0].error is None and len(proposals[0].tokens) == 3
        if round_i != 2:
            # (Without this round's states it drafts from its own predictions of them: other drafts.)
            assert proposals[0].tokens == reference_drafts(head, committed, len(PROMPT), real, 3), round_i
        if round_i == 2:
            # ...and arrive with the next round's: the drafter feeds those positions again.
            pending_sent, pending_start = sent, start
        results, _ = verifier.verify([VerifyTask("a", len(committed), proposals[0].tokens, return_hidden=True)])
        r = results[0]
        accepted += r.num_accepted
        emitted = [*proposals[0].tokens[: r.num_accepted], r.next_token]
        for j in range(r.hidden.shape[0]):
            real[r.hidden_start + j] = r.hidden[j]
        sent, start = hidden_states.encode(r.hidden), r.hidden_start
        if round_i == 2:
            sent, start = pending_sent + sent, pending_start
        committed += emitted
        unsent = emitted


def test_feature_track_refeeds_only_what_it_fed_without_the_real_state():
    track = FeatureTrack(prompt_len=4)
    state = torch.ones(8)
    # Prompt positions are right with zeros; position 4 needs the state at 3.
    assert track.feature_for(2) == (None, True)
    assert track.feature_for(4) == (None, False)
    track.predicted[3] = state * 2
    f, right = track.feature_for(4)
    assert torch.equal(f, state * 2) and not right
    track.fed(4, 3, 0)  # positions 4..6 fed from predictions
    assert track.right_prefix(7) == 4
    assert track.keep(7, 7) == 7  # no real state yet: re-feeding would change nothing
    track.add_real(3, torch.stack([state, state]))
    assert track.keep(7, 7) == 4  # now it has: go back to position 4
    assert track.keep(3, 7) == 3  # never past what the tokens confirm
    feats, right = track.features(4, 3)
    assert right == 2 and torch.equal(feats[0], state)
    track.fed(4, 3, right)
    assert track.fed_right == 6


def test_drafters_refuse_hidden_states_they_cannot_take(make_drafter, head, fingerprint):
    plain = make_drafter()
    plain.open([SequenceSpec("a", PROMPT, GREEDY)])
    rows = hidden_states.encode(torch.zeros(1, head.feature_size))
    proposals, _ = plain.draft([DraftTask("a", [7], len(PROMPT) + 1, 2, hidden_states=rows, hidden_start=7)])
    assert proposals[0].error is not None and proposals[0].error.kind is ErrorKind.INVALID_ARGUMENT
    drafter = ModelDrafter(BatchedCausalLM(head, torch.device("cpu"), torch.float32), fingerprint, 4, 256, 8, 16)
    drafter.open([SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY)])
    committed = len(PROMPT) + 1
    bad = [
        DraftTask("a", [7], committed, 2, hidden_states=rows[:-2], hidden_start=7),  # not whole rows
        DraftTask("b", [7], committed, 2, hidden_states=rows, hidden_start=8),  # a position not verified yet
    ]
    proposals, _ = drafter.draft(bad)
    assert all(p.error is not None and p.error.kind is ErrorKind.INVALID_ARGUMENT for p in proposals)
    # Refused tasks changed nothing: the same round, well formed, drafts.
    good = [DraftTask(sid, [7], committed, 2, hidden_states=rows, hidden_start=7) for sid in ("a", "b")]
    proposals, _ = drafter.draft(good)
    assert all(p.error is None and len(p.tokens) == 2 for p in proposals)


# -- storage ----------------------------------------------------------------------------------


def test_feature_head_saves_and_loads_borrowing_the_targets_tensors(head, tiny_target, tok, tmp_path):
    target_dir = tinymodels.save(tiny_target, tok, tmp_path / "target")
    head_from = featurehead.target_head_name(target_dir)
    sha = draftlm.tensor_sha256(draftlm.read_target_tensor(target_dir, head_from))
    out = tmp_path / "drafter"
    featurehead.save(head, out, {"target": str(target_dir), "seed": 0, "head_sha256": sha}, torch.float32, head_from)
    assert checkpoints.is_distilled(out)
    loaded = models.load_distilled(out, torch.float32, lambda spec: target_dir)
    ids = torch.tensor([PROMPT])
    feats = torch.randn(1, len(PROMPT), head.feature_size)
    with torch.inference_mode():
        assert torch.allclose(loaded(ids, feats), head(ids, feats), atol=1e-5)
    other = tinymodels.build_model(99, int(tiny_target.config.vocab_size), 1, 2)
    other_dir = tinymodels.save(other, tok, tmp_path / "other")
    with pytest.raises(ValueError, match="borrows"):
        models.load_distilled(out, torch.float32, lambda spec: other_dir)


def test_gateway_refuses_a_feature_drafter_trained_for_another_width(tok):
    from types import SimpleNamespace

    from gateway.backends import BackendError, check_compatible
    from specd.engine.fingerprint import TokenizerFingerprint
    from specd.proto.speculative.v1 import common_pb2

    fp = TokenizerFingerprint.of(tok)
    verifier = SimpleNamespace(fingerprint=fp, info=common_pb2.ModelInfo(hidden_size=64))

    def drafter(width: int) -> SimpleNamespace:
        return SimpleNamespace(
            fingerprint=fp, kind=common_pb2.DRAFTER_KIND_MODEL, address="d:1", feature_size=width, info=None
        )

    check_compatible(fp, verifier, drafter(64))
    check_compatible(fp, verifier, drafter(0))  # reads none: any target
    with pytest.raises(BackendError, match="width 32"):
        check_compatible(fp, verifier, drafter(32))


def test_a_feature_drafter_proposes_no_branches(head, fingerprint):
    """It has no target hidden states for a branch's positions: a fan-out task drafts its main block only."""
    drafter = ModelDrafter(BatchedCausalLM(head, torch.device("cpu"), torch.float32), fingerprint, 4, 256, 8, 16)
    assert drafter.open([SequenceSpec("a", PROMPT, GREEDY)])[0] == [None]
    task = DraftTask("a", [], len(PROMPT), 3, (7, 8), guess_first=True, num_branches=2)
    (proposal,), _ = drafter.draft([task])
    assert proposal.error is None and len(proposal.tokens) == 3 and proposal.branches == []
    assert drafter.table.branches_held == 0
