"""Fan-out draft-ahead (DraftTask.num_branches): blocks drafted after other likely verdicts.

Expected guesses and their order come from a plain forward of the draft model; expected drafts
after a guess from a drafter that drafts plainly after that prefix, on a sequence of its own.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest
import torch
from test_leases import Context

from drafter_service import fanout
from drafter_service.engine import ModelDrafter
from drafter_service.servicer import DrafterServicer
from specd.engine import noise
from specd.engine.errors import ErrorKind
from specd.engine.grammar import choice_grammar
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import Penalties, SamplingParams
from specd.engine.sampling import gumbel_argmax, gumbel_top, probabilities
from specd.engine.sequences import BranchCache, SequenceTable
from specd.engine.tasks import DraftProposal, DraftTask, SequenceSpec
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner
from specd.rpc.tracing import Tracing

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=5)
UNSEEDED = SamplingParams(temperature=1.3)
PROMPT = [11, 22, 33, 44, 55, 11, 22]
K = 4  # tokens a block drafts: the guess, then K - 1 drafts


@pytest.fixture
def make_drafter(make_drafter):
    """The engines' drafter with a branch slot for each sequence on every device (a GPU's default
    is a quarter as many): the branch counts asserted here are the tasks' own."""

    def make(**kwargs) -> ModelDrafter:
        return make_drafter(branch_slots=kwargs.get("max_sequences", 8), **kwargs)

    return make


def open_ok(drafter: ModelDrafter, *specs: SequenceSpec) -> None:
    errors, _ = drafter.open(list(specs))
    assert errors == [None] * len(specs)


def ahead(sid: str, assumed: tuple[int, ...], branches: int, new: Sequence[int] = (), committed: int = 0) -> DraftTask:
    return DraftTask(sid, list(new), committed or len(PROMPT), K, assumed, guess_first=True, num_branches=branches)


