"""In-process drafter and verifier that speak the round protocol, for testing the scheduler with no model.

The target is a deterministic greedy "model": the next token is a fixed function of
the last three. The drafter follows the same rule except at positions it is told
to get wrong, so acceptance is partial and known. Both check the protocol the way
the real services do (committed counts, unknown ids), so a scheduler bug that
sends the wrong tokens shows up as an error or as output that differs from
target-only decoding.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gateway.backends import BackendError
from gateway.round.messages import chain_length
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2

VOCAB = 50
EOS = 0


def target_next(context: list[int]) -> int:
    a, b, c = [0, 0, 0, *context][-3:]
    return 1 + (7 * a + 13 * b + 29 * c + len(context)) % (VOCAB - 1)  # never EOS


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(target_next(tokens))
    return tokens[len(prompt) :]


def model_info(max_sequences: int = 64, max_context: int = 4096, max_draft_tokens: int = 8) -> Any:
    return common_pb2.ModelInfo(
        model_id="fake",
        tokenizer=common_pb2.TokenizerFingerprint(
            vocab_size=VOCAB, vocab_sha256="fake", special_token_ids={"eos": EOS}
        ),
        max_context=max_context,
        model_vocab_size=VOCAB,
        max_sequences=max_sequences,
        max_draft_tokens=max_draft_tokens,
    )


class _FakeService:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.info = model_info()
        self.address = "fake:0"
        self.timeout_s = 1.0
        self.committed: dict[str, list[int]] = {}
        # Per sequence closed with a tail (DraftTail): its committed tokens then the tail, and the
        # count the tail claimed.
        self.tails: dict[str, tuple[list[int], int]] = {}
        self.delay_s = delay_s
        self.busy = 0  # rounds in flight, to see overlap
        self.max_busy_with_other = 0
        self.other: _FakeService | None = None
        self.fail_next: Exception | None = None
        # Chunked prefill: tokens cached per sequence, and every chunk prefilled, (id, tokens) in order.
        self.cached: dict[str, int] = {}
        self.chunks: list[tuple[str, int]] = []
        self.opens: list[list[Any]] = []
        self.open_delay_s = 0.0  # an open's prefill takes this long, counted as busy

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        return True

    def reset_rounds(self) -> None:
        pass

    def pending(self, sid: str) -> int:
        return max(0, len(self.committed[sid]) - 1 - self.cached[sid])

    def prefill(self, sid: str, n: int) -> int:
        """Cache up to n more tokens; returns what is left."""
        n = min(n, self.pending(sid))
        self.cached[sid] += n
        if n:
            self.chunks.append((sid, n))
        return self.pending(sid)

    async def open(self, specs: list[Any]) -> list[Any]:
        self.opens.append(list(specs))
        if self.open_delay_s:
            self.busy += 1
            try:
                await asyncio.sleep(self.open_delay_s)
                if self.other is not None and self.other.busy:
                    self.max_busy_with_other = max(self.max_busy_with_other, self.other.busy)
            finally:
                self.busy -= 1
        results = []
        for spec in specs:
            if spec.sequence_id in self.committed:
                results.append(
                    common_pb2.OpenResult(
                        sequence_id=spec.sequence_id,
                        error=common_pb2.SequenceError(code=common_pb2.ERROR_CODE_INVALID_ARGUMENT, message="dup"),
                    )
                )
                continue
            self.committed[spec.sequence_id] = list(spec.prompt_token_ids)
            self.cached[spec.sequence_id] = 0
            limit = spec.prefill_tokens if spec.HasField("prefill_tokens") else len(spec.prompt_token_ids)
            pending = self.prefill(spec.sequence_id, limit)
            results.append(common_pb2.OpenResult(sequence_id=spec.sequence_id, prefill_pending=pending))
        return results

    async def close_sequences(self, ids: list[str], tails=None) -> None:
        for sid, (tokens, count) in (tails or {}).items():
            # What a drafter learning responses would hold: its tokens then the tail, where they add up.
            whole = [*self.committed.get(sid, []), *tokens]
            self.tails[sid] = (whole, count)
        for sid in ids:
            self.committed.pop(sid, None)
            self.cached.pop(sid, None)
            if hasattr(self, "hidden"):
                self.hidden.pop(sid, None)

    async def _work(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        self.busy += 1
        try:
            await asyncio.sleep(self.delay_s)
            if self.other is not None and self.other.busy:
                self.max_busy_with_other = max(self.max_busy_with_other, self.other.busy)
        finally:
            self.busy -= 1


def hidden_row(position: int) -> bytes:
    """The fake target's "hidden state" at a position: one 2-byte row that names the position."""
    return position.to_bytes(2, "little")


def q_fits(task: Any) -> bool:
    """Each draft of a verify task comes with its own q row, in which it has probability."""
    rows = task.draft_distributions
    return len(rows) == len(task.draft_token_ids) and all(
        t in row.token_ids for t, row in zip(task.draft_token_ids, rows, strict=True)
    )


