"""One round's messages and verdicts, as pure functions over the sequences taking part.

A round is four steps (docs/architecture.md, "The round"):

1. *decide* (decide.py): which sequences draft before the verify (on the critical
   path), which are verified, and which draft ahead while the verifier works (`RoundPlan`);
2. *exchange* (exchange.py): the RPCs, built here (`draft_request`, `verify_request`);
3. *apply* (apply.py): the drafter's and the verifier's replies become per-sequence
   verdicts (`read_drafts`, `read_verdicts`), checked against the protocol before
   anything is committed, and are committed;
4. *observe* (observer.py): spans, metrics and what the policy learns.

Nothing here does I/O or changes a sequence, so every path is testable with fakes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.failures import GenerationError, verifier_round_error
from gateway.round.hidden_log import HiddenLog
from gateway.round.membership import DrafterMembership
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2


class RoundSequence(Protocol):
    """What a round needs of a sequence."""

    id: str
    tokens: list[int]  # prompt + committed output
    drafter: DrafterMembership
    hidden: HiddenLog | None  # the target's hidden states, kept for a drafter that reads them


@dataclass(frozen=True)
class Block:
    """Draft tokens (and, for sampled sequences, their distributions) ready to verify.

    `base` is the committed length the block continues; `tail` the committed tokens
    it was drafted after that the gateway had not seen committed yet when it asked
    (a draft-ahead block assumes them). The block is only valid if the sequence's
    committed tokens end in exactly `tail` at length `base`.
    """

    tokens: list[int]
    distributions: list[common_pb2.SparseDistribution]
    base: int
    tail: tuple[int, ...] = ()
    # A token tree (DraftProposal.parents): the chain's drafts first, then siblings, each a leaf
    # beside one of them. Empty: a chain.
    parents: tuple[int, ...] = ()

    def valid_for(self, committed: Sequence[int]) -> bool:
        if len(committed) != self.base:
            return False
        return not self.tail or tuple(committed[self.base - len(self.tail) :]) == self.tail

    @property
    def chain(self) -> int:
        """How many of `tokens` are the chain's drafts (the rest are siblings)."""
        return chain_length(self.parents) if self.parents else len(self.tokens)

    def tree(self, k: int) -> tuple[list[int], list[int]]:
        """The indices into `tokens` a verify of the chain's first `k` drafts carries (those k,
        then the siblings of any of them), and their parents among those indices (empty: a chain)."""
        chain = min(k, self.chain)
        # A sibling's parent is its brother's, an index in the chain: kept where its brother is.
        siblings = [i for i in range(self.chain, len(self.tokens)) if self.parents[i] < chain - 1]
        keep = [*range(chain), *siblings]
        return keep, [self.parents[i] for i in keep] if siblings else []


def chain_length(parents: Sequence[int]) -> int:
    """The leading drafts that form a chain (each the child of the one before)."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return n


def tree_problem(parents: Sequence[int], tokens: int) -> str:
    """Why `parents` is not a chain followed by sibling leaves over `tokens` drafts ("" if it is)."""
    if not parents:
        return ""
    if len(parents) != tokens:
        return "one parent per token"
    chain = chain_length(parents)
    if any(not -1 <= p < chain - 1 for p in parents[chain:]):
        return "a sibling beside a draft the chain does not have"
    return ""


@dataclass(frozen=True)
class DraftItem:
    """One sequence's share of a draft exchange."""

    seq: RoundSequence
    num_draft_tokens: int
    # None: drafts continue the committed tokens. A tuple: the sequence is being
    # verified meanwhile, and drafts continue these tokens of its block, assumed accepted.
    assumed: tuple[int, ...] | None = None
    # Above 0: a chunk of its prefill on the drafter instead of drafts (num_draft_tokens is 0).
    prefill: int = 0
    # Alternatives to propose beside the chain's drafts (DraftTask.num_siblings).
    siblings: int = 0
    # A draft-ahead's other blocks, each after another verdict on `assumed` (DraftTask.num_branches).
    branches: int = 0


