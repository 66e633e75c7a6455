"""Sibling drafts (DraftTask.num_siblings): leaves beside the chain's least sure drafts.

Expected siblings are computed here from a plain forward of the draft model, apart from the
drafter's own bookkeeping; the chain must be the one drafted without siblings.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from scipy import stats
from test_leases import Context

from drafter_service.engine import ModelDrafter
from drafter_service.servicer import DrafterServicer
from specd.engine import noise
from specd.engine.errors import ErrorKind
from specd.engine.grammar import choice_grammar
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.sampling import probabilities
from specd.engine.tasks import DraftProposal, DraftTask, SequenceSpec
from specd.proto.speculative.v1 import common_pb2, drafter_pb2
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner
from specd.rpc.tracing import Tracing

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, seed=5)
UNSEEDED = SamplingParams(temperature=1.0)
PROMPTS = {"a": [11, 22, 33, 44, 55, 11, 22], "b": [7, 8, 9, 10, 11, 12], "c": [3, 1, 4, 1, 5, 9, 2, 6]}


def open_ok(drafter, *specs: SequenceSpec) -> None:
    errors, _ = drafter.open(list(specs))
    assert errors == [None] * len(specs)


def step_logits(model, prompt: list[int], chain: list[int]) -> torch.Tensor:
    """The draft model's logits [len(chain), V] at each chain position, from one plain forward."""
    with torch.no_grad():
        out = model(torch.tensor([prompt + chain[:-1]])).logits[0].float()
    return out[len(prompt) - 1 :]


def expected_tree(chain: list[int], sure: list[float], alts: list[int | None], n: int) -> tuple[list[int], list[int]]:
    """Tokens and parents of a chain with siblings at its n least sure depths that have one."""
    depths = sorted((d for d in range(len(chain)) if alts[d] is not None), key=lambda d: (sure[d], d))[:n]
    depths.sort()
    tokens = chain + [alts[d] for d in depths]
    return tokens, [*range(-1, len(chain) - 1), *(d - 1 for d in depths)]


def greedy_reference(model, prompt: list[int], chain: list[int], n: int) -> tuple[list[int], list[int]]:
    logits = step_logits(model, prompt, chain)
    assert logits.argmax(dim=-1).tolist() == chain  # the chain is the greedy one
    sure = [float(logits[d].log_softmax(-1)[t]) for d, t in enumerate(chain)]
    alts: list[int | None] = []
    for d, token in enumerate(chain):
        others = logits[d].clone()
        others[token] = float("-inf")
        alts.append(int(others.argmax()))
    return expected_tree(chain, sure, alts, n)


@pytest.mark.parametrize("on_device", [True, False])
def test_greedy_siblings_are_the_runner_ups_at_the_least_sure_depths(make_drafter, tiny_draft, monkeypatch, on_device):
    drafter = make_drafter()
    if not on_device:
        monkeypatch.setattr(drafter, "_drafts_stay_on_device", lambda *_: False)
    open_ok(drafter, *(SequenceSpec(sid, p, GREEDY) for sid, p in PROMPTS.items()))
    reads = {"n": 0}
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> list:
        reads["n"] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    tasks = [
        DraftTask("a", [], 7, 6, num_siblings=3),
        DraftTask("b", [], 6, 4),
        DraftTask("c", [], 8, 2, num_siblings=2),
    ]
    proposals, _ = drafter.draft(tasks)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    if on_device:
        assert reads["n"] == 1  # the siblings' notes come back with the chain, in the round's one read
    a, b, c = proposals
    assert (a.tokens, a.parents) == greedy_reference(tiny_draft, PROMPTS["a"], a.tokens[:6], 3)
    assert (c.tokens, c.parents) == greedy_reference(tiny_draft, PROMPTS["c"], c.tokens[:2], 2)
    assert len(a.tokens) == 9 and len(c.tokens) == 4 and a.dists == c.dists == []
    assert len(b.tokens) == 4 and b.parents == []  # it asked for none


def chains(drafter: ModelDrafter, specs: list[SequenceSpec], siblings: int, seed: int) -> list[list[DraftProposal]]:
    """Three rounds of 5 drafts a sequence, committing the first two drafts each round."""
    open_ok(drafter, *specs)
    for n, spec in enumerate(specs):
        state = drafter.table.get(spec.sequence_id)
        if state.generator is not None:
            state.generator = torch.Generator(device=state.generator.device).manual_seed(seed + n)
    committed = {s.sequence_id: len(s.prompt) for s in specs}
    new: dict[str, list[int]] = {s.sequence_id: [] for s in specs}
    rounds = []
    for _ in range(3):
        tasks = [DraftTask(sid, new[sid], committed[sid], 5, num_siblings=siblings) for sid in committed]
        proposals, _ = drafter.draft(tasks)
        assert all(p.error is None for p in proposals)
        for p in proposals:
            new[p.sequence_id] = p.tokens[:2]
            committed[p.sequence_id] += 2
        rounds.append(proposals)
    return rounds


