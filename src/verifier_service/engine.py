"""Batched verification of draft blocks against the target model (no gRPC here)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TypeVar

import torch

from specd.engine.cuda_graphs import read_back
from specd.engine.device_clock import DeviceClock
from specd.engine.errors import EngineError, ErrorKind, invalid, precondition
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.grammar import GrammarCompiler, GrammarError, apply_mask
from specd.engine.host_threads import one_torch_thread
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.params import TokenLogprob
from specd.engine.sampling import (
    Verdict,
    coupled_verdict,
    deferred_verdict,
    greedy_tokens,
    gumbel_argmax,
    probabilities,
    spans_keys,
)
from specd.engine.sequences import SequenceState, SequenceTable
from specd.engine.tasks import RoundTiming, SequenceSpec, SparseDist, VerifyResult, VerifyTask
from specd.engine.tree_sampling import TreeVerdict, coupled_tree_verdict, tree_rejection_sample
from verifier_service.tree_verify import check_tree, commit_path, noise_spans, verify_row

T = TypeVar("T", list[int], torch.Tensor)
# The sequences verified in a round: (index into the tasks, state, task, the drafter's distributions).
_Live = list[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]]

# Slack for float32 rounding of probabilities that were normalised on another host.
PROB_SUM_TOLERANCE = 1e-3


class VerifierEngine:
    def __init__(
        self,
        lm: BatchedCausalLM,
        fingerprint: TokenizerFingerprint,
        max_sequences: int,
        max_context: int,
        max_draft_tokens: int,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.lm = lm
        self.fingerprint = fingerprint
        self.max_draft_tokens = max_draft_tokens
        self.max_context = min(max_context, lm.max_positions)
        self.table = SequenceTable(
            lm, lm.vocab_size, max_sequences, self.max_context, lm.device, scores_prompts=True, grammars=grammars
        )

    def open(self, specs: Sequence[SequenceSpec]) -> tuple[list[EngineError | None], int]:
        return self.table.open(specs)

    def take_prompt_logprobs(self, sequence_id: str) -> list[TokenLogprob]:
        """The prompt logprobs its open computed (once: they are not kept for the sequence's life)."""
        state = self.table.seqs.get(sequence_id)
        if state is None or state.prompt_logprobs is None:
            return []
        out, state.prompt_logprobs = state.prompt_logprobs, None
        return out

    def close(self, ids: Sequence[str], ignore_unknown: bool = False) -> int:
        return self.table.close(ids, ignore_unknown)

    def _check_draft_distributions(self, task: VerifyTask) -> None:
        """The sparse draft distributions a block came with: one per draft token, each a
        distribution over the vocabulary in which its own draft token has probability."""
        k = len(task.draft_tokens)
        if not task.draft_dists:
            return
        if len(task.draft_dists) != k:
            raise invalid(f"{len(task.draft_dists)} draft distributions for {k} draft tokens")
        for i, (token, dist) in enumerate(zip(task.draft_tokens, task.draft_dists, strict=True)):
            check_sparse(dist, self.lm.vocab_size)  # every probability listed is above 0
            if token not in dist.token_ids:
                raise invalid(f"draft token {token} at position {i} has probability 0 in its own distribution")

    def _draft_distributions(
        self, live: Sequence[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]]
    ) -> list[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]]:
        """`live` with each block's dense q [k, V] in place of None where it came with draft
        distributions: all of them made on the device from one copy of every block's sparse
        lists, not a dense copy per sequence."""
        blocks = [n for n, (_, _, task, _) in enumerate(live) if task.draft_dists]
        if not blocks:
            return list(live)
        rows: list[int] = []
        ids: list[int] = []
        probs: list[float] = []
        row = 0
        for n in blocks:
            for dist in live[n][2].draft_dists:
                rows.extend([row] * len(dist.token_ids))
                ids.extend(dist.token_ids)
                probs.extend(dist.probs)
                row += 1
        device = self.lm.device
        q = torch.zeros((row, self.lm.vocab_size), dtype=torch.float32, device=device)
        at = torch.tensor([rows, ids], dtype=torch.long, device=device)
        q[at[0], at[1]] = torch.tensor(probs, dtype=torch.float32, device=device)
        dense = dict(zip(blocks, q.split([len(live[n][2].draft_tokens) for n in blocks]), strict=True))
        return [(i, state, task, dense.get(n)) for n, (i, state, task, _) in enumerate(live)]

    def _validate(self, state: SequenceState, task: VerifyTask) -> None:
        if task.num_committed != len(state.committed):
            raise precondition(
                f"sequence {task.sequence_id!r} has {len(state.committed)} committed tokens, "
                f"the caller assumed {task.num_committed}"
            )
        k = len(task.draft_tokens)
        if k > self.max_draft_tokens:
            raise invalid(f"{k} draft tokens exceed the limit of {self.max_draft_tokens}")
        if len(state.committed) + k > self.max_context:
            raise invalid(
                f"{len(state.committed)} committed + {k} draft tokens exceed the context window {self.max_context}"
            )
        self.table.check_tokens(task.draft_tokens, "draft")
        self._check_draft_distributions(task)
        check_tree(state, task)

    @staticmethod
    def _validate_prefill(state: SequenceState, task: VerifyTask) -> None:
        if task.num_committed != len(state.committed):
            raise precondition(
                f"sequence {task.sequence_id!r} has {len(state.committed)} committed tokens, "
                f"the caller assumed {task.num_committed}"
            )
        if task.draft_tokens or task.draft_dists or task.draft_parents:
            raise invalid("a prefill task carries no draft tokens")

    def verify(self, tasks: Sequence[VerifyTask]) -> tuple[list[VerifyResult], RoundTiming]:
        results = [VerifyResult(t.sequence_id) for t in tasks]
        live, rows, prefills = self._admit(tasks, results)
        live = self._draft_distributions(live)
        timing = RoundTiming(batch_size=len(rows), tokens_fed=sum(len(r.tokens) for r in rows))
        if prefills:
            self._prefill_chunks(prefills, results, timing)
        if not rows:
            return results, timing
        clock = DeviceClock(self.lm.device)
        if any(task.return_hidden for _, _, task, _ in live):
            logits, hidden = self.lm.forward_hidden(rows)
        else:
            logits, hidden = self.lm.forward(rows), []
        clock.stop()
        with one_torch_thread(self.lm.device):
            self._judge(live, rows, logits, hidden, results)
        # After the verdicts' readback, which waited for the forward on a GPU.
        forward_ns = clock.elapsed_ns()
        timing.forward_ns += forward_ns
        timing.phases.append(("forward", clock.start_ns, clock.start_ns + forward_ns))
        timing.phases.append(("rejection_sampling", clock.start_ns + forward_ns, time.time_ns()))
        return results, timing

    def _judge(
        self,
        live: list[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]],
        rows: list[Row],
        logits: list[torch.Tensor],
        hidden: list[torch.Tensor],
        results: list[VerifyResult],
    ) -> None:
        """The round's verdicts from the target's logits, committed into `results`."""
        # Penalties, bias and the grammar's mask shape p; the logprobs below stay the raw model's.
        adjusted = [
            state.penalized(rows, task.draft_tokens) for rows, (_, state, task, _) in zip(logits, live, strict=True)
        ]
        consumed = self._grammar_masks(live, adjusted, results)
        # The target's own token at every row of the greedy and seeded sequences, each kind in
        # one pass read back once; p itself only for the unseeded sampled ones.
        own = self._greedy_tokens(live, adjusted)
        sampled = [n for n, (_, state, _, _) in enumerate(live) if not state.params.greedy]
        dists: dict[int, torch.Tensor] = {}
        if sampled:
            params = [live[n][1].params for n in sampled for _ in range(len(live[n][2].draft_tokens) + 1)]
            probs = probabilities(torch.cat([adjusted[n] for n in sampled]), params)
            dists = _by_block(probs, {n: adjusted[n].shape[0] for n in sampled})
            own.update(self._coupled_tokens(live, dists))
        drawn = self._drawn_verdicts(live, dists, own, results)
        self._commit_verdicts(live, logits, hidden, rows, adjusted, dists, own, drawn, consumed, results)

    def _admit(
        self, tasks: Sequence[VerifyTask], results: list[VerifyResult]
    ) -> tuple[
        list[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]],
        list[Row],
        list[tuple[int, SequenceState, int]],
    ]:
        """Validate each task: the sequences to verify (with their rows), the prefill chunks; errors in results."""
        live: list[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]] = []
        rows: list[Row] = []
        seen: set[str] = set()
        prefills: list[tuple[int, SequenceState, int]] = []
        for i, task in enumerate(tasks):
            try:
                if task.sequence_id in seen:
                    raise invalid(f"sequence {task.sequence_id!r} appears twice in one round")
                seen.add(task.sequence_id)
                state = self.table.get(task.sequence_id)
                if task.prefill_tokens > 0:
                    self._validate_prefill(state, task)
                    prefills.append((i, state, task.prefill_tokens))
                    continue
                self._validate(state, task)
            except EngineError as exc:
                results[i].error = exc
                continue
            rows.append(verify_row(state, task))
            live.append((i, state, task, None))
        return live, rows, prefills

    def _prefill_chunks(
        self, prefills: list[tuple[int, SequenceState, int]], results: list[VerifyResult], timing: RoundTiming
    ) -> None:
        # Chunks of prompts on their own forward: in the verify's, every row would pad to a chunk's length.
        timing.tokens_fed += sum(min(n, self.table.pending(state)) for _, state, n in prefills)
        start = time.time_ns()
        self.table.prefill([(state, n) for _, state, n in prefills])
        end = time.time_ns()
        timing.forward_ns += end - start
        timing.phases.append(("prefill", start, end))
        for i, state, _ in prefills:
            results[i].prefill_pending = self.table.pending(state)

    @staticmethod
    def _grammar_masks(
        live: _Live,
        adjusted: list[torch.Tensor],
        results: list[VerifyResult],
    ) -> dict[str, int]:
        """Mask each constrained sequence's rows in place; the drafts each grammar consumed doing so."""
        # Drafts each grammar consumed while masking its rows, settled after the verdict.
        consumed: dict[str, int] = {}
        for n, (i, state, task, _) in enumerate(live):
            if state.grammar is None:
                continue
            try:
                allowed, consumed[task.sequence_id] = state.grammar.masks_along(task.draft_tokens)
                adjusted[n] = apply_mask(adjusted[n], allowed)
            except Exception as exc:
                results[i].error = EngineError(ErrorKind.INTERNAL, f"grammar failed: {exc}")
                # Its rows stay in the pass, unconstrained, and its verdict is dropped below;
                # the sequence has failed, so a grammar that cannot even roll back is left as is.
                with contextlib.suppress(Exception):
                    state.grammar.pop(consumed.pop(task.sequence_id, 0))
        return consumed

    def _commit_verdicts(
        self,
        live: _Live,
        logits: Sequence[torch.Tensor],
        hidden: Sequence[torch.Tensor],
        rows: list[Row],
        adjusted: list[torch.Tensor],
        dists: dict[int, torch.Tensor],
        own: dict[int, list[int]],
        drawn: dict[int, Verdict],
        consumed: dict[str, int],
        results: list[VerifyResult],
    ) -> None:
        """Each sequence's verdict: commit its accepted drafts and next token, or record why it failed."""
        for n, ((i, state, task, _), raw) in enumerate(zip(live, logits, strict=True)):
            if results[i].error is not None:
                continue
            try:
                # Greedy or seeded: the target's own token at each row decides (its argmax, or its
                # noisy argmax), whatever the drafter sent along; unseeded sampled: the rejection rule.
                verdict = _coupled(own[n], task) if n in own else drawn[n]
                if state.grammar is not None:
                    # The grammar follows the committed tokens exactly: the accepted drafts
                    # stay consumed, the rejected ones are rolled back, the next token goes on.
                    state.grammar.commit(consumed[task.sequence_id], verdict.num_accepted, verdict.next_token)
            except GrammarError as exc:
                # A token its own mask refused (seen once, on CUDA only): what its row held, to tell how.
                why = _refused(adjusted[n], raw, dists.get(n), verdict)
                results[i].error = EngineError(ErrorKind.INTERNAL, f"rejection sampling failed: {exc} ({why})")
                continue
            except Exception as exc:  # one sequence's failure must not corrupt the others
                results[i].error = EngineError(ErrorKind.INTERNAL, f"rejection sampling failed: {exc}")
                continue
            path = verdict.path if isinstance(verdict, TreeVerdict) else range(verdict.num_accepted)
            states = hidden[n] if task.return_hidden else None
            commit_path(self.lm, state, task, rows[n], path, verdict.next_token, raw, states, results[i])

    @staticmethod
    def _drawn_verdicts(
        live: Sequence[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]],
        dists: dict[int, torch.Tensor],
        own: dict[int, list[int]],
        results: list[VerifyResult],
    ) -> dict[int, Verdict | TreeVerdict]:
        """The rejection rule's verdict for every unseeded sampled sequence (by index into `live`):
        each drawn from its own generator, a chain's all read back at once. A sequence whose
        verdict cannot be drawn gets its error instead."""
        unseeded = [n for n in dists if n not in own]
        out: dict[int, Verdict | TreeVerdict] = dict(
            _tree_verdicts(live, [n for n in unseeded if live[n][2].draft_parents], dists, results)
        )
        drawn = [n for n in unseeded if not live[n][2].draft_parents]
        if not drawn:
            return out
        device = dists[drawn[0]].device
        # Every block's drafts copied to the device at once, not once per sequence.
        drafts = torch.tensor(
            [t for n in drawn for t in live[n][2].draft_tokens], dtype=torch.long, device=device
        ).split([len(live[n][2].draft_tokens) for n in drawn])
        verdicts: dict[int, torch.Tensor] = {}
        for n, ids in zip(drawn, drafts, strict=True):
            i, state, _, q = live[n]
            try:
                verdicts[n] = deferred_verdict(dists[n], ids, q, state.generator)
            except Exception as exc:  # one sequence's failure must not corrupt the others
                results[i].error = EngineError(ErrorKind.INTERNAL, f"rejection sampling failed: {exc}")
        if not verdicts:
            return out
        read = read_back(torch.stack(list(verdicts.values())))
        return out | {n: Verdict(num, token) for n, (num, token) in zip(verdicts, read, strict=True)}

    @staticmethod
    def _greedy_tokens(
        live: Sequence[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]], adjusted: Sequence[torch.Tensor]
    ) -> dict[int, list[int]]:
        """The target's argmax at each row of every greedy sequence (ties: the lowest id, as
        `probabilities`' one-hot rows), by index into `live`: one argmax, one read back."""
        greedy = [n for n, (_, state, _, _) in enumerate(live) if state.params.greedy]
        if not greedy:
            return {}
        # Argmax per block, not of their concatenation: no copy of every row's logits.
        tokens = read_back(torch.cat([greedy_tokens(adjusted[n]) for n in greedy]))
        return _by_block(tokens, {n: adjusted[n].shape[0] for n in greedy})

    @staticmethod
    def _coupled_tokens(
        live: Sequence[tuple[int, SequenceState, VerifyTask, torch.Tensor | None]], dists: dict[int, torch.Tensor]
    ) -> dict[int, list[int]]:
        """The target's token at each row of every seeded sequence, all rows in one pass, by
        index into `live`; `dists`: p of each sampled sequence's rows.

        Row j of a sequence with n committed tokens decides token n + j, so its
        noise is keyed by that position: the same however the tokens are split
        into rounds, which is what makes a seed reproduce across k.
        """
        seeded = [n for n in dists if live[n][1].params.seeded]
        if not seeded:
            return {}
        spans = []
        for n in seeded:
            state = live[n][1]
            assert state.params.seed is not None
            # A tree's rows decide tokens at their depths, not their indices.
            spans.extend(noise_spans(state.params.seed, len(state.committed), live[n][2]))
        keys = spans_keys(spans, dists[seeded[0]].device)
        tokens = read_back(gumbel_argmax(torch.cat([dists[n] for n in seeded]), keys))
        return _by_block(tokens, {n: dists[n].shape[0] for n in seeded})

    def kv_bytes(self) -> int:
        return self.table.kv_bytes()


