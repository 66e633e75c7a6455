"""Step one of a round: what each sequence does in it, decided without I/O.

`decide` reads the running sequences and the policy and returns a `RoundPlan`: who is verified
(with how many of its drafts), who drafts before the verify, who drafts ahead during it, who
prefills a prompt chunk on the verifier or on the drafter, and who joins the drafter. It changes
no sequence: what the round teaches each one (its rounds on the drafter, its joins for auto) is
in the plan, and `apply` commits it. The policy is the one input it writes to: `choose` keeps
the choice it made, which the round is later measured against.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.failures import InvalidParameter
from gateway.round.messages import Block, DraftItem, RoundPlan, plan_prefill
from gateway.round.pipeline_choice import MODES
from gateway.round.prefill_budget import DrafterPrefillBudget
from gateway.round.speculation import Candidate, SpeculationPolicy
from gateway.round.widths import Ahead

log = logging.getLogger(__name__)

# The most fan-out branches a draft-ahead drafts beside its main block: each is one more row of
# the drafter's forwards and one more KV slot held until the next round.
MAX_BRANCHES = 8


@dataclass(frozen=True)
class Limits:
    """What the services and the gateway's flags allow every round."""

    k_limit: int  # drafts a verify may check
    ahead_limit: int  # drafts a draft-ahead block may hold after its guess
    drafter_context: int
    speculative_mode: str = "auto"  # --speculative-mode: "auto", or a fixed k
    pipeline: str = "sequential"  # --pipeline
    prefill_chunk_tokens: int = 0  # the verifier's prefill per round (0: whole prompts at their open)
    siblings: int = 0  # --speculative-siblings: the most siblings beside a block's chain (token trees)
    draft_room: int = 1 << 30  # drafts a task may hold, a tree's chain and siblings together
    branches: int = 0  # --speculative-branches: the most branches beside a draft-ahead block (fan-out)


@dataclass
class Choice:
    """The policy's answer for a round: each sequence's k, and who should get ready to draft."""

    ks: dict[str, int]
    wanted: list[Any] = field(default_factory=list)  # to open on the drafter, or to prefill there
    for_auto: list[Any] = field(default_factory=list)  # of those, the ones wanted by auto mode
    auto_pipeline: str = "sequential"


def speculation(seq: Any, limits: Limits) -> int | str:
    """What the sequence drafts: a fixed k, or "auto"."""
    spec = seq.params.speculation
    if spec is None:
        return "auto" if limits.speculative_mode == "auto" else limits.k_limit
    return spec


def one_history(params: Any) -> str:
    """What makes the services follow one history for the request, so that it drafts chains
    only, never a tree or a fan-out: "penalties" (min_tokens among them), "structured output"
    (a JSON schema or a grammar), or "" for neither."""
    if params.penalties.active or params.penalties.min_tokens:
        return "penalties"
    return "structured output" if params.json_schema or params.grammar else ""


WIDE_PIPELINES = ("ahead", "auto")  # those that may fan out: auto picks ahead for some rounds

ONE_HISTORY = {
    "penalties": "presence_penalty, frequency_penalty, repetition_penalty, logit_bias or min_tokens",
    "structured output": "response_format json_schema or json_object, guided_*, or tool calls forced by grammar",
}


def width_refusal(params: Any, limits: Limits) -> InvalidParameter | None:
    """The 400 for a request whose speculative_siblings or speculative_branches is positive but
    can never apply to it (`_width` would make it 0 every round), naming the first such field;
    None where both may apply. A gateway without a drafter has a k limit of 0. Values over what
    a round can use (siblings beyond k, branches beyond MAX_BRANCHES) are "at most", not refused."""
    for param, value in (("speculative_siblings", params.siblings), ("speculative_branches", params.branches)):
        if not value:
            continue
        if limits.k_limit <= 0:
            return InvalidParameter(param, f"{param} needs drafting; this gateway drafts nothing (no drafter, or -k 0)")
        if params.speculation == 0:
            return InvalidParameter(param, f"{param} needs drafting; num_speculative_tokens is 0 (target-only)")
        if kind := one_history(params):
            return InvalidParameter(
                param,
                f"{param} cannot be combined with {kind} ({ONE_HISTORY[kind]}): with them a request drafts one "
                "chain, never a tree or a fan-out; send 0 or leave it unset",
            )
        named = params.pipeline or limits.pipeline
        if param == "speculative_branches" and named not in WIDE_PIPELINES:
            given = (
                "this request's pipeline" if params.pipeline else "the gateway's --pipeline (the request names none)"
            )
            return InvalidParameter(
                param,
                f"speculative_branches fans out draft-ahead blocks, which only the ahead pipeline drafts (or auto, "
                f"in its ahead rounds); {given} is {named!r}",
            )
    return None


