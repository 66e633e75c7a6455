"""Structured output in the engines: the grammar follows the committed tokens exactly, the
verifier's masked distribution is the one sampled from, and every output validates.

The reference is target-only constrained decoding computed here from the target model alone
(full forward, a fresh matcher, no engine): greedy and seeded outputs through the drafter and
the verifier must equal it token for token whatever k is, and whatever the drafts were.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tinymodels import device_under_test, on_test_device

from drafter_service.engine import ModelDrafter
from drafter_service.ngram_engine import NgramDrafter
from specd.engine.grammar import JSON_OBJECT_SCHEMA, apply_mask, canonical, schema_problem
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.sampling import gumbel_argmax, position_keys, probabilities
from specd.engine.tasks import DraftTask, SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine

CPU = torch.device("cpu")
MAX_NEW = 48

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "string", "pattern": "^[a-c]{2,4}$"},
]
PROMPTS = ["Hello", "Give me JSON:", "<|im_start|>user\nA color?<|im_end|>\n", "1, 2, 3"]
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=1.2, top_k=40, seed=2**64 - 1),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
]


def make_verifier(model, fingerprint, grammars) -> VerifierEngine:
    lm = BatchedCausalLM(on_test_device(model), device_under_test(), torch.float32)
    return VerifierEngine(lm, fingerprint, 8, 512, 8, grammars)


def make_drafter(model, fingerprint, grammars) -> ModelDrafter:
    lm = BatchedCausalLM(on_test_device(model), device_under_test(), torch.float32)
    return ModelDrafter(lm, fingerprint, 8, 512, 8, 16, grammars)


def reference(model, grammars, prompt: list[int], schema: str, params: SamplingParams, eos: int) -> list[int]:
    """Target-only constrained decoding: the masked target distribution, sampled as the verifier does."""
    return decode_under(model, grammars.matcher(schema), prompt, params, eos)


def decode_under(model, matcher, prompt: list[int], params: SamplingParams, eos: int) -> list[int]:
    """Target-only decoding with `matcher`'s mask at every position, as the verifier samples, on the
    device the engines run on: another device's kernels round logits and noise differently, which
    can move a sample, so the engines are held to their own device's target-only output."""
    device = device_under_test()
    model = on_test_device(model)
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) - len(prompt) < MAX_NEW:
            logits = model(torch.tensor([ids], device=device)).logits[0, -1:].float()
            logits = apply_mask(logits, matcher.allowed()[None])
            probs = probabilities(logits, [params])
            if params.seeded:
                assert params.seed is not None
                token = int(gumbel_argmax(probs, position_keys(params.seed, len(ids), 1, device))[0])
            else:
                token = int(probs[0].argmax())
            ids.append(token)
            if token == eos:
                break
            matcher.push([token])
    return ids[len(prompt) :]


def generate(verifier, drafter, specs: list[SequenceSpec], k_of, eos: int) -> tuple[dict[str, list[int]], int, int]:
    """Rounds as the gateway runs them, until EOS or MAX_NEW; returns (outputs, drafted, accepted)."""
    assert verifier.open(specs)[0] == [None] * len(specs)
    if drafter is not None:
        assert drafter.open(specs)[0] == [None] * len(specs)
    committed = {s.sequence_id: list(s.prompt) for s in specs}
    start = {s.sequence_id: len(s.prompt) for s in specs}
    unsent: dict[str, list[int]] = {s.sequence_id: [] for s in specs}
    active = sorted(committed)
    drafted = accepted = 0
    r = 0
    while active:
        drafts: dict[str, list[int]] = {sid: [] for sid in active}
        dists: dict[str, list] = {sid: [] for sid in active}
        if drafter is not None:
            ks = {sid: min(k_of(sid, r), MAX_NEW - (len(committed[sid]) - start[sid]) - 1) for sid in active}
            tasks = [DraftTask(s, unsent[s], len(committed[s]), max(ks[s], 0)) for s in active]
            proposals, _ = drafter.draft(tasks)
            for sid, proposal in zip(active, proposals, strict=True):
                assert proposal.error is None, proposal.error
                drafts[sid], dists[sid] = proposal.tokens, proposal.dists
                unsent[sid] = []
        tasks = [VerifyTask(s, len(committed[s]), drafts[s], dists[s]) for s in active]
        results, _ = verifier.verify(tasks)
        still = []
        for sid, result in zip(active, results, strict=True):
            assert result.error is None, result.error
            new = [*drafts[sid][: result.num_accepted], result.next_token]
            drafted += len(drafts[sid])
            accepted += result.num_accepted
            committed[sid] += new
            unsent[sid] += new
            out = committed[sid][start[sid] :]
            if eos in out:
                del committed[sid][start[sid] + out.index(eos) + 1 :]
            elif len(out) < MAX_NEW:
                still.append(sid)
        verifier.close([s for s in active if s not in still])
        if drafter is not None:
            drafter.close([s for s in active if s not in still])
        active = still
        r += 1
    return {sid: ids[start[sid] :] for sid, ids in committed.items()}, drafted, accepted