def check_sparse(dist: SparseDist, vocab_size: int) -> None:
    if len(dist.token_ids) != len(dist.probs):
        raise invalid(f"sparse distribution has {len(dist.token_ids)} ids but {len(dist.probs)} probabilities")
    if len(set(dist.token_ids)) != len(dist.token_ids):
        raise invalid("sparse distribution repeats a token id")
    for t in dist.token_ids:
        if not 0 <= t < vocab_size:
            raise invalid(f"sparse distribution: token id {t} is outside the vocabulary [0, {vocab_size})")
    for p in dist.probs:
        if not 0.0 < p <= 1.0:
            raise invalid(f"sparse distribution: probability {p} is not in (0, 1]")
    # The rule is exact only if q is the distribution the draft was sampled from.
    if abs(sum(dist.probs) - 1.0) > PROB_SUM_TOLERANCE:
        raise invalid(f"sparse distribution sums to {sum(dist.probs):.6f}, not 1")


def _coupled(target_tokens: list[int], task: VerifyTask) -> Verdict | TreeVerdict:
    """The verdict of a greedy or seeded sequence from the target's own token at each row."""
    if task.draft_parents:
        return coupled_tree_verdict(target_tokens, task.draft_tokens, task.draft_parents)
    return coupled_verdict(target_tokens, task.draft_tokens)


