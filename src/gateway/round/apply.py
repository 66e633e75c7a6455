"""Step three of a round: commit what the services answered, without I/O.

`apply(plan, result, eos)` reads the verifier's reply against the request it answered, commits
each sequence's verdict on its own (an exception for one fails that one alone), keeps the blocks
drafted ahead (where a draft-ahead fanned out, the branch its verdict confirms if its main block
missed), drops those the commits made stale, and records what the plan taught each
sequence. It returns an `Applied`: what the observer turns into metrics, spans and learning.
The sequences' events (text deltas, their finish) are queued here, as their tokens commit.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.failures import GenerationError, internal
from gateway.round.decide import ready_block
from gateway.round.exchange import RoundResult
from gateway.round.messages import Block, DraftItem, RoundPlan, Verdict, read_guesses, read_verdicts
from gateway.round.state import Delta, Finished, _Sequence, fail, prefill_left
from specd.proto.speculative.v1 import drafter_pb2
from specd.rpc.serving import token_logprob_from_pb

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Emission:
    """Tokens one sequence emitted: for the time-to-first-token and inter-token latency."""

    seq: Any
    tokens: int
    ttft_s: float | None  # its first tokens: the time since it was submitted
    itl_s: float | None  # later ones: the time since it last emitted


@dataclass
class Applied:
    """What a round committed."""

    verdicts: list[Verdict] = field(default_factory=list)  # the verify tasks' (not the prefill chunks')
    guesses: list[tuple[Any, bool]] = field(default_factory=list)  # draft-ahead guesses, and whether right
    wasted: int = 0  # drafts dropped because the commits made their block stale
    emitted: list[Emission] = field(default_factory=list)
    finished: list[tuple[Any, str]] = field(default_factory=list)  # (sequence, "stop" or "length")
    refused: int = 0  # verify blocks the verifier refused (bad drafts or q): their sequences went target-only
    # Fan-out draft-ahead: the branches drafted, those adopted (a missed main block's replacement),
    # and, for each branch whose verdict came as its main block missed, whether its guess was right.
    branches: int = 0
    branch_hits: int = 0
    branch_outcomes: list[bool] = field(default_factory=list)
    fan_out_misses: int = 0  # fanned-out draft-aheads whose verdict neither the main block nor a branch assumed


def internal_error(what: str, exc: BaseException) -> GenerationError:
    """Log a gateway bug under an id the client is told, so the two can be matched."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s while %s", error_id, what, exc_info=exc)
    return internal(f"internal error in the gateway (error id {error_id})")


def apply(plan: RoundPlan, result: RoundResult, eos: Collection[int]) -> Applied:
    """Commit a round: the plan's lessons, the blocks drafted ahead, then each verdict."""
    applied = Applied()
    for s in plan.verify:  # a verified sequence's block is used up by this round
        s.block = None
    for s, drafted in plan.counted:
        s.rounds_on_drafter += 1
        s.rounds_drafting += drafted
    for s in plan.joined_for_auto:
        s.joined_for_auto = True
    fans = _keep_ahead(result)
    everything = read_verdicts(result.request, result.reply, [*plan.verify, *(s for s, _ in plan.prefill)])
    for v in everything:
        apply_verdict(v, eos, applied)
    applied.verdicts = [v for v in everything if v.prefill_pending is None]
    ahead = [(item.seq, item.seq.block) for item in result.ahead_items]
    applied.guesses = read_guesses([(s, b) for s, b in ahead if b is not None and b.tail], applied.verdicts)
    for seq, base, branches in fans:
        adopt_branch(seq, base, branches, applied)
    applied.wasted += drop_stale_blocks([item.seq for item in result.ahead_items])
    return applied


def _keep_ahead(result: RoundResult) -> list[tuple[Any, int, list[Block]]]:
    """What the drafter made beside the verify: each sequence's next block; returns the
    branches of each draft-ahead that fanned out, with its committed length now."""
    fans: list[tuple[Any, int, list[Block]]] = []
    if result.ahead is None:
        return fans
    for item in result.ahead_items:
        proposal = result.ahead.verdicts.proposals.get(item.seq.id)
        item.seq.block = ahead_block(item, proposal)
        if proposal is not None and proposal.branches:
            fans.append((item.seq, len(item.seq.tokens), branch_blocks(item, proposal)))
    return fans


def ahead_block(item: DraftItem, proposal: drafter_pb2.DraftProposal | None) -> Block | None:
    """The block drafted during the verify, and what the verify must commit for it to stand."""
    if proposal is None or not proposal.token_ids:
        return None
    tokens, dists = list(proposal.token_ids), list(proposal.distributions)
    base = len(item.seq.tokens)
    if item.assumed is None:
        return Block(tokens, dists, base, parents=tuple(proposal.parents))
    # The first draft guessed the verifier's own token after the assumed block.
    tail = (*item.assumed, tokens[0])
    return Block(tokens[1:], dists[1:], base + len(tail), tail)