def assumed_logits(model, prompt: list[int], assumed: tuple[int, ...]) -> torch.Tensor:
    """The draft model's logits [k + 1, V] after the last prompt token and each assumed one."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + list(assumed)])).logits[0].float()
    return out[len(prompt) - 1 :]


def expected_verdicts(
    q: torch.Tensor, assumed: tuple[int, ...], main_guess: int, pick, m: int
) -> list[tuple[float, int, int]]:
    """(log likelihood, num_assumed, guess) of the m likeliest other verdicts, likeliest first (ties:
    smaller num_assumed, then the better guess); `pick(j, refused, m)` is the m best guesses at
    position j other than `refused`, best first."""
    out = []
    before = 0.0
    for j in range(len(assumed) + 1):
        refused = assumed[j] if j < len(assumed) else main_guess
        for rank, guess in enumerate(pick(j, refused, m)):
            score = before + math.log(float(q[j, guess]))
            if score > -math.inf:
                out.append((score, j, rank, guess))
        if j < len(assumed):
            before += math.log(float(q[j, assumed[j]]))
    return [(score, j, guess) for score, j, _, guess in sorted(out, key=lambda v: (-v[0], v[1], v[2]))[:m]]


def greedy_pick(logits: torch.Tensor):
    def pick(j: int, refused: int, m: int) -> list[int]:
        others = logits[j].clone()
        others[refused] = float("-inf")
        return others.topk(m).indices.tolist()

    return pick


def plain_drafts(drafter: ModelDrafter, sid: str, prompt: list[int], spec: SamplingParams, n: int) -> list[int]:
    """What the drafter drafts after `prompt` on a fresh sequence (no guess, no branches)."""
    open_ok(drafter, SequenceSpec(sid, prompt, spec))
    (proposal,), _ = drafter.draft([DraftTask(sid, [], len(prompt), n)])
    assert proposal.error is None
    return proposal.tokens


def stepwise(drafter: ModelDrafter, monkeypatch, on_device: bool) -> ModelDrafter:
    if not on_device:
        monkeypatch.setattr(drafter, "_drafts_stay_on_device", lambda *_: False)
    return drafter


@pytest.mark.parametrize("on_device", [True, False])
def test_greedy_branches_draft_after_the_likeliest_other_verdicts(make_drafter, tiny_draft, monkeypatch, on_device):
    drafter = stepwise(make_drafter(), monkeypatch, on_device)
    reference = make_drafter(max_sequences=16)
    own = tuple(plain_drafts(reference, "own", PROMPT, GREEDY, 3))  # as a real block: the drafter's own
    cases = {"own": own, "odd": (7, 300, 9)}
    wanted = {"own": 3, "odd": 5}  # the drafter's 8 branch slots
    open_ok(drafter, *(SequenceSpec(sid, PROMPT, GREEDY) for sid in ("own", "odd", "plain")))
    proposals, timing = drafter.draft([ahead("own", own, 3), ahead("odd", cases["odd"], 5), ahead("plain", own, 0)])
    assert all(p.error is None for p in proposals)
    assert proposals[0].tokens == proposals[2].tokens and proposals[2].branches == []
    assert timing.batch_size == 3
    for proposal in proposals[:2]:
        assumed = cases[proposal.sequence_id]
        logits = assumed_logits(tiny_draft, PROMPT, assumed)
        assert proposal.tokens[0] == int(logits[-1].argmax())  # the main guess, as without branches
        m = wanted[proposal.sequence_id]
        want = expected_verdicts(logits.softmax(-1), assumed, proposal.tokens[0], greedy_pick(logits), m)
        assert len(want) == m
        assert [(b.num_assumed, b.tokens[0]) for b in proposal.branches] == [(j, g) for _, j, g in want]
        for n, branch in enumerate(proposal.branches):
            prefix = [*PROMPT, *assumed[: branch.num_assumed], branch.tokens[0]]
            drafts = plain_drafts(reference, f"{proposal.sequence_id}{n}", prefix, GREEDY, K - 1)
            assert branch.tokens[1:] == drafts and branch.dists == []


def ranked_alternatives(logits: torch.Tensor, assumed: tuple[int, ...], m: int) -> list[tuple[int, int]]:
    """(num_assumed, guess) of the m verdicts fanout ranks first, for a greedy sequence whose
    logits at the last committed token and each assumed one are `logits`."""
    table = SequenceTable(None, logits.shape[-1], 1, 64, torch.device("cpu"))
    assert table.open([SequenceSpec("a", PROMPT, GREEDY)])[0] == [None]
    main = logits[-1].argmax()
    out = fanout.alternatives(logits, torch.tensor(assumed), main, table.get("a"), 0, m)
    verdicts = fanout._parse(out.flatten().tolist(), len(assumed) + 1, m, 0)
    return [(j, verdicts.alts[j][r]) for j, r in verdicts.ranked()[:m]]


def test_the_likeliest_verdicts_of_all_positions_several_guesses_each():
    logits = 2 * torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    assumed = (5, 6, 7)
    for j, token in enumerate(assumed):
        logits[j, token] += 7.0
    got = ranked_alternatives(logits, assumed, 6)
    want = expected_verdicts(logits.softmax(-1), assumed, int(logits[-1].argmax()), greedy_pick(logits), 6)
    assert got == [(j, g) for _, j, g in want]
    positions = [j for j, _ in got]
    assert len(set(positions)) > 1 and len(set(positions)) < len(positions)  # across positions, some shared


def test_the_bonus_branches_are_the_next_likeliest_guesses():
    """Assumed tokens q is sure of: the likeliest verdicts accept them all, then guess again."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(4))
    assumed = (5, 6, 7)
    for j, token in enumerate(assumed):
        logits[j, token] += 30.0
    ranked = logits[-1].topk(4).indices.tolist()
    assert ranked_alternatives(logits, assumed, 3) == [(3, t) for t in ranked[1:]]


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("verdict", ["main", 0, 1, 2])
def test_the_next_task_continues_the_branch_its_tokens_confirm(make_drafter, monkeypatch, on_device, verdict):
    """Committing a branch's verdict, then drafting ahead of its block: the drafts of a drafter that
    never fanned out (the swapped slot's KV is the branch's own); the slots come back."""
    drafter = stepwise(make_drafter(), monkeypatch, on_device)
    reference = make_drafter()
    assumed = tuple(plain_drafts(reference, "own", PROMPT, GREEDY, 3))
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY))
    free = drafter.table.free_slots
    (first,), _ = drafter.draft([ahead("a", assumed, 3)])
    assert len(first.branches) == 3 and drafter.table.free_slots == free - 3
    if verdict == "main":
        committed, block = [*assumed, first.tokens[0]], first.tokens[1:]
    else:
        branch = sorted(first.branches, key=lambda b: -b.num_assumed)[verdict]
        committed, block = [*assumed[: branch.num_assumed], branch.tokens[0]], branch.tokens[1:]
    task = ahead("a", tuple(block), 0, committed, len(PROMPT) + len(committed))
    (second,), timing = drafter.draft([task])
    assert drafter.table.free_slots == free
    # Only the block's last draft is new to the cache: the rest was drafted in the branch's slot.
    assert timing.tokens_fed == 1 + (K - 1)
    open_ok(reference, SequenceSpec("ref", [*PROMPT, *committed], GREEDY))
    (want,), _ = reference.draft([ahead("ref", tuple(block), 0, [], len(PROMPT) + len(committed))])
    assert second.tokens == want.tokens
    (third,), _ = drafter.draft([ahead("a", tuple(second.tokens[:2]), 2, block, len(PROMPT) + len(committed) + 3)])
    assert len(third.branches) == 2 and drafter.table.free_slots == free - 2
    drafter.close(["a"])
    assert drafter.table.free_slots == free + 1 and drafter.table.branches_held == 0


