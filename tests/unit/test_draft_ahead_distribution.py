"""Exactness in distribution of draft-ahead, through the real drafter and verifier engines.

The harness of test_engine_distribution (its tiny target, top-k 4 at temperature
1.5, a drafter whose q keeps 2 tokens, the target's exact two-token joint), with
the rounds the gateway runs for draft-ahead: a sequence's first round is
target-only while the drafter drafts ahead beside it, guessing the verifier's
token 1 and drafting K tokens after the guess. If the guess was right, round 2
verifies those drafts; if not, the ahead block is dropped and round 2 drafts
again after the token committed (the drafter rolls its guess back) before
verifying. Both branches must give token 2 the target's distribution, whatever
the drafter: this one is initialised independently of the target.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import tinymodels
import torch
from test_engine_distribution import (
    BATCH,
    DETECTED_P_VALUE,
    MAX_SUPPORT,
    MIN_P_VALUE,
    PROMPT,
    SEQUENCES,
    VOCAB,
    K,
    Pairs,
    engines,
    first_two,
    next_token_probs,
    open_batch,
    p_value,
    target_joint,
)
from transformers import LlamaForCausalLM

from gateway.round.apply import ahead_block
from gateway.round.messages import DraftItem
from specd.engine.sampling import truncate
from specd.engine.tasks import DraftProposal, DraftTask, SparseDist, VerifyTask
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.rpc.serving import dist_from_pb

Block = tuple[list[int], list[SparseDist]]

# A far drafter: its next-token distribution is at least this far (total variation) from
# the target's at the prompt and after every possible token 1. The perturbed copy that
# test_engine_distribution drafts with is about 0.2 from it after two of them.
FAR = 0.5


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().sum() / 2)


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tinymodels.build_model(0, VOCAB, 0, 1)


@pytest.fixture(scope="module")
def far_draft(target: LlamaForCausalLM) -> LlamaForCausalLM:
    # Independent weights, same vocabulary. Most seeds' likeliest token at the prompt is
    # outside the target's top 4, so their guess never hits and the ahead branch would go
    # untested; this one's is the target's second likeliest (p = 0.23).
    draft = tinymodels.build_model(5, VOCAB, 0, 1)
    # Every test that drafts with it relies on its being far, so the fixture checks it.
    contexts = [PROMPT] + [[*PROMPT, a] for a in next_token_probs(target, PROMPT).nonzero().flatten().tolist()]
    distances = [total_variation(next_token_probs(target, c), next_token_probs(draft, c)) for c in contexts]
    assert min(distances) > FAR, distances
    return draft


@pytest.fixture(scope="module")
def joint(target: LlamaForCausalLM) -> dict[tuple[int, int], float]:
    return target_joint(target)


@dataclass
class AheadRun:
    pairs: Pairs = field(default_factory=list)
    hits: int = 0  # guesses at token 1 that were right: round 2 verified the ahead block
    misses: int = 0
    ahead_accepted: int = 0  # hits whose token 2 is a draft of the ahead block


def after_the_guess(proposal: DraftProposal) -> Block:
    """The ahead block the gateway verifies, made by the gateway's own `gateway.round.apply.ahead_block`
    from the proposal as the wire carries it: what follows the guess, with each draft's q."""
    wire = drafter_pb2.DraftProposal(
        token_ids=proposal.tokens,
        distributions=[common_pb2.SparseDistribution(token_ids=d.token_ids, probs=d.probs) for d in proposal.dists],
    )
    # Drafted ahead of the sequence's first verify (nothing assumed): the first draft is the guess.
    item = DraftItem(SimpleNamespace(tokens=list(PROMPT)), len(proposal.tokens), assumed=())  # type: ignore[arg-type]
    block = ahead_block(item, wire)
    assert block is not None and block.tail == (proposal.tokens[0],) and block.base == len(PROMPT) + 1
    return block.tokens, [dist_from_pb(d) for d in block.distributions]