def text_of(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != tok.eos_token_id])


def check_valid(tok, outputs: dict[str, list[int]], schemas: dict[str, dict]) -> None:
    for sid, ids in outputs.items():
        assert ids[-1] == tok.eos_token_id, f"{sid} did not finish: {text_of(tok, ids)!r}"
        jsonschema.validate(json.loads(text_of(tok, ids)), schemas[sid])


def cases(tok) -> tuple[list[SequenceSpec], dict[str, dict]]:
    specs, schemas = [], {}
    for i, (schema, prompt, params) in enumerate(zip(SCHEMAS, PROMPTS, PARAMS, strict=True)):
        sid = f"s{i}"
        specs.append(SequenceSpec(sid, tok.encode(prompt), params, json_schema=canonical(schema)))
        schemas[sid] = schema
    return specs, schemas


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_and_seeded_outputs_are_target_only_constrained_decoding(
    tok, tiny_target, close_draft, fingerprint, grammars, k
):
    specs, schemas = cases(tok)
    verifier = make_verifier(tiny_target, fingerprint, grammars)
    drafter = make_drafter(close_draft, fingerprint, grammars) if k else None
    outputs, drafted, accepted = generate(verifier, drafter, specs, lambda s, r: k, tok.eos_token_id)
    for spec in specs:
        want = reference(tiny_target, grammars, spec.prompt, spec.json_schema, spec.sampling, tok.eos_token_id)
        assert outputs[spec.sequence_id] == want, spec.sequence_id
    check_valid(tok, outputs, schemas)
    if k:
        # The drafter masks its drafts with the same grammar, so a close drafter is mostly right.
        assert drafted and accepted / drafted > 0.5


def test_random_k_per_round_and_junk_drafts_change_nothing(tok, tiny_target, fingerprint, grammars, tiny_draft):
    """An unconstrained n-gram drafter and a poor model drafter: refused drafts are rejected, output unchanged."""
    specs, _ = cases(tok)
    want = {
        s.sequence_id: reference(tiny_target, grammars, s.prompt, s.json_schema, s.sampling, tok.eos_token_id)
        for s in specs
    }
    rng = random.Random(0)
    for drafter in (NgramDrafter(len(tok), 8, 512, 8, 1, 4), make_drafter(tiny_draft, fingerprint, grammars)):
        verifier = make_verifier(tiny_target, fingerprint, grammars)
        outputs, _, _ = generate(verifier, drafter, specs, lambda s, r: rng.randint(0, 6), tok.eos_token_id)
        assert outputs == want


def test_unseeded_sampling_validates(tok, tiny_target, tiny_draft, fingerprint, grammars):
    specs, schemas = cases(tok)
    specs = [
        SequenceSpec(s.sequence_id, s.prompt, SamplingParams(temperature=1.0), json_schema=s.json_schema) for s in specs
    ]
    for _ in range(3):
        verifier = make_verifier(tiny_target, fingerprint, grammars)
        drafter = make_drafter(tiny_draft, fingerprint, grammars)
        outputs, _, _ = generate(verifier, drafter, specs, lambda s, r: 3, tok.eos_token_id)
        check_valid(tok, outputs, schemas)