@pytest.mark.parametrize("on_device", [True, False])
def test_without_assumed_tokens_the_branches_are_the_next_guesses(make_drafter, tiny_draft, monkeypatch, on_device):
    """A draft-ahead beside a target-only verify assumes nothing: its other verdicts are other
    bonus tokens, the 2nd and 3rd likeliest for two branches."""
    drafter = stepwise(make_drafter(), monkeypatch, on_device)
    reference = make_drafter()
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY))
    (proposal,), _ = drafter.draft([ahead("a", (), 2)])
    assert proposal.error is None and [b.num_assumed for b in proposal.branches] == [0, 0]
    first, second, third = assumed_logits(tiny_draft, PROMPT, ())[-1].topk(3).indices.tolist()
    assert [proposal.tokens[0], *(b.tokens[0] for b in proposal.branches)] == [first, second, third]
    for n, branch in enumerate(proposal.branches):
        drafts = plain_drafts(reference, f"ref{n}", [*PROMPT, branch.tokens[0]], GREEDY, K - 1)
        assert branch.tokens[1:] == drafts


def fan_out_over(
    drafter: ModelDrafter, spec: SamplingParams, block: tuple[int, ...] | None
) -> tuple[DraftProposal, int, tuple[int, ...]]:
    """Sequence "a" after PROMPT fans out over a 3-token block with 3 branches: `block`, not
    drafted there, or (None) the block it drafts itself first. The proposal, the tokens the task
    fed and the block. A fan-out task of another sequence comes first: a drafter keeps head
    inputs from the first task that asks for branches on."""
    open_ok(drafter, SequenceSpec("a", PROMPT, spec), SequenceSpec("first", PROMPT, spec))
    drafter.draft([ahead("first", (), 1)])
    if block is None:
        (drafted,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 3)])
        block = tuple(drafted.tokens)
    if not spec.greedy and not spec.seeded:
        drafter.table.get("a").generator = torch.Generator(drafter.lm.device).manual_seed(11)
    (proposal,), timing = drafter.draft([ahead("a", block, 3)])
    assert proposal.error is None and len(proposal.branches) == 3
    return proposal, timing.tokens_fed, block


@pytest.mark.parametrize("on_device", [True, False])
@pytest.mark.parametrize("spec", [GREEDY, SEEDED, UNSEEDED], ids=["greedy", "seeded", "unseeded"])
def test_fanning_out_over_its_own_block_feeds_only_what_is_new(make_drafter, monkeypatch, on_device, spec):
    """q at a block's tokens that the drafter drafted itself comes from the head inputs its
    drafts left: step 0 feeds the block's last draft alone, as without branches, where a block
    drafted elsewhere is fed again whole; the verdicts, branches and their q are the same."""
    own, fed, block = fan_out_over(stepwise(make_drafter(), monkeypatch, on_device), spec, None)
    again, fed_again, _ = fan_out_over(stepwise(make_drafter(), monkeypatch, on_device), spec, block)
    # Every later step feeds one token a row: K - 1 for the main row and for each branch (its guess on).
    assert fed == 1 + (K - 1) + 3 * (K - 1)
    assert fed_again == fed + len(block)  # the last committed token and the block, not its last draft
    assert own.tokens == again.tokens
    for mine, theirs in zip(own.branches, again.branches, strict=True):
        assert (mine.num_assumed, mine.tokens) == (theirs.num_assumed, theirs.tokens)
        for a, b in zip(mine.dists, theirs.dists, strict=True):
            assert a.token_ids == b.token_ids and a.probs == pytest.approx(b.probs, abs=1e-5)


