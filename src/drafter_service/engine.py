"""The causal-LM drafter (no gRPC here)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from drafter_service.base import DrafterBase
from drafter_service.constraints import mask_rows, push_token, sync_grammars
from drafter_service.fanout import FanOut, confirmed, settle
from drafter_service.siblings import SiblingNotes, greedy_notes, seeded_notes, wanting
from specd.engine import hidden_states
from specd.engine.errors import EngineError, invalid
from specd.engine.featurehead import FeatureTrack
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.grammar import GrammarCompiler
from specd.engine.host_threads import one_torch_thread
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.sampling import gumbel_argmax, probabilities, spans_keys, sparse_drafts
from specd.engine.sequences import SequenceState, SequenceTable
from specd.engine.slot_cache import to_device
from specd.engine.tasks import DraftProposal, DraftTask, RoundTiming, SequenceSpec, SparseDist


def until_end(tokens: list[int], ends: frozenset[int]) -> list[int]:
    """`tokens` up to the first of `ends`, that one included."""
    for n, token in enumerate(tokens):
        if token in ends:
            return tokens[: n + 1]
    return tokens


def default_branch_slots(max_sequences: int, device: torch.device) -> int:
    """Slots for fan-out branches (drafter_service.fanout) when the operator names none: one a
    sequence on the CPU, whose cache pages are backed only as written; a quarter as many on an
    accelerator, where every slot is reserved up front and a slot for each would double the cache."""
    return max_sequences if device.type == "cpu" else max(1, max_sequences // 4)


class ModelDrafter(DrafterBase):
    """Drafts with a causal LM: one batched forward per draft position."""

    def __init__(
        self,
        lm: BatchedCausalLM,
        fingerprint: TokenizerFingerprint,
        max_sequences: int,
        max_context: int,
        max_draft_tokens: int,
        max_support: int,
        grammars: GrammarCompiler | None = None,
        branch_slots: int = -1,
    ) -> None:
        branch_slots = default_branch_slots(max_sequences, lm.device) if branch_slots < 0 else branch_slots
        table = SequenceTable(
            lm,
            lm.vocab_size,
            max_sequences,
            min(max_context, lm.max_positions),
            lm.device,
            grammars=grammars,
            branch_slots=branch_slots,
        )
        super().__init__(table, fingerprint, max_draft_tokens)
        self.lm = lm
        self.max_support = max_support
        # Whether the forwards keep their head inputs (a fan-out task's q at its assumed block):
        # from the first task that fans out, so a drafter never asked for branches pays nothing.
        self.keeps_inputs = False

    @property
    def feature_size(self) -> int:
        """Width of the target hidden states this drafter reads beside each token; 0: none."""
        return self.lm.feature_size

    def open(self, specs: Sequence[SequenceSpec]) -> tuple[list[EngineError | None], int]:
        errors, forward_ns = self.table.open(specs)
        if self.feature_size:
            for spec, error in zip(specs, errors, strict=True):
                if error is None:
                    state = self.table.get(spec.sequence_id)
                    state.features = FeatureTrack(state.prompt_len)
        return errors, forward_ns

    @staticmethod
    def _roll_back(state: SequenceState, context: list[int]) -> None:
        """Keep the cached prefix that the context (committed + assumed tokens) confirms; drop the rest.

        A feature drafter also drops what it fed without the real feature, once that feature is here."""
        n = confirmed(state.cached, context)
        if state.features is not None:
            n = state.features.keep(n, len(state.cached))
        del state.cached[n:]

    def _decode_features(self, task: DraftTask, committed: int) -> torch.Tensor | None:
        if not task.hidden_states:
            return None
        if not self.feature_size:
            return super()._decode_features(task, committed)
        try:
            rows = hidden_states.decode(task.hidden_states, self.feature_size)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        # The verifier has fed every committed token but the last.
        if task.hidden_start + rows.shape[0] > committed - 1:
            raise invalid(
                f"hidden states for positions {task.hidden_start}..{task.hidden_start + rows.shape[0] - 1}, "
                f"but only positions before {committed - 1} have been verified"
            )
        return rows

    def _row(self, state: SequenceState, tokens: list[int], logits_from: int) -> Row:
        start = len(state.cached)
        if state.features is None:
            return Row(state.slot, start, tokens, logits_from)
        features, _ = state.features.features(start, len(tokens))
        return Row(state.slot, start, tokens, logits_from, features)

    def _forward(self, active: Sequence[tuple[int, SequenceState, int]], rows: list[Row]) -> list[torch.Tensor]:
        """One drafting step's forward; a feature drafter keeps each row's predicted hidden state and
        notes which fed positions had their real feature."""
        if not self.feature_size:
            inputs: list[torch.Tensor] | None = [] if self.keeps_inputs else None
            logits = self.lm.forward(rows, inputs=inputs)
            note_inputs([state for _, state, _ in active], rows, inputs)
            return logits
        logits, hidden = self.lm.forward_hidden(rows)
        for (_, state, _), row, h in zip(active, rows, hidden, strict=True):
            assert state.features is not None
            end = row.start + len(row.tokens)
            state.features.predicted[end - 1] = h[-1].detach().to(torch.bfloat16)
            # Without building the features again: the prediction just kept is for the next position.
            right = state.features.right_count(row.start, len(row.tokens))
            state.features.fed(row.start, len(row.tokens), right)
        return logits

    def draft(self, tasks: Sequence[DraftTask]) -> tuple[list[DraftProposal], RoundTiming]:
        proposals, live = self._accept_tasks(tasks)
        active = [(i, s, k) for i, s, k, _ in live if k > 0]
        contexts = {i: context for i, _, _, context in live}
        timing = RoundTiming(batch_size=len(active))
        start = time.time_ns()
        for _, state, _, context in live:
            settle(self.table, state, context)
        # A drafter reading hidden states has none for a branch's positions: it proposes none.
        fan = FanOut(tasks, active, self.table, enabled=not self.feature_size)
        self.keeps_inputs = self.keeps_inputs or bool(fan)
        for i, state, _, context in live:
            self._roll_back(state, context)
            if self.keeps_inputs:
                state.head_inputs.follow(context, len(state.committed) - 1)
            fan.reuse(i, state, context)
        # Constrained sequences: the grammar follows committed + assumed tokens, then each draft.
        constrained = sync_grammars(active, contexts)
        timing.phases.append(("rollback", start, time.time_ns()))
        forward_ns = self._prefill_chunks(tasks, live, proposals, timing)
        # Step 0 feeds every committed token not yet cached (1 after a rejection,
        # 2 when all drafts were accepted, more after a target-only stretch);
        # later steps feed the token just drafted.
        feed = {i: contexts[i][len(state.cached) :] for i, state, _ in active}
        notes = SiblingNotes(tasks)
        if active and self._drafts_stay_on_device(active, constrained):
            forward_ns += self._draft_on_device(active, contexts, feed, proposals, timing, notes, fan)
        else:
            forward_ns += self._draft_stepwise(
                tasks, active, contexts, feed, proposals, constrained, timing, notes, fan
            )
        fan.finish(proposals)
        if self.keeps_inputs:
            for i, state, _ in active:
                state.head_inputs.tokens.extend(proposals[i].tokens)
        timing.forward_ns = forward_ns
        if notes.wanted:
            notes.attach(tasks, proposals, {i: state for i, state, _ in active})
        return proposals, timing

    def _draft_stepwise(
        self,
        tasks: Sequence[DraftTask],
        active: list[tuple[int, SequenceState, int]],
        contexts: dict[int, list[int]],
        feed: dict[int, list[int]],
        proposals: list[DraftProposal],
        constrained: set[int],
        timing: RoundTiming,
        notes: SiblingNotes,
        fan: FanOut,
    ) -> int:
        """Draft with the tokens read back after every step (what sampling, grammars, penalties
        and a feature drafter need); returns the forward time."""
        forward_ns = 0
        step = 0
        while active:
            rows = [self._row(s, feed[i], len(feed[i]) - 1 - fan.extra(i, step)) for i, s, _ in active]
            timing.tokens_fed += sum(len(r.tokens) for r in rows)
            start = time.time_ns()
            raw = self._forward(active, rows)
            if step == 0 and fan:
                raw = fan.keep(active, raw)
            # What it drafted so far this round counts as output, as the verifier will count it.
            logits = [
                s.penalized(x, drafted=[*contexts[i][len(s.committed) :], *proposals[i].tokens])
                for (i, s, _), x in zip(active, raw, strict=True)
            ]
            ended = mask_rows(active, logits, constrained)
            with one_torch_thread(self.lm.device) if notes.wanted else contextlib.nullcontext():
                chosen, dists = self._greedy_and_q(active, logits, step, notes)
            end = time.time_ns()
            forward_ns += end - start
            timing.phases.append(("step", start, end))
            positions = [len(contexts[i]) + step for i, _, _ in active]
            chosen.update(self._coupled_tokens(active, dists, positions, step, notes))
            picked = self._pick(active, {r: q for r, q in dists.items() if r not in chosen})
            for r, (token, dist) in picked.items():
                if active[r][0] in notes.wanted:
                    notes.add_sampled(active[r][0], step, token, dist)
            active = self._take(tasks, active, step, chosen, picked, ended, proposals, feed, constrained)
            if step == 0 and fan:
                guesses = to_device([proposals[i].tokens[0] for i in fan.rows], self.lm.device)
                active += fan.start(guesses, proposals, contexts, feed, self.max_support)
            step += 1
        return forward_ns

    @staticmethod
    def _greedy_and_q(
        active: Sequence[tuple[int, SequenceState, int]], logits: list[torch.Tensor], step: int, notes: SiblingNotes
    ) -> tuple[dict[int, int], dict[int, torch.Tensor]]:
        """The greedy rows' tokens (only their argmax, one read back for all, the siblings' notes
        with it) and the other rows' q, each keyed by row."""
        greedy = [r for r, (_, s, _) in enumerate(active) if s.params.greedy]
        chosen: dict[int, int] = {}
        if greedy:
            best = torch.cat([logits[r].argmax(dim=-1) for r in greedy])
            want = wanting(notes, active, greedy)
            if want:
                keys = [(active[greedy[n]][0], step) for n in want]
                rows = torch.cat([logits[greedy[n]] for n in want])
                notes.add_device(keys, greedy_notes(rows, best.index_select(0, to_device(want, best.device))))
            chosen = dict(zip(greedy, notes.read_with(best), strict=True))
        sampled = [r for r, (_, s, _) in enumerate(active) if not s.params.greedy]
        dists: dict[int, torch.Tensor] = {}
        if sampled:
            probs = probabilities(torch.cat([logits[r] for r in sampled]), [active[r][1].params for r in sampled])
            dists = dict(zip(sampled, probs, strict=True))
        return chosen, dists

    def _prefill_chunks(
        self,
        tasks: Sequence[DraftTask],
        live: Sequence[tuple[int, SequenceState, int, list[int]]],
        proposals: list[DraftProposal],
        timing: RoundTiming,
    ) -> int:
        """Prefill the prompts' chunks the tasks ask for; the forward nanoseconds it took."""
        prefills = [(i, state, tasks[i].prefill_tokens) for i, state, _, _ in live if tasks[i].prefill_tokens > 0]
        if not prefills:
            return 0
        # Chunks of prompts on their own forward, before the draft steps (which would pad to them).
        tokens = sum(min(n, self.table.pending(state)) for _, state, n in prefills)
        static = self.lm.static
        missed = static.missed if static is not None else 0
        start = time.time_ns()
        self.table.prefill([(state, n) for _, state, n in prefills])
        end = time.time_ns()
        attributes: dict[str, int | bool] = {"specd.prefill_tokens": tokens}
        if static is not None:
            # Whether every forward replayed a captured bucket: an eager one may meet a new shape.
            attributes["specd.prefill_graphed"] = static.missed == missed
        timing.phase_attributes[len(timing.phases)] = attributes
        timing.phases.append(("prefill", start, end))
        for i, state, _ in prefills:
            proposals[i].prefill_pending = self.table.pending(state)
        return end - start

    def _take(
        self,
        tasks: Sequence[DraftTask],
        active: list[tuple[int, SequenceState, int]],
        step: int,
        chosen: dict[int, int],
        picked: dict[int, tuple[int, SparseDist]],
        ended: set[int],
        proposals: list[DraftProposal],
        feed: dict[int, list[int]],
        constrained: set[int],
    ) -> list[tuple[int, SequenceState, int]]:
        """Append this step's token to each active row's proposal; the rows that draft on."""
        still = []
        for row_i, (i, state, k) in enumerate(active):
            state.cached.extend(feed[i])
            dist: SparseDist | None = None
            if row_i in chosen:
                token = chosen[row_i]
            else:
                token, dist = picked[row_i]
                if step == 0 and tasks[i].guess_first:
                    # A guess at the verifier's token is right with the target's probability of
                    # it: the likeliest under q is the best guess, a sample from q a worse one.
                    token = dist.token_ids[max(range(len(dist.probs)), key=dist.probs.__getitem__)]
            if row_i in ended:
                continue  # its grammar allows nothing more (or failed): the block ends here
            proposals[i].tokens.append(token)
            if dist is not None:
                proposals[i].dists.append(dist)
            feed[i] = [token]
            if i in constrained and not push_token(state, token):
                constrained.discard(i)
                continue
            if token in state.ends or (i in constrained and state.grammar is not None and state.grammar.ended):
                continue  # it drafted one of the target's end ids: nothing can follow
            if step + 1 < k:
                still.append((i, state, k))
        return still

    def _drafts_stay_on_device(self, active: Sequence[tuple[int, SequenceState, int]], constrained: set[int]) -> bool:
        """Whether nothing reads this round's drafts on the host before the last step: greedy
        rows without a grammar or penalties, and a drafter that keeps no per-step state."""
        if self.feature_size or constrained:
            return False
        return all(s.params.greedy and not s.penalties.active for _, s, _ in active)

    def _draft_on_device(
        self,
        active: Sequence[tuple[int, SequenceState, int]],
        contexts: dict[int, list[int]],
        feed: dict[int, list[int]],
        proposals: list[DraftProposal],
        timing: RoundTiming,
        notes: SiblingNotes,
        fan: FanOut,
    ) -> int:
        """Draft greedily with each step fed the previous step's choices where they were made (on
        a GPU, no wait for the device between steps), and read every draft back once at the end
        (the siblings' notes with them; fan-out branches are chosen from a read after step 0).
        Returns the forward time."""
        forward_ns = 0
        active = list(active)
        rows = [self._row(state, feed[i], len(feed[i]) - 1 - fan.extra(i, 0)) for i, state, _ in active]
        starts: list[int] = []
        for i, state, _ in active:
            state.cached.extend(feed[i])
            starts.append(len(state.cached))
        drafting = list(range(len(active)))  # rows (indices into `active`) still drafting
        chosen: list[torch.Tensor] = []  # per step, the drafts of the rows drafting in it
        members: list[list[int]] = []
        ids: torch.Tensor | None = None
        step = 0
        while drafting:
            if ids is not None:
                # Step s feeds the draft of step s - 1, after the s - 1 drafts before it.
                rows = [Row(active[r][1].slot, starts[r] + step - 1, [0], 0) for r in drafting]
            timing.tokens_fed += sum(len(r.tokens) for r in rows)
            start = time.time_ns()
            tokens = self._device_step(active, drafting, rows, ids, step, notes, fan)
            chosen.append(tokens)
            members.append(drafting)
            if step == 0 and fan:
                drafting, tokens = self._join(fan, active, starts, tokens, proposals, contexts, feed)
            still = [n for n, r in enumerate(drafting) if active[r][2] > step + 1]
            drafting = [drafting[n] for n in still]
            if drafting:
                ids = tokens.index_select(0, to_device(still, tokens.device))
            else:
                values = notes.read_with(torch.cat(chosen))  # the round's one read back
            end = time.time_ns()
            forward_ns += end - start
            timing.phases.append(("step", start, end))
            step += 1
        drafts: list[list[int]] = [[] for _ in active]
        offset = 0
        for rows_in_step in members:
            for r in rows_in_step:
                drafts[r].append(values[offset])
                offset += 1
        for (i, state, _), tokens_of_row in zip(active, drafts, strict=True):
            # Drafted past an end on the device, where no step waits to look; the target stops there.
            proposals[i].tokens[:] = until_end([*proposals[i].tokens, *tokens_of_row], state.ends)
            state.cached.extend(tokens_of_row[:-1])  # fed in the steps after their own
        return forward_ns

    def _join(
        self,
        fan: FanOut,
        active: list[tuple[int, SequenceState, int]],
        starts: list[int],
        tokens: torch.Tensor,
        proposals: list[DraftProposal],
        contexts: dict[int, list[int]],
        feed: dict[int, list[int]],
    ) -> tuple[list[int], torch.Tensor]:
        """After the first on-device step (every row drafting, `tokens` its choices): the fan-out
        rows' branches join `active`, their guesses to be fed next. Returns the rows drafting
        and their step's tokens, the branches' guesses last."""
        drafting = list(range(len(active)))
        joined = fan.start(
            tokens.index_select(0, to_device(fan.at, tokens.device)), proposals, contexts, feed, self.max_support
        )
        for b, state, _ in joined:
            starts.append(len(state.cached))  # where its guess goes, fed by the next step
            state.cached.extend(feed[b])
        active.extend(joined)
        guesses = to_device([feed[b][0] for b, _, _ in joined], tokens.device)
        return [*drafting, *range(len(drafting), len(active))], torch.cat([tokens, guesses])

    def _device_step(
        self,
        active: Sequence[tuple[int, SequenceState, int]],
        drafting: list[int],
        rows: list[Row],
        ids: torch.Tensor | None,
        step: int,
        notes: SiblingNotes,
        fan: FanOut,
    ) -> torch.Tensor:
        """One on-device step's argmax of each drafting row; where some want siblings, from the
        whole logits (`forward`'s argmax, as the step-by-step loop takes it), noting theirs; the
        first step gives the fan-out rows their q (`FanOut.keep`)."""
        want = wanting(notes, active, drafting)
        wide = step == 0 and bool(fan)
        inputs: list[torch.Tensor] | None = [] if self.keeps_inputs else None
        states = [active[r][1] for r in drafting]
        if not want and not wide:
            best = self.lm.forward_argmax(rows, ids, inputs=inputs)
            note_inputs(states, rows, inputs)
            return best
        logits = self.lm.forward(rows, ids, inputs=inputs)
        note_inputs(states, rows, inputs)
        if wide:
            logits = fan.keep(active, logits)
        with one_torch_thread(self.lm.device):
            whole = torch.cat(logits)
            tokens = whole.argmax(dim=-1)
            if want:
                at = to_device(want, tokens.device)
                notes.add_device(
                    [(active[drafting[n]][0], step) for n in want],
                    greedy_notes(whole.index_select(0, at), tokens.index_select(0, at)),
                )
        return tokens

    @staticmethod
    def _coupled_tokens(
        active: Sequence[tuple[int, SequenceState, int]],
        dists: dict[int, torch.Tensor],
        positions: Sequence[int],
        step: int,
        notes: SiblingNotes,
    ) -> dict[int, int]:
        """Draft tokens of the seeded rows: argmax(log q + g) with the noise the verifier
        will use at the same position, so a draft is accepted whenever the draft
        model's noisy argmax agrees with the target's. `dists`: q of each sampled row;
        keyed by row. The siblings' notes are read back with the tokens."""
        rows = [r for r in dists if active[r][1].params.seeded]
        if not rows:
            return {}
        spans = []
        for r in rows:
            state = active[r][1]
            assert state.params.seed is not None
            # Drafting step s proposes the token at position len(committed + assumed) + s.
            spans.append((state.params.seed, positions[r], 1))
        keys = spans_keys(spans, dists[rows[0]].device)
        q = torch.stack([dists[r] for r in rows])
        best = gumbel_argmax(q, keys)
        want = wanting(notes, active, rows)
        if want:
            at = to_device(want, best.device)
            noted = seeded_notes(q.index_select(0, at), keys.index_select(0, at), best.index_select(0, at))
            notes.add_device([(active[rows[n]][0], step) for n in want], noted)
        return dict(zip(rows, notes.read_with(best), strict=True))

    def _pick(
        self, active: Sequence[tuple[int, SequenceState, int]], dists: dict[int, torch.Tensor]
    ) -> dict[int, tuple[int, SparseDist]]:
        """Draft tokens of the unseeded sampled rows (`dists`: their q, keyed by row), with the
        sparse q each was drawn from: a sample from the truncated q with this service's own
        generator of the sequence, never one the verifier also draws from; read back once for
        all the rows."""
        if not dists:
            return {}
        rows = list(dists)
        generators = []
        for r in rows:
            generator = active[r][1].generator
            assert generator is not None
            generators.append(generator)
        drawn = sparse_drafts(torch.stack([dists[r] for r in rows]), self.max_support, generators)
        return {r: (token, SparseDist(ids, probs)) for r, (token, ids, probs) in zip(rows, drawn, strict=True)}


def note_inputs(states: Sequence[SequenceState], rows: Sequence[Row], inputs: Sequence[torch.Tensor] | None) -> None:
    """Keep each row's head inputs of the positions it wanted logits of (a fan-out task's q), if any."""
    if inputs is None:
        return
    for state, row, x in zip(states, rows, inputs, strict=True):
        state.head_inputs.note(row.start + row.logits_from, x)
