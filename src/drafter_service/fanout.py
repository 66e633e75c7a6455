"""Fan-out draft-ahead (DraftTask.num_branches): blocks drafted after other likely verdicts.

A draft-ahead block assumes the verifier accepts every assumed token and then emits the drafter's
guess. Fan-out also drafts after the next likeliest verdicts (j, guess): the first j assumed
tokens accepted and a replacement for assumed[j], or all k accepted and another guess at the bonus
position j = k. Its likelihood under the drafter's own q is prod_{i<j} q_i(assumed[i]) * q_j(guess),
so a fan-out row needs q after the last committed token and after each assumed one. The drafter
drafted the assumed tokens itself, so it has their q's inputs already (SequenceState.head_inputs,
the head inputs its forwards left at the positions it fed): the first step feeds only what a
plain row feeds and keeps the logits of every position it feeds, and the head turns the kept
inputs into the rest (one product for all fan-out rows). Where any is missing (a block it did
not draft, a restart, one drafted before its first fan-out task) the row feeds every assumed
token again for their q. For num_branches = m
each position offers its m best guesses other than the token the verdict refuses, and the m
likeliest of all (k + 1) * m verdicts are drafted, likeliest first (ties: smaller j, then the
better guess), so two branches may share a num_assumed. The guesses follow the main guess's rule:

- greedy: the likeliest tokens other than the refused one (q: softmax of the logits);
- seeded: the noise's best others, with the noise the verifier uses at that position (the best
  of log q + gumbel noise, as gumbel_argmax scores them);
- unseeded: the likeliest others in the sparse q sent with them (the guess's dist, as guess_first's).

Each chosen branch gets a slot of its own with the main slot's prefix up to its guess, and drafts
as one more row of the same batched steps (it joins at step 1, when the main row feeds its guess);
an unseeded branch draws with a generator of its own, so the main block's draws stay as they
were. The branches' caches stay on the sequence (SequenceState.branches) until its next task
continues the one its committed tokens confirm furthest (`settle`) or its close frees them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence

import torch

from specd.engine.cuda_graphs import read_back
from specd.engine.host_threads import one_torch_thread
from specd.engine.prefix import common_prefix
from specd.engine.sampling import gumbel_top, probabilities, spans_keys, truncate
from specd.engine.sequences import BranchCache, HeadInputs, SequenceState, SequenceTable
from specd.engine.slot_cache import to_device
from specd.engine.tasks import DraftBranch, DraftProposal, DraftTask, SparseDist

Active = tuple[int, SequenceState, int]  # (proposal index, state, tokens to draft), as the drafting loops keep


def confirmed(cached: Sequence[int], context: Sequence[int]) -> int:
    """How much of a cache the context (committed + assumed tokens) confirms; the last context
    token is fed again by the round, so at most all but it."""
    return min(common_prefix(cached, context), len(context) - 1)


def settle(table: SequenceTable, state: SequenceState, context: Sequence[int]) -> None:
    """At the sequence's next task: continue the cache (its own or a branch's) that the context
    confirms furthest, by taking the branch's slot (no copy); free the others."""
    if not state.branches:
        return
    best = max(state.branches, key=lambda b: confirmed(b.cached, context))
    if confirmed(best.cached, context) > confirmed(state.cached, context):
        best.slot, state.slot = state.slot, best.slot
        best.cached, state.cached = state.cached, best.cached
        best.head_inputs, state.head_inputs = state.head_inputs, best.head_inputs
    table.drop_branches(state)