def ahead_first_two(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    seeded: bool,
    block_of: Callable[[DraftProposal], Block] = after_the_guess,
) -> AheadRun:
    """First two tokens of SEQUENCES sequences, through draft-ahead's first two rounds."""
    verifier, drafter = engines(target, draft, max_draft_tokens=K + 1)
    run = AheadRun()

    @functools.cache
    def q_after(*context: int) -> dict[int, float]:
        ids, probs = truncate(next_token_probs(draft, list(context))[None], MAX_SUPPORT)
        return {i: p for i, p in zip(ids[0].tolist(), probs[0].tolist(), strict=True) if p > 0}

    def assert_drafted_after(dist: SparseDist, *context: int) -> None:
        # The rejection rule is exact for drafts from any q they come with, so the chi-square
        # cannot see a block drafted after the wrong tokens (a guess not rolled back, an ahead
        # block not after its guess): each block's first q must be the drafter's after them.
        actual = dict(zip(dist.token_ids, dist.probs, strict=True))
        assert actual == pytest.approx(q_after(*context), abs=1e-5)

    for start in range(0, SEQUENCES, BATCH):
        ids = open_batch(verifier, drafter, start, seeded)
        # Round 1: target-only, so that token 1 waits for no drafts; beside it the drafter
        # guesses token 1 and drafts K tokens after its guess.
        ahead, _ = drafter.draft([DraftTask(sid, [], len(PROMPT), K + 1, guess_first=True) for sid in ids])
        verdicts, _ = verifier.verify([VerifyTask(sid, len(PROMPT), []) for sid in ids])
        first: dict[str, int] = {}
        blocks: dict[str, Block] = {}
        for sid, proposal, verdict in zip(ids, ahead, verdicts, strict=True):
            assert proposal.error is None and verdict.error is None
            assert len(proposal.tokens) == K + 1
            first[sid] = verdict.next_token
            if not seeded:  # a seeded draft comes without its q (the coupling needs none)
                assert_drafted_after(proposal.dists[1], *PROMPT, proposal.tokens[0])
            if proposal.tokens[0] == verdict.next_token:
                blocks[sid] = block_of(proposal)
        # Round 2: a missed guess drops the ahead block; the drafter hears of the token
        # committed in its place, rolls back the guess and drafts K after it.
        missed = [sid for sid in ids if sid not in blocks]
        fresh, _ = drafter.draft([DraftTask(sid, [first[sid]], len(PROMPT) + 1, K) for sid in missed])
        for sid, proposal in zip(missed, fresh, strict=True):
            assert proposal.error is None
            if not seeded:
                assert_drafted_after(proposal.dists[0], *PROMPT, first[sid])
            blocks[sid] = (proposal.tokens, proposal.dists)
        tasks = [VerifyTask(sid, len(PROMPT) + 1, *blocks[sid]) for sid in ids]
        verdicts, _ = verifier.verify(tasks)
        for task, verdict in zip(tasks, verdicts, strict=True):
            assert verdict.error is None, verdict.error
            second = task.draft_tokens[0] if verdict.num_accepted else verdict.next_token
            run.pairs.append((first[task.sequence_id], second))
            if task.sequence_id in missed:
                run.misses += 1
            else:
                run.hits += 1
                run.ahead_accepted += verdict.num_accepted > 0
        verifier.close(ids)
        drafter.close(ids)
    return run


def assert_both_branches_ran(run: AheadRun) -> None:
    """Guards against a vacuous pass: a guess that always missed would leave the ahead block untested."""
    assert run.hits > SEQUENCES // 10 and run.misses > SEQUENCES // 10, (run.hits, run.misses)


def test_draft_ahead_with_a_far_drafter_emits_the_target_joint(target, far_draft, joint):
    run = ahead_first_two(target, far_draft, seeded=False)
    assert_both_branches_ran(run)
    # The ahead drafts decide token 2 often enough for their q to matter.
    assert run.ahead_accepted > SEQUENCES // 20, run.ahead_accepted
    assert p_value(joint, run.pairs) > MIN_P_VALUE


def test_draft_ahead_with_a_far_drafter_emits_the_target_only_tokens_of_each_seed(target, far_draft):
    # A seeded guess is the drafter's noisy argmax under the verifier's noise at token 1 (the
    # coupling's draft), not its likeliest token, so it hits at a rate of its own.
    run = ahead_first_two(target, far_draft, seeded=True)
    target_only, _ = first_two(target, far_draft, seeded=True, k=0)
    assert_both_branches_ran(run)
    assert run.pairs == target_only


# -- the same test, proven able to fail -------------------------------------------------
#
# Verifying the ahead block after a missed guess is no such mutant: its drafts, conditioned
# on the wrong token 1, still come with the q they were drawn from, and the rejection rule is
# exact for any such q (30000 sequences: p = 0.5). The gateway drops the block because those
# drafts would mostly be rejected, not for exactness. What breaks exactness is a q that did
# not draw the drafts.


def likeliest_after_the_guess(proposal: DraftProposal) -> Block:
    """A drafter that picks every token of an ahead block as it picks the guess (its likeliest,
    not a sample) while it still sends the q it would have sampled from: the rejection rule is
    then fed drafts that q did not draw."""
    _, dists = after_the_guess(proposal)
    return [d.token_ids[max(range(len(d.probs)), key=d.probs.__getitem__)] for d in dists], dists


def test_ahead_drafts_not_sampled_from_their_q_are_detected(target, far_draft, joint):
    run = ahead_first_two(target, far_draft, seeded=False, block_of=likeliest_after_the_guess)
    assert_both_branches_ran(run)
    assert p_value(joint, run.pairs) < DETECTED_P_VALUE