def _width(seq: Any, limits: Limits, named: int | None, auto: int, flag: int) -> int:
    """A tree's or a fan-out's width for the sequence: what its request named, else what the
    policy chose for the round's auto sequences (`auto`) or the gateway's flag for a fixed k.
    None where the services follow one history only (`one_history`); a request that names a
    width there is refused at submission (`width_refusal`)."""
    params = seq.params
    if one_history(params):
        return 0
    if named is not None:
        return int(named)
    return auto if speculation(seq, limits) == "auto" else flag


def siblings_for(seq: Any, k: int, limits: Limits, auto: int) -> int:
    """The siblings the sequence's next block of `k` drafts carries (`_width`): at most one per
    draft, within what the services take."""
    wanted = _width(seq, limits, seq.params.siblings, auto, limits.siblings)
    return max(0, min(wanted, k, limits.draft_room - k))


def branches_for(seq: Any, k: int, limits: Limits, auto: int) -> int:
    """The branches the sequence's draft-ahead drafts beside its main block while its block of
    `k` drafts is verified (`_width`): at most MAX_BRANCHES."""
    return max(0, min(_width(seq, limits, seq.params.branches, auto, limits.branches), MAX_BRANCHES))


def choose_branches(seqs: list[Any], choice: Choice, limits: Limits, policy: SpeculationPolicy) -> int:
    """The branches beside each draft-ahead of the round's auto sequences (the policy's choice)."""
    if limits.branches <= 0:
        return 0
    ahead = [
        Ahead(choice.ks[s.id], s.acceptance.rates(), policy.guess_rate(s.guess))
        for s in seqs
        if choice.ks[s.id] > 0
        and speculation(s, limits) == "auto"
        and pipeline_of(s, limits, choice.auto_pipeline) == "ahead"
    ]
    return policy.branches([choice.ks[s.id] for s in seqs], ahead, limits.branches)


def drafts_now(seq: Any) -> bool:
    return seq.drafter.drafting and not seq.drafter_prefill_pending


def cap(seq: Any, limits: Limits, after: int = 0, preparing: bool = False) -> int:
    """The most drafts the sequence can use in a block that starts `after` tokens from now
    (`preparing`: once ready on the drafter, for one waiting to join it or prefilling there)."""
    ready = (seq.drafter.pending or seq.drafter.drafting) if preparing else drafts_now(seq)
    if not ready:
        return 0
    remaining = seq.max_tokens - len(seq.output) - after
    return max(0, min(limits.k_limit, remaining - 1, limits.drafter_context - len(seq.tokens) - after))


def candidate(seq: Any, cap_: int, limits: Limits, policy: SpeculationPolicy) -> Candidate:
    """The sequence as the policy sees it (its acceptance and guess rates must exist)."""
    spec = speculation(seq, limits)
    fixed = None if spec == "auto" else min(int(spec), cap_)
    return Candidate(
        cap=cap_, rates=seq.acceptance.rates(), fixed=fixed, cohort=seq.cohort, guess=policy.guess_rate(seq.guess)
    )


def offered(seqs: Iterable[Any], default: str) -> tuple[str, ...]:
    """The pipelines a round of `seqs` is chosen among: with `auto` among the requests, all of
    them (requests that named one keep theirs); a mix of named ones is costed as sequential,
    as before there was a choice."""
    named = {s.params.pipeline or default for s in seqs}
    return MODES if "auto" in named else tuple(named) if len(named) == 1 else ("sequential",)


def pipeline_of(seq: Any, limits: Limits, auto_pipeline: str) -> str:
    named = seq.params.pipeline or limits.pipeline
    return auto_pipeline if named == "auto" else named


def join_pays(seq: Any, policy: SpeculationPolicy) -> bool:
    """For a sequence the policy chose to draft: whether its drafts will repay opening it on the
    drafter. One already open (still prefilling there) has paid."""
    if not seq.drafter.pending:
        return True
    return policy.join_pays(len(seq.output), seq.max_tokens - len(seq.output), len(seq.tokens))


