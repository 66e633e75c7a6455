"""Penalties, logit bias and logprobs in the engines, against target-only HF references."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from target_reference import adjust, penalized_greedy, raw_logprobs

from specd.engine.logits import penalize
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams, TokenLogprob, validate_penalties
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [11, 22, 33, 44, 55, 11, 22, 901, 902]
CASES = {
    "presence": Penalties.of(presence=1.5),
    "frequency": Penalties.of(frequency=1.2),
    "repetition": Penalties.of(repetition=1.8),
    "negative": Penalties.of(presence=-0.5, frequency=-0.3, repetition=0.7),
    "bias": Penalties.of(bias={5: 100.0, 7: 4.0, 11: -100.0}),
    "all": Penalties.of(presence=0.6, frequency=0.9, repetition=1.3, bias={22: 3.0, 100: -2.0}),
}


def reference_kwargs(p: Penalties) -> dict:
    return {
        "presence": p.presence,
        "frequency": p.frequency,
        "repetition": p.repetition,
        "bias": dict(p.logit_bias),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_penalize_row_j_counts_the_drafts_before_it(name):
    penalties = CASES[name]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((4, 200), generator=gen) * 3
    prompt, output, drafts = [1, 2, 3, 2], [5, 7, 5, 9], [7, 7, 11]
    got = penalize(logits, penalties, prompt, output, drafts)
    for j in range(4):
        want = adjust(logits[j], prompt, [*output, *drafts[:j]], **reference_kwargs(penalties))
        torch.testing.assert_close(got[j], want, rtol=0, atol=1e-5)


def test_inactive_penalties_return_the_logits_untouched():
    logits = torch.randn((2, 10))
    assert penalize(logits, Penalties(), [1], [2], [3]) is logits


@pytest.mark.parametrize(
    ("penalties", "mentions"),
    [
        (Penalties.of(presence=2.5), "presence_penalty"),
        (Penalties.of(frequency=float("nan")), "frequency_penalty"),
        (Penalties.of(repetition=0.0), "repetition_penalty"),
        (Penalties.of(bias={10**6: 1.0}), "outside the vocabulary"),
        (Penalties.of(bias={3: 101.0}), "logit_bias[3]"),
    ],
)
def test_bad_penalties_are_refused_by_the_engines(make_verifier, make_drafter, penalties, mentions):
    assert mentions in (validate_penalties(penalties, 1000) or "")
    for engine in (make_verifier(), make_drafter()):
        errors, _ = engine.open([SequenceSpec("a", PROMPT, GREEDY, penalties)])
        assert errors[0] is not None and mentions in errors[0].message


def speculate(verifier, drafter, spec: SequenceSpec, max_tokens: int, k: int) -> tuple[list[int], list[TokenLogprob]]:
    """Rounds as the gateway runs them: target-only first, then k drafts per round."""
    assert verifier.open([spec])[0] == [None]
    output: list[int] = []
    logprobs: list[TokenLogprob] = []
    synced = len(spec.prompt)
    on_drafter = False
    while len(output) < max_tokens:
        tokens = [*spec.prompt, *output]
        drafts: list[int] = []
        if on_drafter:
            proposal = drafter.draft([DraftTask("s", tokens[synced:], len(tokens), k)])[0][0]
            assert proposal.error is None, proposal.error
            synced, drafts = len(tokens), proposal.tokens
        result = verifier.verify([VerifyTask("s", len(tokens), drafts)])[0][0]
        assert result.error is None, result.error
        new = [*drafts[: result.num_accepted], result.next_token]
        assert [lp.token_id for lp in result.logprobs] == (new if spec.logprobs else [])
        output += new
        logprobs += result.logprobs
        if not on_drafter:
            # Joins after its first token, with that token as the tail of its prompt.
            joined = dataclasses.replace(spec, prompt=[*spec.prompt, *output], num_generated=len(output))
            assert drafter.open([joined])[0] == [None]
            synced, on_drafter = len(joined.prompt), True
    return output[:max_tokens], logprobs[:max_tokens]


@pytest.mark.parametrize("name", list(CASES))
def test_penalised_greedy_equals_the_target_alone_with_speculation(
    make_verifier, make_drafter, close_draft, tiny_target, name
):
    penalties = CASES[name]
    want = penalized_greedy(tiny_target, PROMPT, 24, **reference_kwargs(penalties))
    spec = SequenceSpec("s", PROMPT, GREEDY, penalties)
    got, _ = speculate(make_verifier(), make_drafter(model=close_draft), spec, 24, k=4)
    assert got == want
    if name != "negative":
        assert want != penalized_greedy(tiny_target, PROMPT, 24), "the penalty changed nothing: a weak test"


def test_drafter_applies_the_penalties_so_its_drafts_keep_being_accepted(make_drafter, tiny_target):
    """A drafter with the target's own weights proposes exactly the penalised greedy tokens."""
    penalties = CASES["all"]
    want = penalized_greedy(tiny_target, PROMPT, 6, **reference_kwargs(penalties))
    drafter = make_drafter(model=tiny_target)
    spec = SequenceSpec("s", [*PROMPT, want[0]], GREEDY, penalties, num_generated=1)
    assert drafter.open([spec])[0] == [None]
    proposal = drafter.draft([DraftTask("s", [], len(spec.prompt), 5)])[0][0]
    assert proposal.tokens == want[1:6]


