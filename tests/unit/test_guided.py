"""vLLM's guided_regex and guided_choice in the engines: the output is a full match of the regex,
or exactly one of the choices, for greedy, seeded and unseeded sampling with speculation on and
off; greedy and seeded outputs equal target-only constrained decoding token for token."""

from __future__ import annotations

import random
import re

import pytest
from test_grammar import PARAMS, decode_under, generate, make_drafter, make_verifier, text_of

from drafter_service.ngram_engine import NgramDrafter
from gateway.api.validation import InvalidParameter, RequestedParams, generation_params
from specd.engine.grammar import GrammarError, choice_grammar, regex_grammar
from specd.engine.params import SamplingParams
from specd.engine.tasks import SequenceSpec

# Digits as [0-9], not \d: \d means every Unicode digit, and the grammar engine's Unicode tables
# are newer than Python's, so a random model finds digits (U+1CCF9) that `re` here does not know.
REGEXES = [r"[a-c]{2,5}", r"[0-9]{3}-[0-9]{2}", r"(yes|no)!", r"[A-Z][a-z]{1,4} [0-9]{1,2}"]
CHOICES = [["red", "green", "blue"], ['a"b', "é ü", "x/y\n", "{}"], ["yes", "no", "maybe so"], ["1", "12", "123"]]
PROMPTS = ["Hello", "Pick one:", "<|im_start|>user\nA color?<|im_end|>\n", "1, 2, 3"]


def cases(tok, kind: str) -> tuple[list[SequenceSpec], dict[str, object]]:
    """Specs, and each one's check: the regex its text must fully match, or its choices."""
    specs, checks = [], {}
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        sid = f"{kind}{i}"
        if kind == "regex":
            grammar, checks[sid] = regex_grammar(REGEXES[i]), re.compile(REGEXES[i])
        else:
            grammar, checks[sid] = choice_grammar(CHOICES[i]), CHOICES[i]
        specs.append(SequenceSpec(sid, tok.encode(prompt), params, grammar=grammar))
    return specs, checks


def check_outputs(tok, outputs: dict[str, list[int]], checks: dict[str, object]) -> None:
    for sid, ids in outputs.items():
        assert ids[-1] == tok.eos_token_id, f"{sid} did not finish: {text_of(tok, ids)!r}"
        text = text_of(tok, ids)
        want = checks[sid]
        if isinstance(want, re.Pattern):
            assert want.fullmatch(text), (sid, text)
        else:
            assert text in want, (sid, text)


def reference(model, grammars, spec: SequenceSpec, eos: int) -> list[int]:
    """Target-only decoding under the grammar: the masked target distribution, sampled as the verifier does."""
    return decode_under(model, grammars.matcher(grammar=spec.grammar), spec.prompt, spec.sampling, eos)


@pytest.mark.parametrize("kind", ["regex", "choice"])
@pytest.mark.parametrize("k", [0, 4])
def test_greedy_and_seeded_outputs_are_target_only_guided_decoding(
    tok, tiny_target, close_draft, fingerprint, grammars, kind, k
):
    specs, checks = cases(tok, kind)
    verifier = make_verifier(tiny_target, fingerprint, grammars)
    drafter = make_drafter(close_draft, fingerprint, grammars) if k else None
    outputs, _, _ = generate(verifier, drafter, specs, lambda s, r: k, tok.eos_token_id)
    for spec in specs:
        assert outputs[spec.sequence_id] == reference(tiny_target, grammars, spec, tok.eos_token_id), spec.sequence_id
    check_outputs(tok, outputs, checks)


@pytest.mark.parametrize("kind", ["regex", "choice"])
def test_unseeded_sampling_and_junk_drafts_stay_inside_the_grammar(
    tok, tiny_target, tiny_draft, fingerprint, grammars, kind
):
    specs, checks = cases(tok, kind)
    unseeded = [
        SequenceSpec(s.sequence_id, s.prompt, SamplingParams(temperature=1.0), grammar=s.grammar) for s in specs
    ]
    rng = random.Random(0)
    for drafter in (make_drafter(tiny_draft, fingerprint, grammars), NgramDrafter(len(tok), 8, 512, 8, 1, 4)):
        for _ in range(2):
            verifier = make_verifier(tiny_target, fingerprint, grammars)
            outputs, _, _ = generate(verifier, drafter, unseeded, lambda s, r: rng.randint(0, 5), tok.eos_token_id)
            check_outputs(tok, outputs, checks)


def test_choices_are_literal_strings(tok, grammars):
    """Quotes, backslashes, slashes, newlines and non-ASCII are the characters themselves."""
    for choices in (['a"b', "c\\d", "x/y\n", "é ü 中", "", "(a|b)*"], ["a.c"]):
        for choice in choices:
            matcher = grammars.matcher(grammar=choice_grammar(choices))
            matcher.push(tok.encode(choice))
            assert matcher.allowed()[tok.eos_token_id], choice
        matcher = grammars.matcher(grammar=choice_grammar(choices))
        tokens = tok.encode("abc")  # not one of them: "a.c" is no pattern
        with pytest.raises(GrammarError):
            matcher.push(tokens)


def test_the_engines_refuse_both_constraints_at_once(tok, tiny_target, fingerprint, grammars):
    verifier = make_verifier(tiny_target, fingerprint, grammars)
    both = SequenceSpec("x", [1, 2], SamplingParams(), json_schema='{"type":"object"}', grammar=regex_grammar("a+"))
    bad = SequenceSpec("y", [1, 2], SamplingParams(), grammar="start: /[a-/")
    errors, _ = verifier.open([both, bad])
    assert errors[0] is not None and errors[1] is not None and "grammar" in str(errors[1])


def params(**fields) -> RequestedParams:
    return RequestedParams(**fields)


def test_gateway_validation_of_guided_fields():
    got = generation_params(params(guided_regex=r"\d+"), 100)
    assert got.grammar == regex_grammar(r"\d+") and got.json_schema == ""
    assert generation_params(params(guided_choice=["a", "b"]), 100).grammar == choice_grammar(["a", "b"])
    # response_format text is no constraint: it combines with either.
    assert generation_params(params(guided_regex="a", response_format={"type": "text"}), 100).grammar
    json_object = {"type": "json_object"}
    for bad, param in [
        (params(guided_regex="a", guided_choice=["a"]), "guided_choice"),
        (params(response_format=json_object, guided_regex="a"), "guided_regex"),
        (params(response_format=json_object, guided_choice=["a"]), "guided_choice"),
        (params(guided_regex="[a-"), "guided_regex"),
        (params(guided_regex=r"\bfoo"), "guided_regex"),  # lookarounds: not in llguidance's syntax
        (params(guided_regex=""), "guided_regex"),
        (params(guided_choice=[]), "guided_choice"),
        (params(guided_regex="a+", ignore_eos=True), "ignore_eos"),
        (params(guided_choice=["a"], ignore_eos=True), "ignore_eos"),
    ]:
        with pytest.raises(InvalidParameter) as caught:
            generation_params(bad, 100)
        assert caught.value.param == param and param in caught.value.message, bad