class FakeVerifier(_FakeService):
    def __init__(self, delay_s: float = 0.0, drafter: FakeDrafter | None = None) -> None:
        super().__init__(delay_s)
        self.requests: list[Any] = []
        # Blocks that are not what the drafter proposes after the committed tokens:
        # stale drafts (still exact, since the verifier decides, but wasted).
        self.drafter = drafter
        self.stale_blocks = 0
        # Blocks refused as the real verifier refuses them: a q row per draft, each naming its draft.
        self.bad_q_blocks = 0
        self.sibling_hits = 0  # token trees whose accepted path ended in a sibling

    @staticmethod
    def walk(task: Any, committed: list[int]) -> list[int]:
        """The drafts the target accepts, root first: at each node, its first child that is the
        target's token (a chain's nodes each have one child, the next draft)."""
        parents = list(task.draft_parents) or list(range(-1, len(task.draft_token_ids) - 1))
        context, path, node = list(committed), [], -1
        while True:
            want = target_next(context)
            child = next((i for i, p in enumerate(parents) if p == node and task.draft_token_ids[i] == want), None)
            if child is None:
                return path
            path.append(child)
            context.append(want)
            node = child

    async def verify(self, request: Any) -> Any:
        self.requests.append(request)
        await self._work()
        reply = verifier_pb2.VerifyResponse(round_id=request.round_id)
        reply.timings.total_ns = reply.timings.forward_ns = 1_000_000
        for task in request.tasks:
            result = reply.results.add(sequence_id=task.sequence_id)
            tokens = self.committed.get(task.sequence_id)
            if tokens is None or len(tokens) != task.num_committed:
                result.error.code = common_pb2.ERROR_CODE_FAILED_PRECONDITION
                result.error.message = "count mismatch"
                continue
            if task.prefill_tokens:
                result.prefill_pending = self.prefill(task.sequence_id, task.prefill_tokens)
                continue
            if self.pending(task.sequence_id):
                # The real verifier would prefill the rest in this round: the stall chunking avoids.
                result.error.code = common_pb2.ERROR_CODE_INTERNAL
                result.error.message = "verified before its prefill was done"
                continue
            if task.draft_distributions and not q_fits(task):
                self.bad_q_blocks += 1
                result.error.code = common_pb2.ERROR_CODE_INVALID_ARGUMENT
                result.error.message = "draft distributions do not fit their tokens"
                continue
            if self.drafter is not None and task.draft_token_ids:
                parents = list(task.draft_parents)
                chain = chain_length(parents) if parents else None
                drafts = list(task.draft_token_ids)[:chain]
                self.stale_blocks += drafts != self.drafter.propose(tokens, len(drafts))
            path = self.walk(task, tokens)
            tokens.extend(task.draft_token_ids[i] for i in path)
            accepted = len(path)
            if task.draft_parents:
                result.accepted_path.extend(path)
                chain = chain_length(task.draft_parents)
                self.sibling_hits += bool(path) and path[-1] >= chain
            if task.return_hidden_states:
                # One row per position fed and kept: the last committed token and the accepted drafts.
                first = self.cached[task.sequence_id]
                result.hidden_start = first
                result.hidden_states = b"".join(hidden_row(p) for p in range(first, len(tokens)))
            result.num_accepted = accepted
            result.next_token_id = target_next(tokens)
            tokens.append(result.next_token_id)
            self.cached[task.sequence_id] = len(tokens) - 1
        return reply