@dataclass
class RoundPlan:
    pre_draft: list[DraftItem] = field(default_factory=list)  # drafted before the verify
    verify: list[RoundSequence] = field(default_factory=list)
    ahead: list[DraftItem] = field(default_factory=list)  # drafted while the verifier works
    ks: dict[str, int] = field(default_factory=dict)  # drafts each verified sequence may use
    # Sequences still prefilling on the verifier, and the prompt tokens each prefills this round.
    prefill: list[tuple[RoundSequence, int]] = field(default_factory=list)
    # Sequences opened on the drafter beside the verify: the policy wants drafts from them.
    join: list[RoundSequence] = field(default_factory=list)
    # Prompt tokens the drafter may prefill beside the rounds, joins' and chunks' together.
    drafter_prefill: int = 0
    # Chunks of the drafter's prefill (`DraftItem.prefill`), in an exchange no round waits for.
    fill: list[DraftItem] = field(default_factory=list)
    # Sequences past their first round whose drafts the policy wants but which run target-only:
    # their drafter cache is not ready (they wait to open there, or their prefill there is in flight).
    unready: list[RoundSequence] = field(default_factory=list)
    # What `auto` resolves to this round, and the round's pipelines as observed ("a+b" for a mix).
    auto_pipeline: str = "sequential"
    pipeline: str = "sequential"
    # For the policy's follow-through: the sequences that could draft, and whether they did;
    # those that join (or prefill on) the drafter because auto mode wants their drafts.
    counted: list[tuple[RoundSequence, bool]] = field(default_factory=list)
    joined_for_auto: list[RoundSequence] = field(default_factory=list)
    # A sequence's first round, target-only, keeps the round from running the ks chosen.
    not_as_chosen: bool = False


def plan_prefill(pending: Sequence[tuple[str, int]], budget: int) -> dict[str, int]:
    """Share a round's prefill budget out first come, first served: each sequence's chunk, by id.

    `pending` is (id, tokens left to prefill) in arrival order; a sequence gets all it
    has left or what is left of the budget, so the round prefills at most `budget` tokens.
    """
    chunks: dict[str, int] = {}
    for sid, left in pending:
        if budget <= 0:
            break
        if left > 0:
            chunks[sid] = min(left, budget)
            budget -= chunks[sid]
    return chunks


def draft_request(
    round_id: int, items: Sequence[DraftItem], contexts: Mapping[str, Mapping[str, str]]
) -> drafter_pb2.DraftRequest:
    request = drafter_pb2.DraftRequest(round_id=round_id)
    for item in items:
        s = item.seq
        task = request.tasks.add(
            sequence_id=s.id,
            new_token_ids=s.tokens[s.drafter.synced :],
            num_committed=len(s.tokens),
            num_draft_tokens=item.num_draft_tokens,
            assumed_token_ids=item.assumed or (),
            prefill_tokens=item.prefill,
            # A draft-ahead's first token guesses the verifier's own token after the block it assumes.
            guess_first=item.assumed is not None and not item.prefill,
            num_siblings=item.siblings,
            num_branches=item.branches if item.assumed is not None and not item.prefill else 0,
        )
        if s.hidden is not None:
            task.hidden_start, task.hidden_states = s.hidden.since(s.drafter.hidden_sent)
        if s.id in contexts:
            task.trace_context.update(contexts[s.id])
    return request


def verify_request(
    round_id: int,
    seqs: Sequence[RoundSequence],
    blocks: Mapping[str, Block],
    ks: Mapping[str, int],
    contexts: Mapping[str, Mapping[str, str]],
    prefill: Sequence[tuple[RoundSequence, int]] = (),
) -> verifier_pb2.VerifyRequest:
    """The verify tasks of `seqs`, then a prefill task for each (sequence, chunk) of `prefill`."""
    request = verifier_pb2.VerifyRequest(round_id=round_id)
    for s in seqs:
        task = request.tasks.add(
            sequence_id=s.id, num_committed=len(s.tokens), return_hidden_states=s.hidden is not None
        )
        block = blocks.get(s.id)
        k = ks.get(s.id, 0)
        if block is not None and k > 0:
            keep, parents = block.tree(k)
            task.draft_token_ids.extend(block.tokens[i] for i in keep)
            if block.distributions:
                task.draft_distributions.extend(block.distributions[i] for i in keep)
            task.draft_parents.extend(parents)
        if s.id in contexts:
            task.trace_context.update(contexts[s.id])
    for s, n in prefill:
        request.tasks.add(sequence_id=s.id, num_committed=len(s.tokens), prefill_tokens=n)
    return request


