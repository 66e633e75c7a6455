"""Plain data exchanged with the engines (the servicers translate protobuf to these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.engine.errors import EngineError
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    # Only for an annotation: the gateway imports this module (via specd.rpc.serving) and must not import torch.
    import torch


@dataclass(frozen=True)
class SequenceSpec:
    sequence_id: str
    prompt: list[int]
    sampling: SamplingParams
    penalties: Penalties = field(default_factory=Penalties)
    # Trailing prompt tokens the sequence already generated: penalties count them as output.
    num_generated: int = 0
    logprobs: LogprobsRequest | None = None
    # Structured output: JSON Schema text the output must be an instance of; "" = unconstrained.
    json_schema: str = ""
    # None: prefill the whole prompt at open; n: at most n tokens now, the rest by prefill tasks.
    prefill_tokens: int | None = None
    # Structured output by an llguidance grammar (guided_regex, guided_choice); "" = none.
    grammar: str = ""
    # Whose request (SequenceSpec.tenant): the suffix drafter drafts only from its tenant's responses.
    tenant: str = ""
    # The ids that end it (the target's, from the gateway); empty: the service's own.
    end_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SparseDist:
    token_ids: list[int]
    probs: list[float]


@dataclass(frozen=True)
class DraftTask:
    sequence_id: str
    new_tokens: list[int]
    num_committed: int
    num_draft_tokens: int
    # Drafted after, not committed: a block the verifier is still checking.
    assumed: tuple[int, ...] = ()
    # Above 0: draft nothing, cache up to this many more of the committed tokens (chunked prefill).
    prefill_tokens: int = 0
    # The target's hidden states at committed positions hidden_start, hidden_start + 1, ... in
    # specd.engine.hidden_states' encoding (a feature drafter reads them; empty: none sent).
    hidden_states: bytes = b""
    hidden_start: int = 0
    # The first token is a guess at the verifier's own token after `assumed`: the likeliest, not a sample
    # (for a seeded request, the token the request's noise picks under q, as the verifier's picks under p).
    guess_first: bool = False
    # Besides the chain, up to this many alternative leaves at the depths the drafter is least sure of.
    num_siblings: int = 0
    # Fan-out draft-ahead (with guess_first): up to this many more blocks, each after another
    # likely verdict on `assumed` (DraftBranch).
    num_branches: int = 0


@dataclass
class DraftBranch:
    """A fan-out block: drafted after the first `num_assumed` assumed tokens and its own guess."""

    num_assumed: int
    tokens: list[int] = field(default_factory=list)  # the guess, then the drafts
    dists: list[SparseDist] = field(default_factory=list)  # for a sampled sequence, one per token


@dataclass
class DraftProposal:
    sequence_id: str
    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)
    error: EngineError | None = None
    prefill_pending: int = 0  # for a prefill task: committed tokens still to cache
    # With siblings: each token's parent (an index into tokens, -1 for the last committed or
    # assumed token), the chain first; empty for a chain.
    parents: list[int] = field(default_factory=list)
    # With DraftTask.num_branches: the other blocks, likeliest first.
    branches: list[DraftBranch] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyTask:
    sequence_id: str
    num_committed: int
    draft_tokens: list[int]
    draft_dists: list[SparseDist] = field(default_factory=list)
    # Above 0: verify nothing, prefill up to this many more prompt tokens (chunked prefill).
    prefill_tokens: int = 0
    # Return the target's hidden states of the positions this round commits (for a feature drafter).
    return_hidden: bool = False
    # A token tree: each draft's parent, an earlier draft's index or -1 for the last committed token.
    # Empty: a chain.
    draft_parents: list[int] = field(default_factory=list)


@dataclass
class VerifyResult:
    sequence_id: str
    num_accepted: int = 0
    next_token: int = -1
    error: EngineError | None = None
    # The target's logprobs of the committed tokens, when the sequence asked for them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prefill_pending: int = 0  # for a prefill task: prompt tokens still to prefill
    # With VerifyTask.return_hidden: the target's last hidden state at each position this round
    # fed and kept, [n, hidden], the first at position hidden_start.
    hidden: torch.Tensor | None = None
    hidden_start: int = 0
    # With VerifyTask.draft_parents: the accepted drafts' indices, root's child first. Empty for a chain.
    accepted_path: list[int] = field(default_factory=list)


@dataclass
class RoundTiming:
    """What an engine spent on one round, for the reply's ServiceTimings."""

    forward_ns: int = 0
    batch_size: int = 0
    tokens_fed: int = 0
    # (phase, start, end) in wall-clock ns, for the services' trace spans.
    phases: list[tuple[str, int, int]] = field(default_factory=list)
    # Attributes of a phase's span, by its index in `phases`.
    phase_attributes: dict[int, dict[str, int | bool]] = field(default_factory=dict)