def ready_block(seq: Any) -> Block | None:
    """Its block drafted earlier, if the committed tokens still match it."""
    if seq.block is not None and seq.block.valid_for(seq.tokens):
        return seq.block
    return None


def _preparing(seqs: list[Any]) -> set[str]:
    """Those waiting to join the drafter (after their first token), or still prefilling there."""
    return {
        s.id
        for s in seqs
        if (s.drafter.pending and s.output and not s.done) or (s.drafter.drafting and s.drafter_prefill_pending)
    }


def choose_ks(seqs: list[Any], limits: Limits, policy: SpeculationPolicy, measurable: bool = True) -> Choice:
    """Each sequence's k this round, and those the drafter should get ready; for `auto`, the round's pipeline.

    A sequence waiting to join the drafter, or still prefilling there, is offered to the
    policy as if it were ready: the drafter works on it (opens it, or prefills a chunk of it)
    only if the policy would have it draft, so not while drafting does not pay; it drafts
    from a later round. The round itself then runs the policy's choice for the sequences
    that can draft now.
    """
    preparing = _preparing(seqs)
    caps = [cap(s, limits, preparing=s.id in preparing) for s in seqs]
    offer = offered(seqs, limits.pipeline)
    try:
        candidates = [candidate(s, c, limits, policy) for s, c in zip(seqs, caps, strict=True)]
        ks = policy.choose(candidates, len(seqs), offer, measurable)
        auto = policy.last_pipeline
    except Exception:
        # The policy is an optimisation: without it, each sequence drafts what it may.
        log.exception("the speculation policy failed; drafting the full k this round")
        ks, auto = caps, "sequential"
        candidates = [Candidate(cap=c, rates=(), fixed=c) for c in caps]
    choice = Choice({}, auto_pipeline=auto)
    for s, k, c in zip(seqs, ks, candidates, strict=True):
        if s.id in preparing and k > 0 and (c.fixed is not None or join_pays(s, policy)):
            choice.wanted.append(s)
            if c.fixed is None:
                choice.for_auto.append(s)
    if any(k > 0 for s, k in zip(seqs, ks, strict=True) if s.id in preparing):
        # They draft nothing this round: its ks and pipeline are chosen again for the sequences
        # that can draft in it, so that the round runs, and is measured against, a choice the
        # policy made for it, not one whose drafts half the batch cannot make yet.
        try:
            ready = [
                c if s.id not in preparing else candidate(s, 0, limits, policy)
                for s, c in zip(seqs, candidates, strict=True)
            ]
            ks = policy.choose(ready, len(seqs), offer, measurable, again=True)
            choice.auto_pipeline = policy.last_pipeline
        except Exception:
            log.exception("the speculation policy failed; the sequences ready keep their first k")
    choice.ks = {s.id: 0 if s.id in preparing else k for s, k in zip(seqs, ks, strict=True)}
    return choice


def fits_in_verify(policy: SpeculationPolicy, k_limit: int, sequences: int) -> int:
    """Drafts an ahead block (after its guess at the verifier's token) can hold without
    outlasting a target-only verify of `sequences`, by the policy's measured costs."""
    costs = policy.costs
    if not costs.ready:
        return 0
    step = costs.step_beside_ns(1)
    if step <= 0:
        return k_limit
    steps = (costs.verify.predict(sequences) - costs.draft_fixed.get()) / step
    return max(0, int(steps) - 1)


def drafting_beside(policy: SpeculationPolicy, items: list[DraftItem]) -> float:
    """What the drafts among `items`, drafted beside the verify, are predicted to take of the
    drafter's time there (ns; 0 until the drafter has been timed)."""
    drafting = [item.num_draft_tokens for item in items if item.num_draft_tokens > 0]
    costs = policy.costs
    if not drafting or not costs.ready:
        return 0.0
    # A fan-out's branches are rows of the same forwards.
    rows = len(drafting) + sum(item.branches for item in items if item.num_draft_tokens > 0)
    return costs.draft_ns(rows, max(drafting), beside=True)