def noisy_scores(q: torch.Tensor, j: int) -> torch.Tensor:
    """SEEDED's log q + gumbel noise at position j after PROMPT, over the whole vocabulary."""
    key = torch.tensor(noise.noise_key(5, len(PROMPT) + j))
    return q[j].log() + noise.gumbel(key, torch.arange(q.shape[-1]))


def test_seeded_branch_guesses_are_the_noises_best_others(make_drafter, tiny_draft):
    drafter = make_drafter()
    reference = make_drafter()
    assumed = (7, 300, 9)
    open_ok(drafter, SequenceSpec("s", PROMPT, SEEDED))
    (proposal,), _ = drafter.draft([ahead("s", assumed, 4)])
    q = probabilities(assumed_logits(tiny_draft, PROMPT, assumed), [SEEDED] * (len(assumed) + 1))

    def pick(j: int, refused: int, m: int) -> list[int]:
        s = noisy_scores(q, j)
        s[refused] = float("-inf")
        return s.topk(m).indices.tolist()

    assert proposal.tokens[0] == int(noisy_scores(q, len(assumed)).argmax()) and proposal.dists == []
    want = expected_verdicts(q, assumed, proposal.tokens[0], pick, 4)
    assert [(b.num_assumed, b.tokens[0]) for b in proposal.branches] == [(j, g) for _, j, g in want]
    for n, branch in enumerate(proposal.branches):
        prefix = [*PROMPT, *assumed[: branch.num_assumed], branch.tokens[0]]
        # Coupled at the same positions, so the drafts of a fresh sequence on that prefix.
        assert branch.tokens[1:] == plain_drafts(reference, f"s{n}", prefix, SEEDED, K - 1)
        assert branch.dists == []


def test_two_seeded_guesses_at_a_position_are_the_noises_second_and_third(make_drafter, tiny_draft):
    """No assumed tokens, two branches: both at the bonus position, the noise's 2nd and 3rd best
    (its best is the main guess), likelier under q first."""
    drafter = make_drafter()
    open_ok(drafter, SequenceSpec("s", PROMPT, SEEDED))
    (proposal,), _ = drafter.draft([ahead("s", (), 2)])
    q = probabilities(assumed_logits(tiny_draft, PROMPT, ()), [SEEDED])
    best, second, third = noisy_scores(q, 0).topk(3).indices.tolist()
    assert proposal.tokens[0] == best and [b.num_assumed for b in proposal.branches] == [0, 0]
    guesses = [b.tokens[0] for b in proposal.branches]
    assert sorted(guesses) == sorted([second, third])
    assert q[0, guesses[0]] >= q[0, guesses[1]]