def test_masks_along_and_commit_follow_the_committed_tokens(tok, grammars):
    """After any verdict the matcher is where a fresh one fed the committed tokens is."""
    schema = canonical(JSON_OBJECT_SCHEMA)
    text = tok.encode('{"a": [1, 2, {"b": "xyz"}], "c": true}')
    rng = random.Random(1)
    live = grammars.matcher(schema)
    pos = 0
    while pos < len(text):
        # Committed: text[:pos]; the drafts guess what follows, some of them wrongly.
        k = min(rng.randint(0, 4), len(text) - pos - 1)
        truth = text[pos : pos + k]
        drafts = [t if rng.random() < 0.7 else rng.randrange(len(tok)) for t in truth]
        rows, consumed = live.masks_along(drafts)
        fresh = grammars.matcher(schema)
        fresh.push(text[:pos])
        for j in range(consumed + 1):
            assert torch.equal(rows[j], fresh.allowed()), (pos, j)
            if j < consumed:
                fresh.push([drafts[j]])
        num = 0
        while num < min(consumed, len(truth)) and drafts[num] == truth[num]:
            num += 1
        live.commit(consumed, num, text[pos + num])
        pos += num + 1
        assert live.tokens == text[:pos]


def test_engines_refuse_what_they_cannot_compile(tok, tiny_target, fingerprint, grammars):
    assert schema_problem('{"type": "nope"}')
    assert schema_problem(canonical(SCHEMAS[0])) is None
    verifier = make_verifier(tiny_target, fingerprint, grammars)
    errors, _ = verifier.open([SequenceSpec("x", [1, 2], SamplingParams(), json_schema='{"type": "nope"}')])
    assert errors[0] is not None and "json_schema" in str(errors[0])
    bare = VerifierEngine(BatchedCausalLM(tiny_target, CPU, torch.float32), fingerprint, 8, 512, 8)
    errors, _ = bare.open([SequenceSpec("x", [1, 2], SamplingParams(), json_schema="{}")])
    assert errors[0] is not None


def test_opened_mid_generation_the_grammar_consumes_what_was_generated(tok, tiny_target, fingerprint, grammars):
    """A drafter joins after the first tokens: num_generated of them are output, not prompt."""
    schema = canonical(SCHEMAS[0])
    head = tok.encode('{"name": "')
    verifier = make_verifier(tiny_target, fingerprint, grammars)
    prompt = tok.encode("Hi")
    errors, _ = verifier.open(
        [SequenceSpec("x", prompt + head, SamplingParams(), json_schema=schema, num_generated=len(head))]
    )
    assert errors == [None]
    assert verifier.table.get("x").grammar.tokens == head
    errors, _ = verifier.open(
        [SequenceSpec("y", prompt + tok.encode("[1]"), SamplingParams(), json_schema=schema, num_generated=3)]
    )
    assert errors[0] is not None


def test_gateway_turns_response_format_into_schema_text():
    from gateway.api.validation import InvalidParameter, json_schema

    assert json_schema(None) == "" and json_schema({"type": "text"}) == ""
    assert json.loads(json_schema({"type": "json_object"})) == {"type": "object"}
    schema = {"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"type": "boolean"}}}
    text = json_schema({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}})
    assert list(json.loads(text)["properties"]) == ["z", "a"]  # the schema's order is the output's
    for bad, param in [
        ({"type": "xml"}, "response_format"),
        ({"type": "json_object", "schema": {}}, "response_format"),
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}}, "response_format"),
    ]:
        with pytest.raises(InvalidParameter) as caught:
            json_schema(bad)
        assert caught.value.param == param
    with pytest.raises(InvalidParameter) as caught:
        json_schema({"type": "json_object"}, ignore_eos=True)
    assert caught.value.param == "ignore_eos"