class FakeDrafter(_FakeService):
    """Drafts the target's token except where `wrong(context_length)` says to be off by one."""

    kind = common_pb2.DRAFTER_KIND_MODEL

    def __init__(
        self, wrong: Callable[[int], bool] = lambda n: n % 4 == 3, delay_s: float = 0.0, feature_size: int = 0
    ) -> None:
        super().__init__(delay_s)
        self.wrong = wrong
        self.requests: list[Any] = []
        # A feature drafter (feature_size 1: 2-byte rows): the rows it holds per sequence, by position,
        # rows whose content names another position, and drafts made without every verified position's row.
        self.feature_size = feature_size
        self.hidden: dict[str, dict[int, bytes]] = {}
        self.prompt_len: dict[str, int] = {}
        self.misplaced_rows = 0
        self.drafted_without_rows = 0
        self.branches = 0  # fan-out branches proposed

    async def open(self, specs: list[Any]) -> list[Any]:
        results = await super().open(specs)
        for spec, result in zip(specs, results, strict=True):
            if not result.error.code:
                self.hidden[spec.sequence_id] = {}
                self.prompt_len[spec.sequence_id] = len(spec.prompt_token_ids) - spec.num_generated
        return results

    def take_hidden(self, task: Any) -> None:
        rows = self.hidden[task.sequence_id]
        data = task.hidden_states
        for j in range(len(data) // 2):
            position = task.hidden_start + j
            self.misplaced_rows += data[2 * j : 2 * j + 2] != position.to_bytes(2, "little")
            rows[position] = data[2 * j : 2 * j + 2]

    async def draft(self, request: Any) -> Any:
        self.requests.append(request)
        await self._work()
        reply = drafter_pb2.DraftResponse(round_id=request.round_id)
        reply.timings.total_ns = reply.timings.forward_ns = 1_000_000
        for task in request.tasks:
            proposal = reply.proposals.add(sequence_id=task.sequence_id)
            tokens = self.committed.get(task.sequence_id)
            if tokens is None:
                proposal.error.code = common_pb2.ERROR_CODE_NOT_FOUND
                proposal.error.message = "unknown"
                continue
            if len(tokens) + len(task.new_token_ids) != task.num_committed:
                proposal.error.code = common_pb2.ERROR_CODE_FAILED_PRECONDITION
                proposal.error.message = "count mismatch"
                continue
            unprefilled = self.pending(task.sequence_id)  # of what it had before this task's tokens
            tokens.extend(task.new_token_ids)
            if self.feature_size:
                self.take_hidden(task)
                rows = self.hidden[task.sequence_id]
                # Every position the verifier has fed (all but the last committed) from the prompt's last on.
                wanted = range(self.prompt_len[task.sequence_id] - 1, len(tokens) - 1)
                if task.num_draft_tokens and any(p not in rows for p in wanted):
                    self.drafted_without_rows += 1
            elif task.hidden_states:
                proposal.error.code = common_pb2.ERROR_CODE_INVALID_ARGUMENT
                proposal.error.message = "this drafter reads no hidden states"
                continue
            if task.prefill_tokens:
                proposal.prefill_pending = self.prefill(task.sequence_id, task.prefill_tokens)
                continue
            if task.num_draft_tokens and unprefilled:
                proposal.error.code = common_pb2.ERROR_CODE_INTERNAL
                proposal.error.message = "drafted before its prefill was done"
                continue
            if not unprefilled:
                self.cached[task.sequence_id] = len(tokens) - 1  # a draft step feeds what it was told
            context = tokens + list(task.assumed_token_ids)
            drafts = self.propose(context, task.num_draft_tokens)
            proposal.token_ids.extend(drafts)
            # Each draft's q (a point mass on it, as a greedy drafter's): the verifier checks each row fits.
            proposal.distributions.extend(common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in drafts)
            if task.num_siblings and drafts:
                self.add_siblings(proposal, context, drafts, task.num_siblings)
            if task.num_branches and task.guess_first and not self.feature_size:
                self.add_branches(
                    proposal, tokens, list(task.assumed_token_ids), task.num_draft_tokens, task.num_branches
                )
        return reply

    def add_branches(self, proposal: Any, committed: list[int], assumed: list[int], n: int, most: int) -> None:
        """Blocks after the other verdicts on `assumed` (DraftTask.num_branches): the first j accepted
        and another token than assumed[j], or all accepted and another guess than the main one.
        Those it drafted wrong come first (there its "next likeliest" is the target's token, the
        verdict that comes), then the others in order (a token that is not the target's)."""
        main_guess = proposal.token_ids[0] if proposal.token_ids else None
        verdicts = sorted(range(len(assumed) + 1), key=lambda j: not self.wrong(len(committed) + j))[:most]
        for j in verdicts:
            context = committed + assumed[:j]
            right = target_next(context)
            other = assumed[j] if j < len(assumed) else main_guess
            guess = right if right != other else 1 + right % (VOCAB - 1)
            tokens = [guess, *self.propose([*context, guess], n - 1)]
            branch = proposal.branches.add(num_assumed=j, token_ids=tokens)
            branch.distributions.extend(common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in tokens)
            self.branches += 1

    def add_siblings(self, proposal: Any, context: list[int], drafts: list[int], most: int) -> None:
        """Leaves beside the chain, the depths it drafted wrong first (there a sibling is the
        target's token: the drafter's "next likeliest"), then the others (a token that is not)."""
        depths = sorted(range(len(drafts)), key=lambda j: not self.wrong(len(context) + j))[:most]
        proposal.parents.extend(range(-1, len(drafts) - 1))
        for j in depths:
            right = target_next(context + drafts[:j])
            sibling = right if drafts[j] != right else 1 + right % (VOCAB - 1)
            proposal.token_ids.append(sibling)
            proposal.parents.append(j - 1)
            proposal.distributions.add(token_ids=[sibling], probs=[1.0])

    def propose(self, context: list[int], n: int) -> list[int]:
        context = list(context)
        for _ in range(n):
            t = target_next(context)
            if self.wrong(len(context)):
                t = 1 + t % (VOCAB - 1)
            context.append(t)
        return context[len(context) - n :]


class BrokenDrafter(FakeDrafter):
    async def draft(self, request: Any) -> Any:
        raise BackendError("drafter down")