@pytest.mark.parametrize("on_device", [True, False])
def test_the_chain_is_the_same_with_siblings_on(make_drafter, on_device):
    specs = [
        SequenceSpec("g", PROMPTS["a"], GREEDY),
        SequenceSpec("s", PROMPTS["b"], SEEDED),
        SequenceSpec("u", PROMPTS["c"], UNSEEDED),
        SequenceSpec("u2", PROMPTS["a"], SamplingParams(temperature=0.7, top_p=0.9)),
    ]
    if on_device:  # greedy only: the others would take the step-by-step loop
        specs = [specs[0], SequenceSpec("g2", PROMPTS["b"], GREEDY)]
    plain = chains(make_drafter(max_support=8), specs, 0, seed=40)
    tree = chains(make_drafter(max_support=8), specs, 3, seed=40)
    siblings = 0
    for without, with_siblings in zip(plain, tree, strict=True):
        for p, t in zip(without, with_siblings, strict=True):
            assert p.parents == []
            assert t.tokens[:5] == p.tokens and t.dists[: len(p.dists)] == p.dists
            assert t.parents[:5] == [-1, 0, 1, 2, 3]
            siblings += len(t.tokens) - 5
    assert siblings == 3 * 3 * len(specs)


def seeded_reference(model, prompt: list[int], chain: list[int], seed: int, n: int) -> tuple[list[int], list[int]]:
    """Over the whole vocabulary: the chain is each position's noisy argmax of log q + g, the
    sibling its second."""
    q = probabilities(step_logits(model, prompt, chain), [SEEDED] * len(chain))
    sure, alts = [], []
    for d in range(len(chain)):
        key = torch.tensor(noise.noise_key(seed, len(prompt) + d))
        scores = q[d].log() + noise.gumbel(key, torch.arange(q.shape[-1]))
        first, second = scores.topk(2).indices.tolist()
        assert first == chain[d]
        sure.append(float(q[d, first].log()))
        alts.append(second if q[d, second] > 0 else None)
    return expected_tree(chain, sure, alts, n)


def test_seeded_siblings_are_the_noises_second_choice(make_drafter, tiny_draft):
    drafter = make_drafter()
    open_ok(drafter, SequenceSpec("s", PROMPTS["c"], SEEDED))
    (proposal,), _ = drafter.draft([DraftTask("s", [], 8, 6, num_siblings=4)])
    assert proposal.dists == [] and len(proposal.tokens) == 10
    want = seeded_reference(tiny_draft, PROMPTS["c"], proposal.tokens[:6], 5, 4)
    assert (proposal.tokens, proposal.parents) == want


def test_unseeded_siblings_are_independent_draws_from_their_brothers_q(make_drafter):
    """Every round drafts from the same context, so chain token and sibling are two draws from
    one q: each alone is distributed as q, and the pair as q x q (a sibling that copied or
    avoided its brother would fail the joint test)."""
    batch, rounds = 8, 150
    drafter = make_drafter(max_support=6)
    hot = SamplingParams(temperature=2.0)
    open_ok(drafter, *(SequenceSpec(f"u{n}", PROMPTS["a"], hot) for n in range(batch)))
    for n in range(batch):
        drafter.table.get(f"u{n}").generator = torch.Generator(drafter.lm.device).manual_seed(1000 + n)
    pairs, q = [], None
    for _ in range(rounds):
        proposals, _ = drafter.draft([DraftTask(f"u{n}", [], 7, 1, num_siblings=1) for n in range(batch)])
        for p in proposals:
            assert p.parents == [-1, -1] and p.dists[1] is p.dists[0]
            q = q or p.dists[0]
            assert p.dists[0] == q
            pairs.append((p.tokens[0], p.tokens[1]))
    assert q is not None
    bins = q.token_ids[:2]  # the rest pooled: every expected count stays large

    def bin_of(token: int) -> int:
        return bins.index(token) if token in bins else len(bins)

    probs = [*q.probs[:2], 1.0 - sum(q.probs[:2])]
    assert min(probs) > 0.1
    total = len(pairs)
    sibling_counts = [0] * 3
    joint_counts = [0] * 9
    for chain_token, sibling in pairs:
        sibling_counts[bin_of(sibling)] += 1
        joint_counts[3 * bin_of(chain_token) + bin_of(sibling)] += 1
    sibling_p = stats.chisquare(sibling_counts, [p * total for p in probs]).pvalue
    joint = [a * b * total for a in probs for b in probs]
    joint_p = stats.chisquare(joint_counts, [e * total / sum(joint) for e in joint]).pvalue
    assert sibling_p > 1e-4 and joint_p > 1e-4, (sibling_counts, joint_counts, probs)