def test_the_noises_best_tokens_are_found_below_the_likeliest(tiny_draft):
    """Where q is peaked, the noise's 2nd and 3rd best lie far below the likeliest token: the
    tokens hashed must reach them, as scoring the whole vocabulary does."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=generator)
    logits[:, 17] += 40.0  # one token near certain
    logits[3, 200] += 20.0
    probs = logits.softmax(-1)
    keys = torch.tensor([noise.noise_key(9, n) for n in range(6)])
    for m in (1, 3, 5):
        full = probs.log() + noise.gumbel(keys[:, None], torch.arange(500))
        assert gumbel_top(probs, keys, m).tolist() == full.topk(m).indices.tolist()
        assert gumbel_top(probs, keys, 1)[:, 0].tolist() == gumbel_argmax(probs, keys).tolist()


def sampled_rounds(drafter: ModelDrafter, branches: int) -> list[DraftProposal]:
    specs = [SequenceSpec(f"u{n}", PROMPT, UNSEEDED) for n in range(2)]
    open_ok(drafter, *specs)
    for n, spec in enumerate(specs):
        drafter.table.get(spec.sequence_id).generator = torch.Generator(drafter.lm.device).manual_seed(70 + n)
    out = []
    for assumed in ((7, 300, 9), (7, 300, 9, 12), (5,)):
        proposals, _ = drafter.draft([ahead(s.sequence_id, assumed, branches) for s in specs])
        out.extend(proposals)
    return out


def test_unseeded_branches_leave_the_main_draws_as_they_were(make_drafter):
    plain = sampled_rounds(make_drafter(max_support=8), 0)
    fanned = sampled_rounds(make_drafter(max_support=8), 3)
    assert [len(p.branches) for p in fanned] == [3] * 6  # one assumed token: two positions, three guesses each
    for without, with_branches in zip(plain, fanned, strict=True):
        assert with_branches.tokens == without.tokens
        for a, b in zip(with_branches.dists, without.dists, strict=True):
            assert a.token_ids == b.token_ids and a.probs == pytest.approx(b.probs, abs=1e-6)
        for branch in with_branches.branches:
            assert len(branch.tokens) == len(branch.dists) == K
            assert all(t in d.token_ids for t, d in zip(branch.tokens, branch.dists, strict=True))
    assert len({tuple(b.tokens[1:]) for p in fanned for b in p.branches}) > 3  # sampled, not fixed


def test_an_unseeded_guess_is_the_likeliest_other_in_its_dist(make_drafter):
    drafter = make_drafter(max_support=8)
    assumed = (7, 300, 9)
    open_ok(drafter, SequenceSpec("u", PROMPT, UNSEEDED))
    (proposal,), _ = drafter.draft([ahead("u", assumed, 4)])
    assert len(proposal.branches) == 4
    for j in {b.num_assumed for b in proposal.branches}:
        at = [b for b in proposal.branches if b.num_assumed == j]  # likeliest first: the best others in order
        refused = assumed[j] if j < len(assumed) else proposal.tokens[0]
        dist = at[0].dists[0]
        assert all(b.dists[0].token_ids == dist.token_ids for b in at)
        others = sorted(((p, t) for p, t in zip(dist.probs, dist.token_ids, strict=True) if t != refused), reverse=True)
        assert [b.tokens[0] for b in at] == [t for _, t in others[: len(at)]]


def test_fewer_branches_when_out_of_slots_and_opens_never_starve(tiny_draft, fingerprint):
    lm = BatchedCausalLM(tiny_draft, torch.device("cpu"), torch.float32)
    drafter = ModelDrafter(lm, fingerprint, 3, 256, 8, 16, branch_slots=2)
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY), SequenceSpec("b", PROMPT, GREEDY))
    proposals, _ = drafter.draft([ahead("a", (7, 300, 9), 3), ahead("b", (7, 300, 9), 3)])
    assert [len(p.branches) for p in proposals] == [2, 0]
    assert all(p.error is None and len(p.tokens) == K for p in proposals)
    open_ok(drafter, SequenceSpec("c", PROMPT, GREEDY))  # the third sequence's slot was never lent
    errors, _ = drafter.open([SequenceSpec("d", PROMPT, GREEDY)])
    assert errors[0] is not None and errors[0].kind == ErrorKind.RESOURCE_EXHAUSTED
    # Any next task of "a" settles its branches, one that drafts nothing too: b's turn.
    (nothing,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 0)])
    assert nothing.error is None and drafter.table.branches_held == 0
    (b,), _ = drafter.draft([ahead("b", (7, 300, 9), 3)])
    assert len(b.branches) == 2
    none = ModelDrafter(
        BatchedCausalLM(tiny_draft, torch.device("cpu"), torch.float32), fingerprint, 2, 256, 8, 16, branch_slots=0
    )
    open_ok(none, SequenceSpec("a", PROMPT, GREEDY))
    (proposal,), _ = none.draft([ahead("a", (7, 300, 9), 3)])
    assert proposal.error is None and proposal.branches == [] and len(proposal.tokens) == K


def test_invalid_branch_requests_fail_only_their_own_task(
    make_drafter, make_ngram, tok, grammars, tiny_draft, fingerprint
):
    lm = BatchedCausalLM(tiny_draft, torch.device("cpu"), torch.float32)
    drafter = ModelDrafter(lm, fingerprint, 8, 256, 8, 16, grammars)
    penalized = Penalties(presence=0.5)
    open_ok(
        drafter,
        *(SequenceSpec(sid, PROMPT, GREEDY) for sid in ("ok", "neg", "noguess", "sib", "pre")),
        SequenceSpec("gram", PROMPT, GREEDY, grammar=choice_grammar(["red", "blue"])),
        SequenceSpec("pen", PROMPT, GREEDY, penalties=penalized),
    )
    n = len(PROMPT)
    proposals, _ = drafter.draft(
        [
            ahead("ok", (7,), 2),
            ahead("neg", (7,), -1),
            DraftTask("noguess", [], n, K, (7,), num_branches=1),
            DraftTask("sib", [], n, K, (7,), guess_first=True, num_siblings=1, num_branches=1),
            DraftTask("pre", [], n, 0, prefill_tokens=2, num_branches=1),
            ahead("gram", (7,), 1),
            ahead("pen", (7,), 1),
        ]
    )
    assert proposals[0].error is None and len(proposals[0].branches) == 2
    assert [p.error.kind if p.error else None for p in proposals[1:]] == [ErrorKind.INVALID_ARGUMENT] * 6
    assert all(p.tokens == [] and p.branches == [] for p in proposals[1:])
    ngram = make_ngram()
    open_ok(ngram, SequenceSpec("a", [5, 6, 7, 8, 5, 6], GREEDY))
    (proposal,), _ = ngram.draft([DraftTask("a", [], 6, 3, (7,), guess_first=True, num_branches=2)])
    assert proposal.error is None and proposal.branches == []


def test_branch_slots_are_lent_beside_the_sequences_and_never_starve_an_open():
    table = SequenceTable(None, 100, 2, 64, torch.device("cpu"), branch_slots=2)
    assert table.open([SequenceSpec("a", [1, 2, 3], GREEDY)])[0] == [None]
    state = table.get("a")
    lent = [table.take_branch_slot() for _ in range(3)]
    assert lent[2] is None and len({state.slot, *lent[:2]}) == 3  # two lent, each its own slot
    state.branches = [BranchCache(slot, []) for slot in lent[:2] if slot is not None]
    assert table.free_slots == 1 and table.branches_held == 2
    errors, _ = table.open([SequenceSpec("b", [1], GREEDY), SequenceSpec("c", [1], GREEDY)])
    assert errors[0] is None and errors[1] is not None and errors[1].kind == ErrorKind.RESOURCE_EXHAUSTED
    table.close(["a"])  # its branches with it
    assert table.free_slots == 3 and table.branches_held == 0


def test_branches_through_the_servicer(make_drafter):
    direct = make_drafter(max_support=8)
    open_ok(direct, SequenceSpec("a", PROMPT, UNSEEDED))
    direct.table.get("a").generator = torch.Generator(direct.lm.device).manual_seed(3)
    (want,), _ = direct.draft([ahead("a", (7, 300), 2)])
    assert len(want.branches) == 2
    asyncio.run(_servicer_round(make_drafter(max_support=8), want))


async def _servicer_round(engine: ModelDrafter, want: DraftProposal) -> None:
    runner = EngineRunner("test-drafter")
    s = DrafterServicer(
        engine, common_pb2.ModelInfo(), runner, Tracing("test"), ServiceMetrics("drafter", engine), Leases(0)
    )
    try:
        hot = common_pb2.SamplingParams(temperature=UNSEEDED.temperature, top_p=1.0)
        spec = common_pb2.SequenceSpec(sequence_id="a", prompt_token_ids=PROMPT, sampling=hot)
        reply = await s.OpenDraftSequences(drafter_pb2.OpenDraftSequencesRequest(sequences=[spec]), Context())
        assert not any(r.error.code for r in reply.results)
        (state,) = engine.table.seqs.values()  # keyed by the lease owner too
        state.generator = torch.Generator(engine.lm.device).manual_seed(3)

        async def requests():
            request = drafter_pb2.DraftRequest(round_id=1)
            request.tasks.add(
                sequence_id="a",
                num_committed=len(PROMPT),
                num_draft_tokens=K,
                assumed_token_ids=[7, 300],
                guess_first=True,
                num_branches=2,
            )
            yield request

        (response,) = [r async for r in s.Draft(requests(), Context())]
        (got,) = response.proposals
        assert not got.HasField("error") and list(got.token_ids) == want.tokens
        assert [(b.num_assumed, list(b.token_ids)) for b in got.branches] == [
            (b.num_assumed, b.tokens) for b in want.branches
        ]
        for wire, branch in zip(got.branches, want.branches, strict=True):
            assert [list(d.token_ids) for d in wire.distributions] == [d.token_ids for d in branch.dists]
    finally:
        runner.shutdown()


@pytest.mark.parametrize("on_device", [True, False])
def test_a_round_mixing_siblings_branches_and_plain_tasks_drafts_each_as_alone(make_drafter, monkeypatch, on_device):
    tasks = [
        DraftTask("s", [], len(PROMPT), 3, num_siblings=2),
        ahead("f", (7, 300, 9), 2),
        DraftTask("p", [], len(PROMPT), 2),
    ]
    mixed = stepwise(make_drafter(), monkeypatch, on_device)
    open_ok(mixed, *(SequenceSpec(t.sequence_id, PROMPT, GREEDY) for t in tasks))
    together, _ = mixed.draft(tasks)
    for task, got in zip(tasks, together, strict=True):
        alone = make_drafter()
        open_ok(alone, SequenceSpec(task.sequence_id, PROMPT, GREEDY))
        (want,), _ = alone.draft([task])
        assert (got.tokens, got.parents, got.branches) == (want.tokens, want.parents, want.branches)
    assert len(together[1].branches) == 2 and together[0].parents


@pytest.mark.parametrize("on_device", [True, False])
def test_greedy_seeded_and_unseeded_fan_out_in_one_round(make_drafter, monkeypatch, on_device):
    """Their alternatives differ in width (an unseeded row's sparse q): one round, each as alone."""
    specs = [SequenceSpec("g", PROMPT, GREEDY), SequenceSpec("s", PROMPT, SEEDED), SequenceSpec("u", PROMPT, UNSEEDED)]
    tasks = [ahead("g", (7, 300), 2), ahead("s", (7,), 3), ahead("u", (7, 300, 9), 2)]

    def fixed(drafter: ModelDrafter, sid: str) -> None:
        if sid == "u":
            drafter.table.get(sid).generator = torch.Generator(drafter.lm.device).manual_seed(11)

    mixed = stepwise(make_drafter(max_support=8), monkeypatch, on_device)
    open_ok(mixed, *specs)
    fixed(mixed, "u")
    together, _ = mixed.draft(tasks)
    for spec, task, got in zip(specs, tasks, together, strict=True):
        alone = stepwise(make_drafter(max_support=8), monkeypatch, on_device)
        open_ok(alone, spec)
        fixed(alone, spec.sequence_id)
        (want,), _ = alone.draft([task])
        assert got.error is None and len(got.branches) == task.num_branches
        assert (got.tokens, [(b.num_assumed, b.tokens) for b in got.branches]) == (
            want.tokens,
            [(b.num_assumed, b.tokens) for b in want.branches],
        )


def test_a_dropped_branch_slot_stays_backed_for_the_next_round_s_copy(make_drafter):
    """A branch's slot goes back to the free slots with its pages backed: the next round's
    branches copy a prefix into it again, and pages handed back would fault in anew each time."""
    drafter = make_drafter()
    if not drafter.lm.cache.lazy:
        pytest.skip("an accelerator's cache is allocated outright")
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY))
    (fanned,), _ = drafter.draft([ahead("a", (7, 300, 9), 2)])
    assert len(fanned.branches) == 2
    backed = drafter.lm.cache.allocated_bytes()
    (nothing,), _ = drafter.draft([DraftTask("a", [], len(PROMPT), 0)])  # settles: the branches go
    assert nothing.error is None and drafter.table.branches_held == 0
    assert drafter.lm.cache.allocated_bytes() == backed


def test_a_drafter_never_asked_for_branches_keeps_no_head_inputs(make_drafter):
    drafter = make_drafter()
    open_ok(drafter, SequenceSpec("a", PROMPT, GREEDY))
    drafter.draft([DraftTask("a", [], len(PROMPT), 3)])
    drafter.draft([ahead("a", (7, 300, 9), 0)])
    assert not drafter.keeps_inputs and drafter.table.get("a").head_inputs.at == {}
    drafter.draft([ahead("a", (7, 300, 9), 1, (7, 300, 9), len(PROMPT) + 3)])
    assert drafter.keeps_inputs and drafter.table.get("a").head_inputs.at != {}