def branch_generator(state: SequenceState) -> torch.Generator:
    """The unseeded sequence's generator for its branches' draws, on the chain generator's device,
    seeded from its seed (a test that fixes one fixes both)."""
    if state.branch_generator is None:
        assert state.generator is not None
        digest = hashlib.blake2b(f"branches {state.generator.initial_seed()}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=state.generator.device)
        state.branch_generator = generator.manual_seed(int.from_bytes(digest, "little") >> 1)
    return state.branch_generator


@dataclasses.dataclass
class _Verdicts:
    """One fan-out row's alternatives read back: per position j in 0..k, its m guesses and the log
    likelihood of each one's verdict; for an unseeded row also the sparse q at j (ids, probs)."""

    alts: list[list[int]]
    scores: list[list[float]]
    dists: list[SparseDist]

    def ranked(self) -> list[tuple[int, int]]:
        """(j, guess's index at j) of every verdict q leaves possible, likeliest first; ties:
        smaller j first, then the better guess."""
        pairs = [(-s, j, r) for j, row in enumerate(self.scores) for r, s in enumerate(row) if s > -math.inf]
        return [(j, r) for _, j, r in sorted(pairs)]


def alternatives(
    logits: torch.Tensor,
    assumed: torch.Tensor,
    guess: torch.Tensor,
    state: SequenceState,
    max_support: int,
    m: int,
) -> torch.Tensor:
    """For logits [k + 1, V] at the last committed token and each assumed one, the refused tokens
    `assumed` [k] then the main guess (0-d): per position j, the m best tokens other than the
    refused one (best first, by the main guess's rule) and each one's verdict's log likelihood,
    log P(the first j assumed accepted) + log q_j(guess) (-inf where q has no such other),
    float64 [k + 1, 2 * m]: the m guesses, then their m scores; an unseeded row's sparse q at j
    follows, ids then probs, [k + 1, 2 * m + 2 * max_support]. m is at most V."""
    params = state.params
    count = logits.shape[0]
    q = logits.float().softmax(dim=-1) if params.greedy else probabilities(logits, [params] * count)
    refused = torch.cat([assumed, guess[None]])[:, None]
    choose, sparse = q, None
    if not params.greedy and not params.seeded:
        ids, top = truncate(q, max_support)
        choose, sparse = torch.zeros_like(q).scatter_(1, ids, top), torch.cat([ids.double(), top.double()], dim=1)
    others = choose.scatter(1, refused, 0.0)
    if params.seeded:
        assert params.seed is not None
        start = len(state.committed)  # assumed[j] sits at position start + j, the bonus at start + k
        alts = gumbel_top(others, spans_keys([(params.seed, start, count)], q.device), m)
    else:
        alts = others.topk(m, dim=-1).indices
    taken = q.gather(1, refused)[:, 0].log()
    before = torch.cat([taken.new_zeros(1), taken[:-1].cumsum(0)])  # the accepted tokens' part
    score = before[:, None] + q.gather(1, alts).log()
    score = score.masked_fill(~(others.gather(1, alts) > 0), float("-inf"))
    out = torch.cat([alts.double(), score.double()], dim=1)
    return out if sparse is None else torch.cat([out, sparse], dim=1)


def _parse(values: list[float], count: int, m: int, max_support: int) -> _Verdicts:
    """A row's `alternatives`, read back flat: `count` positions, m guesses each."""
    width = len(values) // count
    rows = [values[j * width : (j + 1) * width] for j in range(count)]
    dists = []
    for row in rows:
        if width > 2 * m:
            ids, probs = row[2 * m : 2 * m + max_support], row[2 * m + max_support :]
            kept = sum(1 for p in probs if p > 0)
            dists.append(SparseDist([int(t) for t in ids[:kept]], probs[:kept]))
    return _Verdicts([[int(t) for t in row[:m]] for row in rows], [row[m : 2 * m] for row in rows], dists)


class FanOut:
    """A round's fan-out rows: the tasks that asked for branches (and drafts), while a branch
    slot is free; their logits from step 0, then their branches as rows of the later steps."""

    def __init__(self, tasks: Sequence[DraftTask], active: Sequence[Active], table: SequenceTable, enabled: bool):
        self.tasks = tasks
        self.table = table
        self.rows: dict[int, SequenceState] = {}
        if enabled and table.branches_held < table.branch_slots:
            self.rows = {i: s for i, s, _ in active if tasks[i].num_branches > 0}
        self.at: list[int] = []  # the fan-out rows' indices in step 0's rows
        self._logits: list[torch.Tensor] = []
        # Per fan-out row: the kept head inputs of q's first positions, and positions step 0 feeds
        # before its last whose logits it keeps.
        self._kept: dict[int, list[torch.Tensor]] = {}
        self._extra: dict[int, int] = {}
        # (main proposal's index, num_assumed, the branch's proposal's index, its head inputs)
        self._chosen: list[tuple[int, int, int, HeadInputs]] = []

    def __bool__(self) -> bool:
        return bool(self.rows)

    def reuse(self, i: int, state: SequenceState, context: list[int]) -> None:
        """After row i's cache is rolled back to what `context` confirms (and its head inputs
        follow it): a fan-out row's q from the last committed token on comes from the head inputs
        kept where they are all there, else its cache drops the assumed tokens to feed them again."""
        if i not in self.rows:
            return
        first = len(state.committed) - 1  # q of assumed[0] is the head's at the last committed token
        kept = [state.head_inputs.at.get(p) for p in range(first, len(state.cached))]
        if any(x is None for x in kept):
            del state.cached[first:]
            kept = []
        self._kept[i] = [x for x in kept if x is not None]
        self._extra[i] = len(context) - 1 - max(len(state.cached), first)

    def extra(self, i: int, step: int) -> int:
        """Positions before its last whose logits row i keeps at `step`: a fan-out row's first step
        keeps those of the assumed tokens it feeds."""
        return self._extra[i] if step == 0 and i in self.rows else 0

    def keep(self, active: Sequence[Active], logits: list[torch.Tensor]) -> list[torch.Tensor]:
        """Keep step 0's q of the fan-out rows at every position from the last committed token on:
        the logits of their kept head inputs (one head product), then the step's own; every row's
        last position, for the step itself."""
        self.at = [r for r, (i, _, _) in enumerate(active) if i in self.rows]
        self._logits = [logits[r] for r in self.at]
        kept = [x for i in self.rows for x in self._kept[i]]
        if kept:
            assert self.table.lm is not None
            earlier = self.table.lm.logits_of(torch.stack(kept)).split([len(self._kept[i]) for i in self.rows])
            self._logits = [torch.cat([e, x]) for e, x in zip(earlier, self._logits, strict=True)]
        return [x[-1:] for x in logits]

    def start(
        self,
        guesses: torch.Tensor,
        proposals: list[DraftProposal],
        contexts: dict[int, list[int]],
        feed: dict[int, list[int]],
        max_support: int,
    ) -> list[Active]:
        """After step 0 (each fan-out row's main guess in `guesses`, in `at`'s order): choose the
        branches, give each a slot with its prefix and a proposal (appended to `proposals`, its
        guess first), and return those that draft on, as rows for the next steps."""
        device = guesses.device
        # No more guesses per position than branches this round could get (FanOut leaves room for one).
        room = self.table.branch_slots - self.table.branches_held
        widths = [min(self.tasks[i].num_branches, room, self._logits[n].shape[-1]) for n, i in enumerate(self.rows)]
        with one_torch_thread(device):
            flat = []
            for n, (i, state) in enumerate(self.rows.items()):
                assumed = to_device(list(self.tasks[i].assumed), device)
                out = alternatives(self._logits[n], assumed, guesses[n], state, max_support, widths[n])
                flat.append(out.flatten())  # rows differ in width (m, a sparse q): one flat read back
            values = read_back(torch.cat(flat)) if flat else []
        joined: list[Active] = []
        offset = 0
        for n, (i, state) in enumerate(self.rows.items()):
            size = flat[n].numel()
            verdicts = _parse(values[offset : offset + size], len(self.tasks[i].assumed) + 1, widths[n], max_support)
            offset += size
            for j, r in verdicts.ranked()[: widths[n]]:
                row = self._branch(i, state, j, r, verdicts, proposals, contexts, feed)
                if row is None:
                    break  # out of branch slots: fewer branches
                if row[2] > 1:
                    joined.append(row)
        return joined

    def _branch(
        self,
        i: int,
        state: SequenceState,
        j: int,
        r: int,
        verdicts: _Verdicts,
        proposals: list[DraftProposal],
        contexts: dict[int, list[int]],
        feed: dict[int, list[int]],
    ) -> Active | None:
        """Row i's branch after its first j assumed tokens accepted and guess r at j: a slot, a copy
        of the main slot's prefix before its guess, a proposal; None where no slot is free."""
        slot = self.table.take_branch_slot()
        if slot is None:
            return None
        prefix = [*state.committed, *self.tasks[i].assumed[:j]]
        assert self.table.lm is not None
        self.table.lm.cache.copy_prefix(state.slot, slot, len(prefix))
        cached = list(prefix)
        inputs = HeadInputs(list(prefix))
        # Recorded before it drafts: a failed round still frees the slot at the next task or close.
        state.branches.append(BranchCache(slot, cached, inputs))
        sampled = state.generator is not None
        branch = dataclasses.replace(
            state,
            slot=slot,
            cached=cached,
            generator=branch_generator(state) if sampled else None,
            sibling_generator=None,
            branches=[],
            head_inputs=inputs,
        )
        guess = verdicts.alts[j][r]
        b = len(proposals)
        proposals.append(DraftProposal(state.sequence_id, [guess], [verdicts.dists[j]] if sampled else []))
        contexts[b] = prefix
        feed[b] = [guess]
        self._chosen.append((i, j, b, inputs))
        return (b, branch, self.tasks[i].num_draft_tokens)

    def finish(self, proposals: list[DraftProposal]) -> None:
        """Move the branches' proposals into their main proposals, likeliest first."""
        if not self._chosen:
            return
        first = min(b for _, _, b, _ in self._chosen)
        for i, j, b, inputs in self._chosen:
            proposals[i].branches.append(DraftBranch(j, proposals[b].tokens, proposals[b].dists))
            inputs.tokens.extend(proposals[b].tokens)
        del proposals[first:]
