"""A verdict whose token its own grammar refuses fails that sequence alone, with what its row held:
the one CUDA-only failure seen (docs/measurements.md, "Measured on a GPU") reported only the token."""

from __future__ import annotations

import torch
from tinymodels import device_under_test, on_test_device

from specd.engine.grammar import JSON_OBJECT_SCHEMA, canonical
from specd.engine.kvcache import BatchedCausalLM
from specd.engine.params import SamplingParams
from specd.engine.tasks import SequenceSpec, VerifyTask
from verifier_service.engine import VerifierEngine


def test_a_refused_token_is_reported_with_its_row(tok, tiny_target, fingerprint, grammars, monkeypatch) -> None:
    lm = BatchedCausalLM(on_test_device(tiny_target), device_under_test(), torch.float32)
    engine = VerifierEngine(lm, fingerprint, 8, 512, 8, grammars)
    greedy = SamplingParams(temperature=0.0)
    schema = canonical(JSON_OBJECT_SCHEMA)
    prompt = tok.encode("JSON:")
    specs = [SequenceSpec("bad", prompt, greedy, json_schema=schema), SequenceSpec("good", prompt, greedy)]
    assert engine.open(specs)[0] == [None, None]
    refused = tok.encode("x")[0]  # a JSON object cannot start with it
    real = VerifierEngine._greedy_tokens

    def wrong_first(live, adjusted):
        out = real(live, adjusted)
        out[0] = [refused]
        return out

    monkeypatch.setattr(VerifierEngine, "_greedy_tokens", staticmethod(wrong_first))
    bad, good = engine.verify([VerifyTask("bad", len(prompt), []), VerifyTask("good", len(prompt), [])])[0]
    assert good.error is None and bad.error is not None
    message = bad.error.message
    assert f"token {refused} is not allowed" in message
    assert "row 0 of 1, masked logit -inf" in message and "tokens allowed" in message
    assert "raw logits not finite" in message and "masked argmax" in message