@dataclass
class DraftVerdicts:
    """What one draft exchange gave each sequence."""

    proposals: dict[str, drafter_pb2.DraftProposal] = field(default_factory=dict)
    lost: list[tuple[RoundSequence, str]] = field(default_factory=list)  # the drafter no longer has it
    refused: list[tuple[RoundSequence, str]] = field(default_factory=list)  # it refused this sequence's task
    protocol_error: str = ""  # the whole reply is unusable


# Codes for which a sequence is re-opened on the drafter rather than given up.
LOST_ON_DRAFTER = (
    common_pb2.ERROR_CODE_NOT_FOUND,
    common_pb2.ERROR_CODE_FAILED_PRECONDITION,
    common_pb2.ERROR_CODE_UNAVAILABLE,  # its drafter replica failed: re-open it on another
)


def read_drafts(items: Sequence[DraftItem], reply: drafter_pb2.DraftResponse) -> DraftVerdicts:
    verdicts = DraftVerdicts()
    if [p.sequence_id for p in reply.proposals] != [i.seq.id for i in items]:
        verdicts.protocol_error = "the drafter answered a round out of protocol"
        return verdicts
    for item, proposal in zip(items, reply.proposals, strict=True):
        if proposal.error.code in LOST_ON_DRAFTER:
            verdicts.lost.append((item.seq, proposal.error.message))
        elif proposal.error.code:
            verdicts.refused.append((item.seq, proposal.error.message))
        elif problem := proposal_problem(item, proposal):
            verdicts.refused.append((item.seq, problem))
        else:
            verdicts.proposals[item.seq.id] = proposal
    return verdicts


def proposal_problem(item: DraftItem, proposal: drafter_pb2.DraftProposal) -> str:
    """Why a proposal does not answer its task ("" if it does)."""
    tokens = len(proposal.token_ids)
    chain = chain_length(proposal.parents) if proposal.parents else tokens
    if chain > item.num_draft_tokens or tokens - chain > item.siblings:
        return "the drafter proposed more than asked"
    if proposal.distributions and len(proposal.distributions) != tokens:
        return "the drafter's distributions do not match its drafts"
    problem = tree_problem(proposal.parents, tokens)
    if problem:
        return f"the drafter's tree is malformed: {problem}"
    return branches_problem(item, proposal)


def branches_problem(item: DraftItem, proposal: drafter_pb2.DraftProposal) -> str:
    """Why a proposal's branches (fan-out draft-ahead) do not answer its task ("" if they do)."""
    if len(proposal.branches) > (item.branches if item.assumed is not None else 0):
        return "the drafter proposed more branches than asked"
    for branch in proposal.branches:
        tokens = len(branch.token_ids)
        if branch.num_assumed > len(item.assumed or ()):
            return f"a branch assumes {branch.num_assumed} of {len(item.assumed or ())} tokens"
        if not 0 < tokens <= item.num_draft_tokens:
            return f"a branch of {tokens} tokens, for a task of {item.num_draft_tokens}"
        # A sampled sequence's drafts each come with their q: its branches' as its main block's.
        if (proposal.distributions or branch.distributions) and len(branch.distributions) != tokens:
            return "a branch's distributions do not match its drafts"
    return ""


@dataclass(frozen=True)
class Verdict:
    """The verifier's answer for one sequence."""

    seq: RoundSequence
    drafted: int  # the chain's drafts it carried (siblings not counted)
    accepted: int = 0  # the drafts committed (a sibling's included)
    tokens: tuple[int, ...] = ()  # accepted drafts + the verifier's own token
    siblings: int = 0  # the siblings it carried beside the chain
    sibling_hit: bool = False  # the accepted path ends in a sibling
    error: GenerationError | None = None
    drafts_refused: bool = False  # the verifier refused its drafts; it goes on target-only
    logprobs: Sequence[common_pb2.TokenLogprob] = ()  # the target's, per emitted token, when asked
    prefill_pending: int | None = None  # a prefill task's: prompt tokens still to prefill (None: not one)
    # The target's hidden states of the positions it committed, from hidden_start, when asked.
    hidden_states: bytes = b""
    hidden_start: int = 0