def _tree_verdicts(
    live: _Live, trees: list[int], dists: dict[int, torch.Tensor], results: list[VerifyResult]
) -> dict[int, TreeVerdict]:
    """The multi-candidate rule's verdict for each unseeded sampled tree in `trees` (indices into
    `live`), drawn from its own generator; a sequence whose verdict cannot be drawn gets its error."""
    out: dict[int, TreeVerdict] = {}
    for n in trees:
        i, state, task, q = live[n]
        try:
            out[n] = tree_rejection_sample(dists[n], task.draft_tokens, task.draft_parents, q, state.generator)
        except Exception as exc:  # one sequence's failure must not corrupt the others
            results[i].error = EngineError(ErrorKind.INTERNAL, f"rejection sampling failed: {exc}")
    return out


def _refused(masked: torch.Tensor, raw: torch.Tensor, p: torch.Tensor | None, verdict: Verdict | TreeVerdict) -> str:
    """What the row that chose a token its grammar refused held: the token's masked and raw logit
    (and p where sampled), how many tokens the mask left, and how many raw logits were not finite."""
    row, token = verdict.num_accepted, verdict.next_token
    parts = [
        f"row {row} of {masked.shape[0]}",
        f"masked logit {float(masked[row, token]):.6g}",
        f"raw logit {float(raw[row, token]):.6g}",
        f"{int(torch.isfinite(masked[row]).sum())} tokens allowed",
        f"{int((~torch.isfinite(raw[row])).sum())} raw logits not finite",
        f"masked argmax {int(masked[row].argmax())}",
    ]
    if p is not None:
        parts.append(f"p {float(p[row, token]):.6g}")
    return ", ".join(parts)


def _by_block(rows: T, sizes: dict[int, int]) -> dict[int, T]:
    """Consecutive rows of a batch (a list or a tensor), cut into each sequence's block, in order."""
    out: dict[int, T] = {}
    start = 0
    for n, size in sizes.items():
        out[n] = rows[start : start + size]
        start += size
    return out
