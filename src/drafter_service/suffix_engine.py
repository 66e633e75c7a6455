"""The suffix drafter (no gRPC here): model-free, it continues the longest match of each
sequence's suffix in a trie over its own prompt and output, or in its tenant's trie over
earlier responses (specd.engine.suffix), whichever continuation scores higher."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drafter_service.base import DrafterBase
from specd.engine import suffix
from specd.engine.errors import EngineError
from specd.engine.sequences import SequenceState, SequenceTable
from specd.engine.tasks import DraftProposal, DraftTask, RoundTiming, SequenceSpec


@dataclass
class _Track:
    """What the drafter keeps of one open sequence: its own trie, and where its text stands in
    its own trie and in its tenant's."""

    tenant: str
    local: suffix.SuffixTrie
    active: list[int]
    cursor: suffix.Cursor
    seen: int  # committed tokens counted in `local` and followed by `cursor`


class SuffixDrafter(DrafterBase):
    """Deterministic, so every proposed token has probability 1 under the proposer and no
    distributions go on the wire. A greedy sequence asked for siblings gets each depth's
    runner-up continuation as a leaf beside the chain (a token tree)."""

    kind = "suffix"

    def __init__(
        self,
        vocab_size: int,
        max_sequences: int,
        max_context: int,
        max_draft_tokens: int,
        depth: int = 16,
        responses: int = 32,
        tenants: int = 16,
        limits: suffix.Limits | None = None,
    ) -> None:
        table = SequenceTable(None, vocab_size, max_sequences, max_context, None)
        super().__init__(table, None, max_draft_tokens)
        self.depth = depth
        self.limits = limits or suffix.Limits()
        self.tries = suffix.GlobalTries(depth, responses, tenants)
        self.tracks: dict[str, _Track] = {}

    def open(self, specs: Sequence[SequenceSpec]) -> tuple[list[EngineError | None], int]:
        errors, forward_ns = self.table.open(specs)
        for spec, error in zip(specs, errors, strict=True):
            if error is None:
                local = suffix.SuffixTrie(self.depth)
                track = _Track(spec.tenant, local, [], suffix.Cursor(self.tries.get(spec.tenant).trie), 0)
                self.tracks[spec.sequence_id] = track
                self._catch_up(track, self.table.get(spec.sequence_id))
        return errors, forward_ns

    def close(
        self, ids: Sequence[str], ignore_unknown: bool = False, tails: Mapping[str, tuple[list[int], int]] | None = None
    ) -> int:
        """Close `ids`; each response joins its tenant's trie, with the tokens committed since its
        last task where `tails` has them (id -> (tokens, committed count after them)): a sequence
        that stopped drafting would otherwise be learnt only as far as it drafted. A tail that
        does not continue the committed tokens is left out (the response is learnt without it)."""
        closing = set(ids)
        tails = {sid: tail for sid, tail in (tails or {}).items() if sid in closing}
        for tokens, _ in tails.values():
            self.table.check_tokens(tokens, "tail tokens")  # before anything is closed
        for sid, (tokens, committed) in tails.items():
            state = self.table.seqs.get(sid)
            if state is not None and len(state.committed) + len(tokens) == committed:
                state.committed.extend(tokens)
        states = [self.table.seqs[i] for i in dict.fromkeys(ids) if i in self.table.seqs]
        closed = self.table.close(ids, ignore_unknown)
        # Reached only when the close went through: its outputs join their tenants' tries.
        for state in states:
            track = self.tracks.pop(state.sequence_id)
            self.tries.get(track.tenant).add(state.committed[state.prompt_len :])
        return closed

    def _catch_up(self, track: _Track, state: SequenceState) -> None:
        """Count the committed tokens the tries have not seen: O(depth) each, never a rescan."""
        new = state.committed[track.seen :]
        if not new:
            return
        track.active = track.local.extend(track.active, new)
        track.cursor.advance(new)
        track.seen = len(state.committed)

    def draft(self, tasks: Sequence[DraftTask]) -> tuple[list[DraftProposal], RoundTiming]:
        proposals, live = self._accept_tasks(tasks)
        start = time.time_ns()
        for i, state, k, _ in live:
            track = self.tracks[state.sequence_id]
            self._catch_up(track, state)
            if k <= 0:
                continue
            draft = self._propose(track, tasks[i].assumed, k)
            proposals[i].tokens = list(draft.chain)
            wanted = tasks[i].num_siblings if state.params.greedy and not state.penalties.active else 0
            siblings = draft.siblings[:wanted]
            if siblings:
                proposals[i].tokens += [token for _, token in siblings]
                proposals[i].parents = [*range(-1, len(draft.chain) - 1), *(parent for parent, _ in siblings)]
        timing = RoundTiming(batch_size=len(live))
        timing.phases.append(("suffix", start, time.time_ns()))
        return proposals, timing

    def _propose(self, track: _Track, assumed: Sequence[int], k: int) -> suffix.Draft:
        """The better of the continuations in the sequence's own trie and in its tenant's."""
        local = track.local
        nodes = local.follow(track.active, assumed) if assumed else track.active
        node, match = suffix.deepest(local, nodes)
        best = suffix.continue_from(local, node, k, self.limits, match) if match else suffix.Draft()
        shared = track.cursor.trie
        nodes = shared.follow(track.cursor.valid(), assumed) if assumed else track.cursor.valid()
        node, match = suffix.deepest(shared, nodes)
        if match:
            other = suffix.continue_from(shared, node, k, self.limits, match)
            if other.score > best.score:
                best = other
        return best