def test_grammar_siblings_are_tokens_the_grammar_allows_there(tok, tiny_draft, fingerprint, grammars):
    lm = BatchedCausalLM(tiny_draft, torch.device("cpu"), torch.float32)
    drafter = ModelDrafter(lm, fingerprint, 4, 256, 8, 16, grammars)
    grammar = choice_grammar(["red", "green", "blue", "yellow"])
    prompt = tok.encode("A color:")
    open_ok(drafter, *(SequenceSpec(sid, prompt, p, grammar=grammar) for sid, p in (("g", GREEDY), ("u", UNSEEDED))))
    proposals, _ = drafter.draft([DraftTask(sid, [], len(prompt), 4, num_siblings=4) for sid in ("g", "u")])
    for proposal in proposals:
        chain_len = next((n for n, p in enumerate(proposal.parents) if n and p != n - 1), len(proposal.tokens))
        chain = proposal.tokens[:chain_len]
        assert proposal.tokens[chain_len:], "some position allows more than one color"
        for token, parent in zip(proposal.tokens[chain_len:], proposal.parents[chain_len:], strict=True):
            matcher = grammars.matcher(grammar=grammar)
            matcher.push(chain[: parent + 1])
            assert matcher.allowed()[token], (proposal.sequence_id, parent, token)


def test_invalid_sibling_requests_fail_only_their_own_task(make_drafter, make_ngram):
    for drafter in (make_drafter(max_draft_tokens=4), make_ngram(max_draft_tokens=4)):
        open_ok(drafter, *(SequenceSpec(sid, PROMPTS["a"], GREEDY) for sid in ("ok", "x", "y", "z", "w")))
        proposals, _ = drafter.draft(
            [
                DraftTask("ok", [], 7, 3, num_siblings=3),
                DraftTask("x", [], 7, 2, num_siblings=3),  # more siblings than drafts
                DraftTask("y", [], 7, 3, (5,), guess_first=True, num_siblings=1),
                DraftTask("z", [], 7, 0, prefill_tokens=2, num_siblings=1),
                DraftTask("w", [], 7, 3, num_siblings=-1),
            ]
        )
        kinds = [None if p.error is None else p.error.kind for p in proposals]
        assert kinds == [None] + [ErrorKind.INVALID_ARGUMENT] * 4
        assert all(p.tokens == [] for p in proposals[1:])


def test_the_ngram_drafter_proposes_no_siblings(make_ngram):
    drafter = make_ngram()
    open_ok(drafter, SequenceSpec("a", [5, 6, 7, 8, 5, 6], GREEDY))
    (proposal,), _ = drafter.draft([DraftTask("a", [], 6, 3, num_siblings=2)])
    assert proposal.error is None and proposal.tokens == [7, 8, 5] and proposal.parents == []


def test_siblings_through_the_servicer(make_drafter):
    engine, direct = make_drafter(), make_drafter()
    open_ok(direct, SequenceSpec("a", PROMPTS["a"], GREEDY))
    (want,), _ = direct.draft([DraftTask("a", [], 7, 4, num_siblings=2)])
    asyncio.run(_servicer_round(engine, want))


async def _servicer_round(engine: ModelDrafter, want: DraftProposal) -> None:
    runner = EngineRunner("test-drafter")
    s = DrafterServicer(
        engine, common_pb2.ModelInfo(), runner, Tracing("test"), ServiceMetrics("drafter", engine), Leases(0)
    )
    try:
        greedy = common_pb2.SamplingParams(temperature=0.0, top_p=1.0)
        specs = [
            common_pb2.SequenceSpec(sequence_id=sid, prompt_token_ids=PROMPTS["a"], sampling=greedy) for sid in "ab"
        ]
        reply = await s.OpenDraftSequences(drafter_pb2.OpenDraftSequencesRequest(sequences=specs), Context())
        assert not any(r.error.code for r in reply.results)

        async def requests():
            request = drafter_pb2.DraftRequest(round_id=1)
            request.tasks.add(sequence_id="a", num_committed=7, num_draft_tokens=4, num_siblings=2)
            request.tasks.add(sequence_id="b", num_committed=7, num_draft_tokens=1, num_siblings=2)
            yield request

        (response,) = [r async for r in s.Draft(requests(), Context())]
        a, b = response.proposals
        assert not a.HasField("error")
        assert (list(a.token_ids), list(a.parents)) == (want.tokens, want.parents)
        assert len(want.tokens) == 6 and want.parents[:4] == [-1, 0, 1, 2]
        assert b.error.code == common_pb2.ERROR_CODE_INVALID_ARGUMENT and list(b.parents) == []
    finally:
        runner.shutdown()