def read_guesses(
    blocks: Sequence[tuple[RoundSequence, Block]], verdicts: Sequence[Verdict]
) -> list[tuple[RoundSequence, bool]]:
    """Draft-ahead blocks whose assumption held (the block verified meanwhile accepted whole),
    and whether their guess at the verifier's own token after it was right too.

    A block that missed its assumption says nothing about the guess; a guess that missed is
    what keeps a draft-ahead block from standing although every draft was accepted.
    """
    by_id = {v.seq.id: v for v in verdicts}
    outcomes = []
    for seq, block in blocks:
        v = by_id.get(seq.id)
        assumed = len(block.tail) - 1  # the tail is the assumed drafts, then the guess
        if v is None or v.error is not None or v.drafts_refused or assumed < 0:
            continue
        # A path that ended in a sibling left the chain the block assumed, even at its last draft.
        if v.accepted != assumed or v.drafted != assumed or len(v.tokens) <= assumed or v.sibling_hit:
            continue
        outcomes.append((seq, v.tokens[assumed] == block.tail[-1]))
    return outcomes


class ProtocolError(Exception):
    """A backend's reply that does not answer the request it was given."""


def read_verdicts(
    request: verifier_pb2.VerifyRequest, reply: verifier_pb2.VerifyResponse, seqs: Sequence[RoundSequence]
) -> list[Verdict]:
    if [r.sequence_id for r in reply.results] != [t.sequence_id for t in request.tasks]:
        raise ProtocolError("the verifier answered a round out of protocol")
    verdicts = []
    for s, task, result in zip(seqs, request.tasks, reply.results, strict=True):
        k = len(task.draft_token_ids)
        if task.prefill_tokens > 0:
            error = verifier_round_error(result.error) if result.error.code else None
            verdicts.append(Verdict(s, 0, error=error, prefill_pending=result.prefill_pending))
        elif result.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT and k > 0:
            # The verifier checks a round before changing anything, so bad drafts
            # cost this sequence one round.
            verdicts.append(Verdict(s, k, drafts_refused=True))
        elif result.error.code:
            verdicts.append(Verdict(s, k, error=verifier_round_error(result.error)))
        else:
            verdicts.append(_accepted(s, task, result))
    return verdicts


def accepted_path(task: verifier_pb2.VerifyTask, result: verifier_pb2.VerifyResult) -> list[int]:
    """The indices of the drafts the verifier accepted, checked against the task's tree or chain."""
    k = len(task.draft_token_ids)
    if not task.draft_parents:
        if result.accepted_path or result.num_accepted > k:
            raise ProtocolError(f"the verifier accepted {result.num_accepted} of {k} chained drafts")
        return list(range(result.num_accepted))
    path = list(result.accepted_path)
    parents = [-1, *path][: len(path)]
    if len(path) != result.num_accepted or any(
        not 0 <= i < k or task.draft_parents[i] != p for i, p in zip(path, parents, strict=True)
    ):
        raise ProtocolError(f"the verifier's accepted path {path} is not a path of the tree it was sent")
    return path


def _accepted(s: RoundSequence, task: verifier_pb2.VerifyTask, result: verifier_pb2.VerifyResult) -> Verdict:
    path = accepted_path(task, result)
    chain = chain_length(task.draft_parents) if task.draft_parents else len(task.draft_token_ids)
    return Verdict(
        s,
        chain,
        len(path),
        (*(task.draft_token_ids[i] for i in path), result.next_token_id),
        siblings=len(task.draft_token_ids) - chain,
        sibling_hit=bool(path) and path[-1] >= chain,
        logprobs=result.logprobs,
        hidden_states=result.hidden_states,
        hidden_start=result.hidden_start,
    )