def open_chunks(
    opening: list[Any], others: list[Any], pending: str, round_budget: int, scores_prompts: bool = False
) -> dict[str, int]:
    """What each sequence being opened prefills at its open, by id; one missing is opened whole.

    The sequences already prefilling (`pending` names their counter) have the first claim on
    the round's budget, and those being opened share what is left. `round_budget` 0: no
    chunks, every prompt whole at its open. `scores_prompts`: the verifier's opens, where a
    sequence that asks for its prompt's logprobs is prefilled whole (they come with the open).
    """
    if round_budget <= 0:
        return {}
    claimed = plan_prefill([(s.id, getattr(s, pending)) for s in others], round_budget)
    budget = round_budget - sum(claimed.values())
    chunked = [
        s for s in opening if not (scores_prompts and s.params.logprobs is not None and s.params.logprobs.prompt)
    ]
    shares = plan_prefill([(s.id, len(s.tokens) - 1) for s in chunked], budget)
    return {s.id: shares.get(s.id, 0) for s in chunked}


def early_joins(
    batch: list[Any], active: list[Any], budget: int, limits: Limits, policy: SpeculationPolicy
) -> tuple[list[Any], dict[str, int]]:
    """Of `batch`, being opened on the verifier, those to open on the drafter beside it, and the
    prompt tokens each prefills there within `budget` (what the drafter prefills in the time of
    the verifier's open): requests that draft, auto ones only into a batch auto is predicted to
    draft for (what pays for a few sequences may not for many)."""
    if not policy.config.on("early-joins"):
        return [], {}
    auto = any(speculation(s, limits) == "auto" for s in batch)
    everyone = [*active, *batch]
    auto_drafts = auto and policy.drafts_for(len(everyone), offered(everyone, limits.pipeline))
    wanted = [s for s in batch if (spec := speculation(s, limits)) != 0 and (spec != "auto" or auto_drafts)]
    chunks = open_chunks(wanted, [], "drafter_prefill_pending", budget)
    early = [s for s in wanted if chunks.get(s.id, 0) > 0 or len(s.tokens) <= 1]  # one token: nothing to prefill
    return early, {s.id: chunks[s.id] for s in early}


@dataclass(frozen=True)
class _Round:
    """What placing one sequence in the plan needs to know about the whole round."""

    round_id: int
    limits: Limits
    policy: SpeculationPolicy
    verified: int  # sequences verified or drafted for (those not prefilling on the verifier)
    paired: bool  # both cohorts have a sequence drafting in turns (cohort pipeline)
    auto_pipeline: str
    auto_siblings: int = 0  # siblings beside the chains of the auto sequences (the policy's choice)
    auto_branches: int = 0  # branches beside the draft-aheads of the auto sequences (the policy's choice)


def decide(
    everyone: list[Any],
    round_id: int,
    limits: Limits,
    policy: SpeculationPolicy,
    verifier_prefill_spent: int,
    drafter_prefill: DrafterPrefillBudget,
    drafter_busy: bool = False,
) -> RoundPlan:
    """Which sequences draft before the verify, which are verified, and which draft during it;
    and which prefill a chunk of their prompt, on the verifier or the drafter, instead.

    `verifier_prefill_spent`: prompt tokens this round's opens already prefilled on the verifier.
    `drafter_busy`: the drafter's prefill started by an earlier round is still running, so this
    round neither joins nor prefills on the drafter; the sequences waiting go target-only meanwhile.
    Every sequence in `everyone` needs its acceptance and guess rates (the scheduler gives them).
    """
    plan = RoundPlan()
    if limits.prefill_chunk_tokens > 0:
        budget = limits.prefill_chunk_tokens - verifier_prefill_spent
        chunks = plan_prefill([(s.id, s.prefill_pending) for s in everyone], budget)
        plan.prefill = [(s, chunks[s.id]) for s in everyone if s.id in chunks]
    # A sequence still prefilling on the verifier waits for its last chunk.
    seqs = [s for s in everyone if not s.prefill_pending]
    # A round that prefills on the verifier teaches the policy nothing (see the observer).
    choice = choose_ks(seqs, limits, policy, measurable=not plan.prefill)
    plan.auto_pipeline = choice.auto_pipeline
    plan.unready = [s for s in choice.wanted if s.output]  # a first round is target-only anyway
    wanted = [] if drafter_busy else choice.wanted
    plan.joined_for_auto = [] if drafter_busy else choice.for_auto
    # All may join: each prefills on the drafter only its share of the round's budget.
    plan.join = [s for s in wanted if s.drafter.pending]
    filling = [s for s in wanted if s.drafter.drafting]
    # Only sequences that draft take turns; a cohort alone has no partner to overlap
    # with, and a sequence that does not draft is verified every round.
    turns = [
        s for s in seqs if pipeline_of(s, limits, choice.auto_pipeline) == "cohort" and choice.ks[s.id] > 0 and s.output
    ]
    auto_ks = [choice.ks[s.id] for s in seqs if speculation(s, limits) == "auto"]
    context = _Round(
        round_id,
        limits,
        policy,
        len(seqs),
        len({s.cohort for s in turns}) == 2,
        choice.auto_pipeline,
        policy.siblings(auto_ks, limits.siblings),
        choose_branches(seqs, choice, limits, policy),
    )
    for s in seqs:
        _place(plan, s, choice.ks[s.id], context)
    plan.drafter_prefill = drafter_prefill.tokens(drafting_beside(policy, plan.ahead))
    if filling:
        # What it has left includes the tokens committed since the drafter last heard of it,
        # which this exchange brings: without them a prefill would stay one round behind for good.
        left = [(s.id, s.drafter_prefill_pending + len(s.tokens) - s.drafter.synced) for s in filling]
        chunks = plan_prefill(left, plan.drafter_prefill)
        # Prefilled on the drafter beside the rounds, which do not wait for it.
        plan.fill = [DraftItem(s, 0, prefill=chunks[s.id]) for s in filling if s.id in chunks]
    plan.pipeline = "+".join(sorted({pipeline_of(s, limits, choice.auto_pipeline) for s in everyone}))
    return plan