@pytest.mark.parametrize("top", [0, 3])
def test_logprobs_are_the_targets_raw_log_softmax_at_every_position(
    make_verifier, make_drafter, close_draft, tiny_target, top
):
    spec = SequenceSpec("s", PROMPT, GREEDY, CASES["all"], logprobs=LogprobsRequest(top=top, prompt=True))
    verifier = make_verifier()
    output, logprobs = speculate(verifier, make_drafter(model=close_draft), spec, 20, k=4)
    reference = raw_logprobs(tiny_target, [*PROMPT, *output])
    for j, lp in enumerate(logprobs):
        row = reference[len(PROMPT) - 1 + j]
        assert lp.token_id == output[j]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert len(lp.top_ids) == top
        if top:
            values, ids = row.topk(top)
            assert list(lp.top_ids) == ids.tolist()
            torch.testing.assert_close(torch.tensor(lp.top_logprobs), values, rtol=0, atol=1e-4)
    assert any(lp.logprob < -1e-3 for lp in logprobs), "greedy logprobs must be real values, not 0.0"


def test_prompt_logprobs_come_from_the_prefill(make_verifier, tiny_target):
    verifier = make_verifier()
    spec = SequenceSpec("s", PROMPT, GREEDY, logprobs=LogprobsRequest(top=2, prompt=True))
    assert verifier.open([spec])[0] == [None]
    scored = verifier.take_prompt_logprobs("s")
    reference = raw_logprobs(tiny_target, PROMPT)
    assert [lp.token_id for lp in scored] == PROMPT[1:]
    for j, lp in enumerate(scored):
        assert abs(lp.logprob - float(reference[j, PROMPT[j + 1]])) < 1e-4
    assert verifier.take_prompt_logprobs("s") == []  # handed over once
    # A drafter never scores prompts, whatever the spec asks.
    assert verifier.table.scores_prompts


# Two end-of-sequence ids, as a generation_config may list; biased so that without min_tokens
# one of them would win at once.
EOS = (3, 7)
MIN_TOKENS = Penalties.of(bias={3: 100.0, 7: 90.0}, min_tokens=10, eos=EOS)


def min_tokens_greedy(model, prompt: list[int], max_tokens: int, penalties: Penalties) -> list[int]:
    """The target alone: bias, then every eos id at -inf before min_tokens."""
    output: list[int] = []
    for _ in range(max_tokens):
        logits = model(torch.tensor([[*prompt, *output]])).logits[0, -1]
        logits = adjust(logits, prompt, output, **reference_kwargs(penalties))
        if len(output) < penalties.min_tokens:
            logits[list(penalties.eos)] = float("-inf")
        output.append(int(logits.argmax()))
    return output


def test_penalize_suppresses_eos_in_the_rows_before_min_tokens():
    logits = torch.zeros((4, 20))
    got = penalize(logits, Penalties.of(min_tokens=6, eos=EOS), [1], [5, 5, 5, 5], [8, 8, 8])
    # Rows 0 and 1 are output positions 4 and 5, before min_tokens; rows 2 and 3 are not.
    assert torch.isinf(got[:2, list(EOS)]).all() and not torch.isinf(got[2:]).any()
    assert not torch.isinf(got[:2, 8]).any()


@pytest.mark.parametrize("k", [1, 4])
def test_min_tokens_holds_every_eos_id_back_exactly_with_speculation(
    make_verifier, make_drafter, close_draft, tiny_target, k
):
    want = min_tokens_greedy(tiny_target, PROMPT, 13, MIN_TOKENS)
    assert not set(want[:10]) & set(EOS) and want[10] in EOS  # held back, then ended at once
    spec = SequenceSpec("s", PROMPT, GREEDY, MIN_TOKENS)
    got, _ = speculate(make_verifier(), make_drafter(model=close_draft), spec, 13, k=k)
    assert got == want


def test_the_drafter_holds_eos_back_too_so_its_drafts_keep_being_accepted(make_drafter, tiny_target):
    want = min_tokens_greedy(tiny_target, PROMPT, 8, MIN_TOKENS)
    drafter = make_drafter(model=tiny_target)
    spec = SequenceSpec("s", [*PROMPT, want[0]], GREEDY, MIN_TOKENS, num_generated=1)
    assert drafter.open([spec])[0] == [None]
    proposal = drafter.draft([DraftTask("s", [], len(spec.prompt), 7)])[0][0]
    assert proposal.tokens == want[1:8]