def branch_blocks(item: DraftItem, proposal: drafter_pb2.DraftProposal) -> list[Block]:
    """A fan-out's other blocks: each drafted after the first `num_assumed` of the assumed tokens
    and its own guess at the verifier's token there, so valid where the verify commits exactly those."""
    assumed, base = item.assumed or (), len(item.seq.tokens)
    blocks = []
    for branch in proposal.branches:
        tokens, dists, a = list(branch.token_ids), list(branch.distributions), branch.num_assumed
        blocks.append(Block(tokens[1:], dists[1:], base + a + 1, (*assumed[:a], tokens[0])))
    return blocks


def adopt_branch(seq: Any, base: int, branches: list[Block], applied: Applied) -> None:
    """After the verdict on the block a draft-ahead assumed (the sequence `base` tokens long before
    it): where its main block missed, the branch the commits confirm replaces it. What a verdict
    that came teaches of its branch's guess is noted; every branch not adopted is wasted."""
    applied.branches += len(branches)
    main_stands = seq.block is not None and seq.block.valid_for(seq.tokens)
    adopted = None
    if not main_stands:
        committed = seq.tokens[base:]
        for block in branches:
            a = len(block.tail) - 1
            if len(committed) == a + 1 and tuple(committed[:a]) == block.tail[:-1]:  # its verdict came
                applied.branch_outcomes.append(committed[a] == block.tail[-1])
                if adopted is None and not seq.done and block.valid_for(seq.tokens):
                    adopted = block
    if adopted is not None:
        applied.wasted += block_size(seq.block) if seq.block is not None else 0
        seq.block = adopted
        applied.branch_hits += 1
    elif not main_stands and not seq.done:
        applied.fan_out_misses += 1
    applied.wasted += sum(block_size(b) for b in branches if b is not adopted)


def block_size(block: Block) -> int:
    """Drafts a block holds, its guess at the verifier's token included."""
    return len(block.tokens) + (1 if block.tail else 0)


def drop_stale_blocks(seqs: list[Any]) -> int:
    """Forget blocks the committed tokens no longer match; returns how many drafts that throws away."""
    wasted = 0
    for s in seqs:
        if s.block is not None and (s.done or ready_block(s) is None):
            wasted += block_size(s.block)
            s.block = None
    return wasted


def apply_verdict(verdict: Verdict, eos: Collection[int], applied: Applied) -> None:
    """One sequence's verdict; an exception here fails that sequence alone."""
    s = verdict.seq
    try:
        if verdict.prefill_pending is not None and verdict.error is None:
            prefill_left(s, verdict.prefill_pending)
        elif verdict.drafts_refused:
            log.warning("verifier refused the drafts of %s; continuing target-only", s.id)
            applied.refused += 1
            s.drafter.park()
        elif verdict.error is not None:
            fail(s, verdict.error)
        else:
            s.drafted += verdict.drafted
            s.accepted += verdict.accepted
            if verdict.drafted:
                s.spec_steps.append((verdict.drafted, verdict.accepted))
            if s.hidden is not None:
                s.hidden.add(verdict.hidden_start, verdict.hidden_states)
            commit(s, list(verdict.tokens), verdict.logprobs, eos, applied)
    except Exception as exc:
        fail(s, internal_error(f"applying the verdict of {s.id}", exc))


def commit(
    seq: _Sequence, new_tokens: list[int], logprobs: Sequence[Any], eos: Collection[int], applied: Applied
) -> None:
    """Append verified tokens, emit text, and finish on EOS, a stop string or the length limit."""
    emitted: list[int] = []
    reason = None
    for token in new_tokens:
        seq.tokens.append(token)
        seq.output.append(token)
        emitted.append(token)
        if token in eos and not seq.params.ignore_eos:
            reason = "stop"
            break
        seq.stream.add(token)
        if seq.stream.stopped:
            reason = "stop"
            break
        if len(seq.output) >= seq.max_tokens:
            reason = "length"
            break
    now = time.perf_counter_ns()
    if seq.first_token_ns == 0:
        seq.first_token_ns = now
        applied.emitted.append(Emission(seq, len(emitted), (now - seq.submitted_ns) / 1e9, None))
    else:
        applied.emitted.append(Emission(seq, len(emitted), None, (now - seq.last_emit_ns) / 1e9))
    seq.last_emit_ns = now
    text = seq.stream.take(final=reason is not None)
    if (text or emitted) and not seq.cancelled:
        seq.events.put_nowait(Delta(text, emitted, [token_logprob_from_pb(lp) for lp in logprobs[: len(emitted)]]))
    if reason is not None:
        seq.life.move("finish")
        applied.finished.append((seq, reason))
        seq.events.put_nowait(Finished(reason, len(seq.prompt), len(seq.output), tuple(seq.spec_steps)))
