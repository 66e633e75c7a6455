"""Per-sequence state of one model: slots, committed tokens, prefill, limits.

No torch at import: a model-free drafter (the suffix drafter `specd up` runs on the CPU) keeps its
sequences here too, and its start (and every supervised restart) should not wait on torch's import.
What a model's table does with tensors imports them where it does it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specd.engine.errors import EngineError, exhausted, invalid, not_found
from specd.engine.params import (
    LogprobsRequest,
    Penalties,
    SamplingParams,
    TokenLogprob,
    validate_penalties,
    validate_sampling,
)
from specd.engine.prefix import common_prefix
from specd.engine.ranges import RANGES
from specd.engine.tasks import SequenceSpec
from specd.heap import trim_heap

if TYPE_CHECKING:
    import torch

    from specd.engine.featurehead import FeatureTrack
    from specd.engine.grammar import GrammarCompiler, GrammarMatcher
    from specd.engine.kvcache import BatchedCausalLM


@dataclass
class HeadInputs:
    """A drafter's head inputs (last hidden states) at positions it fed, each with the context it
    was computed in: the one at position p gives q of the token after tokens[:p + 1]. A fan-out
    task (drafter_service.fanout) takes its q at the assumed tokens, which the drafter drafted
    itself, from these instead of feeding the tokens again."""

    tokens: list[int] = field(default_factory=list)
    at: dict[int, torch.Tensor] = field(default_factory=dict)

    def follow(self, context: Sequence[int], first: int) -> None:
        """Keep those from position `first` on that `context` (now the sequence's) still confirms."""
        n = common_prefix(self.tokens, context)
        self.at = {p: x for p, x in self.at.items() if first <= p < n}
        self.tokens = list(context)

    def note(self, start: int, inputs: torch.Tensor) -> None:
        """Inputs [n, hidden] of the positions from `start` on."""
        for j in range(inputs.shape[0]):
            self.at[start + j] = inputs[j]


@dataclass
class BranchCache:
    """A fan-out branch's KV (drafter_service.fanout): a slot of its own, the tokens it holds
    and the head inputs its drafts left."""

    slot: int
    cached: list[int]
    head_inputs: HeadInputs = field(default_factory=HeadInputs)


@dataclass
class SequenceState:
    sequence_id: str
    slot: int
    committed: list[int]
    # Tokens whose keys/values are valid in the slot: committed[:n] and, for a
    # drafter, possibly draft tokens after them.
    cached: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    penalties: Penalties = field(default_factory=Penalties)
    # committed[:prompt_len] is the prompt; what follows was generated (penalties count it).
    prompt_len: int = 0
    logprobs: LogprobsRequest | None = None
    # Filled by the prefill when the spec asked for them and the table scores prompts.
    prompt_logprobs: list[TokenLogprob] | None = None
    # Structured output: the grammar state, following the output tokens.
    grammar: GrammarMatcher | None = None
    # The ids that end it (the target's, sent by the gateway): a drafter drafts nothing after one.
    # Empty when none were sent (ignore_eos): it drafts on.
    ends: frozenset[int] = frozenset()
    # A feature drafter's knowledge of the target's hidden states (specd.engine.featurehead).
    features: FeatureTrack | None = None
    # An unseeded drafter's own draws of sibling drafts (drafter_service.siblings): apart from
    # `generator`, so that asking for siblings leaves the chain's draws as they were.
    sibling_generator: torch.Generator | None = None
    # A drafter's fan-out branches of the last round, kept until the sequence's next task
    # continues the one its committed tokens confirm furthest (drafter_service.fanout).
    branches: list[BranchCache] = field(default_factory=list)
    # A model drafter's head inputs of its latest drafts, for a fan-out task's q at them.
    head_inputs: HeadInputs = field(default_factory=HeadInputs)
    # An unseeded drafter's draws in its branches, apart from `generator` as `sibling_generator` is.
    branch_generator: torch.Generator | None = None

    def penalized(self, logits: torch.Tensor, drafts: Sequence[int] = (), drafted: Sequence[int] = ()) -> torch.Tensor:
        """Its penalties and bias on logits [n, V]: row j follows committed + drafted + drafts[:j]."""
        if not self.penalties.active:
            return logits
        from specd.engine.logits import penalize

        prompt, output = self.committed[: self.prompt_len], self.committed[self.prompt_len :]
        return penalize(logits, self.penalties, prompt, [*output, *drafted], drafts)


class SequenceTable:
    """Open sequences of one BatchedCausalLM (or of a model-free drafter when lm is None). `device`:
    where sampled sequences' generators live; None for a model-free drafter, which draws nothing."""

    def __init__(
        self,
        lm: BatchedCausalLM | None,
        vocab_size: int,
        max_sequences: int,
        max_context: int,
        device: torch.device | None,
        prefill_chunk_tokens: int = 4096,
        scores_prompts: bool = False,
        grammars: GrammarCompiler | None = None,
        branch_slots: int = 0,
    ) -> None:
        self.lm = lm
        self.vocab_size = vocab_size
        self.max_sequences = max_sequences
        self.max_context = max_context
        self.device = device
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Only the verifier's logprobs are the target's: a drafter ignores prompt logprob requests.
        self.scores_prompts = scores_prompts
        # Compiles structured-output constraints; None: a service without a tokenizer (n-gram drafter).
        self.grammars = grammars
        self.seqs: dict[str, SequenceState] = {}
        # Slots beside the sequences' own for a drafter's fan-out branches. Any free slot serves
        # either; only the count of branches held is bounded, so opens are never starved.
        self.branch_slots = branch_slots
        self.branches_held = 0
        self._free: list[int] = list(range(max_sequences + branch_slots))
        if lm is not None:
            # One slot per sequence (and branch), each as long as the context window: a sequence
            # that was opened never needs more memory than is reserved here.
            lm.reserve(max_sequences + branch_slots, max_context)
        heapq.heapify(self._free)

    def __len__(self) -> int:
        return len(self.seqs)

    def get(self, sequence_id: str) -> SequenceState:
        try:
            return self.seqs[sequence_id]
        except KeyError:
            raise not_found(f"sequence {sequence_id!r} is not open") from None

    def check_tokens(self, tokens: Iterable[int], what: str) -> None:
        for t in tokens:
            if not 0 <= t < self.vocab_size:
                raise invalid(f"{what}: token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def open(self, specs: Sequence[SequenceSpec]) -> tuple[list[EngineError | None], int]:
        """Open and prefill; returns per-spec errors (None = opened) and forward ns."""
        errors: list[EngineError | None] = [None] * len(specs)
        opened: list[SequenceState] = []
        limits: list[int | None] = []
        seen: set[str] = set()
        for i, spec in enumerate(specs):
            try:
                if not spec.sequence_id:
                    raise invalid("sequence_id must not be empty")
                if spec.sequence_id in self.seqs or spec.sequence_id in seen:
                    raise invalid(f"sequence {spec.sequence_id!r} is already open")
                if not spec.prompt:
                    raise invalid("prompt_token_ids must not be empty")
                self.check_tokens(spec.prompt, "prompt")
                if len(spec.prompt) >= self.max_context:
                    raise invalid(f"prompt has {len(spec.prompt)} tokens; the context window is {self.max_context}")
                reason = validate_sampling(spec.sampling) or validate_penalties(spec.penalties, self.vocab_size)
                if spec.logprobs is not None and not reason:
                    reason = RANGES["top_logprobs"].problem("top_logprobs", spec.logprobs.top)
                if reason:
                    raise invalid(reason)
                if not 0 <= spec.num_generated < len(spec.prompt):
                    raise invalid(f"num_generated {spec.num_generated} must be below the prompt's length")
                if len(self.seqs) + len(opened) >= self.max_sequences:
                    raise exhausted(f"all {self.max_sequences} sequence slots are in use")
                self.check_tokens(spec.end_token_ids, "end_token_ids")
                ends = frozenset(spec.end_token_ids)
                grammar = self._grammar(spec, ends or None)
            except EngineError as exc:
                errors[i] = exc
                continue
            seen.add(spec.sequence_id)
            state = SequenceState(
                spec.sequence_id,
                heapq.heappop(self._free),
                list(spec.prompt),
                [],
                spec.sampling,
                self._generator(spec.sampling),
                spec.penalties,
                len(spec.prompt) - spec.num_generated,
                spec.logprobs,
                grammar=grammar,
                ends=ends,
            )
            opened.append(state)
            # A sequence that scores its prompt is prefilled whole: its logprobs come back with the open.
            limits.append(None if self._scores_prompt(state) else spec.prefill_tokens)
        try:
            work = [
                (s, self.pending(s) if n is None else min(n, self.pending(s)))
                for s, n in zip(opened, limits, strict=True)
            ]
            forward_ns = self._prefill(work) if self.lm is not None else 0
        except BaseException:
            # A failed prefill (out of memory, a bad kernel) opens nothing: the
            # slots taken above go back, so no request can leak them.
            for state in opened:
                self._free_slot(state.slot)
            raise
        for state in opened:
            self.seqs[state.sequence_id] = state
        return errors, forward_ns

    def _generator(self, sampling: SamplingParams) -> torch.Generator | None:
        if self.device is None:
            return None
        from specd.engine.sampling import make_generator

        return make_generator(sampling, self.device)

    def _grammar(self, spec: SequenceSpec, ends: frozenset[int] | None) -> GrammarMatcher | None:
        """The sequence's grammar state, having consumed what it already generated; None if unconstrained."""
        if not spec.json_schema and not spec.grammar:
            return None
        if self.grammars is None:
            if self.lm is None:
                # The n-gram drafter has no tokenizer: it proposes unconstrained, and the
                # verifier, which always constrains, rejects what the grammar refuses.
                return None
            raise invalid(
                "this service has no grammar engine for its tokenizer: it cannot apply a json_schema or grammar"
            )
        from specd.engine.grammar import GrammarError

        try:
            grammar = self.grammars.matcher(spec.json_schema, spec.grammar, ends)
            if spec.num_generated:
                grammar.push(spec.prompt[len(spec.prompt) - spec.num_generated :])
        except GrammarError as exc:
            raise invalid(f"{'json_schema' if spec.json_schema else 'grammar'}: {exc}") from None
        return grammar

    def pending(self, state: SequenceState) -> int:
        """Committed tokens (all but the last, which a round feeds) not cached yet: prefill left to do."""
        if self.lm is None:
            return 0  # a model-free drafter caches nothing
        return max(0, len(state.committed) - 1 - len(state.cached))

    def prefill(self, work: Sequence[tuple[SequenceState, int]]) -> int:
        """Cache up to n more committed tokens of each sequence (a chunk of its prefill); returns forward ns."""
        if self.lm is None:
            return 0
        return self._prefill([(s, min(n, self.pending(s))) for s, n in work])

    def _prefill(self, work: Sequence[tuple[SequenceState, int]]) -> int:
        """Cache the next n prompt tokens of each sequence (n = all but the last, at a whole-prompt open)."""
        assert self.lm is not None
        from specd.engine.logprobs import token_logprobs
        from specd.engine.rows import Row

        start = time.perf_counter_ns()
        work, copies = self._share_prefills(work)
        todo = sorted(((s, n) for s, n in work if n > 0), key=lambda w: w[1])
        while todo:
            # Similar lengths together keep padding small; chunk to bound memory.
            batch = [todo.pop()]
            longest = batch[0][1]
            while todo and longest * (len(batch) + 1) <= self.prefill_chunk_tokens:
                batch.append(todo.pop())
            rows = []
            for s, n in batch:
                at = len(s.cached)
                rows.append(Row(s.slot, at, s.committed[at : at + n], self._logits_from(s, n)))
            outs = self.lm.forward(rows)
            for (s, n), logits in zip(batch, outs, strict=True):
                at = len(s.cached)
                s.cached = s.committed[: at + n]
                if self._scores_prompt(s):
                    assert s.logprobs is not None
                    # Row j scores the token after it: committed[at + 1 + j].
                    scored = token_logprobs(logits, s.committed[at + 1 : at + n + 1], s.logprobs.top)
                    s.prompt_logprobs = [*(s.prompt_logprobs or []), *scored]
        for leader, follower in copies:
            self.lm.cache.copy_prefix(leader.slot, follower.slot, len(leader.cached))
            follower.cached = follower.committed[: len(leader.cached)]
        for s, _ in work:
            if self._scores_prompt(s) and s.prompt_logprobs is None:
                s.prompt_logprobs = []  # a one-token prompt: nothing to score
        return time.perf_counter_ns() - start

    def _share_prefills(
        self, work: Sequence[tuple[SequenceState, int]]
    ) -> tuple[list[tuple[SequenceState, int]], list[tuple[SequenceState, SequenceState]]]:
        """Sequences opened together with the same prompt (the n choices of one request) share one
        prefill: only the first is fed; the others get its cache by copy. Returns the work left to
        feed and the (fed, copied to) pairs. Those that score their prompt are fed each."""
        feed: list[tuple[SequenceState, int]] = []
        copies: list[tuple[SequenceState, SequenceState]] = []
        leaders: dict[tuple[int, ...], SequenceState] = {}
        for s, n in work:
            key = tuple(s.committed[:n])
            if n <= 0 or s.cached or self._scores_prompt(s):
                feed.append((s, n))
            elif key in leaders:
                copies.append((leaders[key], s))
            else:
                leaders[key] = s
                feed.append((s, n))
        return feed, copies

    def _scores_prompt(self, s: SequenceState) -> bool:
        return self.scores_prompts and s.logprobs is not None and s.logprobs.prompt

    def _logits_from(self, s: SequenceState, n: int) -> int:
        # Logits at every prompt position score tokens 1.. of the prompt; otherwise the
        # prefill only needs its last position's (which this forward discards anyway).
        return 0 if self._scores_prompt(s) else n - 1

    def close(self, ids: Sequence[str], ignore_unknown: bool = False) -> int:
        """Free the sequences; returns how many were open.

        All or nothing: an unknown id is NOT_FOUND before anything is freed, so a
        caller that gets the error knows every sequence it named is still open.
        With `ignore_unknown` (a caller cleaning up ids it is unsure of) unknown
        ids are skipped instead.
        """
        wanted = list(dict.fromkeys(ids))
        unknown = [i for i in wanted if i not in self.seqs]
        if unknown and not ignore_unknown:
            raise not_found(f"sequences not open (none closed): {', '.join(map(repr, unknown))}")
        closed = 0
        for sequence_id in wanted:
            state = self.seqs.get(sequence_id)
            if state is not None:
                # Memory first: whoever sees the sequence gone sees its memory gone too.
                self.drop_branches(state)
                self._free_slot(state.slot)
                del self.seqs[sequence_id]
                closed += 1
        if closed and not self.seqs and self.lm is not None and self.lm.cache.lazy:
            # Load dropped to nothing: the forwards' freed activations go back to the system too.
            trim_heap()
        return closed

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take_branch_slot(self) -> int | None:
        """A free slot for a fan-out branch, or None where the branches hold all theirs."""
        if self.branches_held >= self.branch_slots:
            return None
        self.branches_held += 1
        return heapq.heappop(self._free)

    def drop_branches(self, state: SequenceState) -> None:
        """Free the slots of the sequence's branches, their pages still backed: the next round's
        branches copy a prefix into them again, and pages the kernel took back fault in anew on
        every copy (several times the copy itself on the CPU)."""
        for branch in state.branches:
            self.branches_held -= 1
            heapq.heappush(self._free, branch.slot)
        state.branches = []

    def _free_slot(self, slot: int) -> None:
        if self.lm is not None:
            self.lm.cache.release(slot)
        heapq.heappush(self._free, slot)

    def kv_bytes(self) -> int:
        """KV-cache bytes backed by memory now (on the CPU: the open sequences' written positions)."""
        return self.lm.cache.allocated_bytes() if self.lm is not None else 0

    def kv_reserved_bytes(self) -> int:
        """The most the KV cache can ever take: (max_sequences + branch_slots) x max_context positions."""
        return self.lm.cache.reserved_bytes() if self.lm is not None else 0

    def kv_bytes_per_token(self) -> int:
        return self.lm.cache.bytes_per_token() if self.lm is not None else 0