def _place(plan: RoundPlan, s: Any, k: int, r: _Round) -> None:
    """Put one sequence, whose chosen k is `k`, in the plan."""
    limits = r.limits
    mode = pipeline_of(s, limits, r.auto_pipeline)
    ready = ready_block(s)
    if cap(s, limits) > 0:  # on the drafter, with room left to draft: did the policy use it?
        plan.counted.append((s, k > 0))
    if not s.output:
        _place_first(plan, s, k, mode, r)
        return
    if mode == "cohort" and r.paired and k > 0:
        if s.cohort != r.round_id % 2:
            if ready is None:  # verified next round, with these drafts
                plan.ahead.append(DraftItem(s, k, siblings=siblings_for(s, k, limits, r.auto_siblings)))
            return
        plan.verify.append(s)
        plan.ks[s.id] = min(ready.chain, cap(s, limits), k) if ready is not None else 0
        return
    plan.verify.append(s)
    if ready is not None:
        # A block drafted earlier is verified up to this round's k: no more than chosen.
        plan.ks[s.id] = min(ready.chain, cap(s, limits), k)
    elif k > 0:
        plan.ks[s.id] = k
        plan.pre_draft.append(DraftItem(s, k, siblings=siblings_for(s, k, limits, r.auto_siblings)))
    if mode == "ahead" and k > 0:
        # Drafted while the verifier checks this block, assuming all of it is
        # accepted: the first draft is a guess at the verifier's own token.
        # As many as this round's k, the best guess at the next round's.
        verified = plan.ks.get(s.id, 0)
        n = min(cap(s, limits, after=verified + 1), limits.ahead_limit, k)
        if n > 0:
            branches = branches_for(s, verified, limits, r.auto_branches)
            plan.ahead.append(DraftItem(s, n + 1, assumed=(), branches=branches))


def _place_first(plan: RoundPlan, s: Any, k: int, mode: str, r: _Round) -> None:
    """A sequence's first round is target-only whatever the pipeline, so that its first token
    waits for no drafts; draft-ahead drafts its next block meanwhile, as long a block as fits
    in the verify. The round then does not run the ks chosen (`not_as_chosen`)."""
    plan.verify.append(s)
    if k <= 0:
        return
    plan.not_as_chosen = True
    limits = r.limits
    n = min(cap(s, limits, after=1), limits.ahead_limit, k, fits_in_verify(r.policy, limits.k_limit, r.verified))
    if mode == "ahead" and n > 0:
        # Its verify checks no drafts: the one other verdict is another token than the guess.
        plan.ahead.append(DraftItem(s, n + 1, assumed=(), branches=branches_for(s, 0, limits, r.auto_branches)))
