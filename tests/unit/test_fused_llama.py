"""The fused Llama forward computes what transformers' forward computes, through the slot KV
cache, for rows of different lengths, quantized or not; drafter and verifier pick it only for the
models it reproduces, and the verifier's greedy choices do not move."""

from __future__ import annotations

import copy

import pytest
import tinymodels
import torch
from transformers import LlamaForCausalLM

from drafter_service.config import DrafterConfig
from specd.engine import fused_llama
from specd.engine.featurehead import FeatureHeadLM
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.quant import quantize_copy
from verifier_service import server as verifier_server
from verifier_service.config import VerifierConfig


def llama(heads: int = 4, kv_heads: int = 2, bias: bool = False) -> LlamaForCausalLM:
    return tinymodels.build_model(
        0, 96, 1, 2, num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=bias
    )


def rounds(lm: BatchedCausalLM) -> list[torch.Tensor]:
    """A prefill of three sequences of different lengths, then a round that feeds each a different
    number of tokens (padding in the batch), then a one-token step: every row's logits."""
    out = lm.forward([Row(0, 0, list(range(1, 12)), 0), Row(1, 0, list(range(20, 27)), 3), Row(3, 0, [5, 6, 7], 2)])
    out += lm.forward([Row(0, 11, [40, 41, 42, 43], 0), Row(1, 7, [50], 0), Row(3, 3, [60, 61], 1)])
    out += lm.forward([Row(0, 15, [70], 0), Row(1, 8, [71], 0), Row(3, 5, [72], 0)])
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "bias"), [(4, 2, False), (4, 4, False), (4, 1, True)])
def test_the_fused_forward_gives_transformers_logits(heads: int, kv_heads: int, bias: bool) -> None:
    reference = llama(heads, kv_heads, bias)
    assert fused_llama.supports(reference)
    fused = fused_llama.fuse(copy.deepcopy(reference))
    want = rounds(BatchedCausalLM(reference, torch.device("cpu"), torch.float32))
    got = rounds(BatchedCausalLM(fused, torch.device("cpu"), torch.float32))
    assert len(got) == len(want) == 9
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_fused_copy_gives_the_quantized_transformers_logits(kind: str) -> None:
    # Concatenated along the outputs, every output row quantizes as it did alone.
    reference = llama()
    fused = fused_llama.fuse(copy.deepcopy(reference))
    for model in (reference, fused):
        assert quantize_copy(model, kind) == kind
        model.to(torch.bfloat16)
    want = rounds(BatchedCausalLM(reference, torch.device("cpu"), torch.bfloat16))
    got = rounds(BatchedCausalLM(fused, torch.device("cpu"), torch.bfloat16))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0.05, rtol=0.05)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_the_fused_forward_drops_the_separate_products() -> None:
    fused = fused_llama.fuse(llama())
    names = {name.rsplit(".", 1)[-1] for name, _ in fused.named_modules()}
    assert {"qkv_proj", "gate_up_proj", "o_proj", "down_proj"} <= names
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & names


def test_models_it_does_not_reproduce_keep_transformers_forward(tiny_target) -> None:
    feature = FeatureHeadLM.__new__(FeatureHeadLM)
    assert not fused_llama.supports(feature)
    gelu = llama()
    gelu.config.hidden_act = "gelu"
    assert not fused_llama.supports(gelu)
    with pytest.raises(ValueError, match="does not take"):
        fused_llama.fuse(gelu)
    assert fused_llama.choose(gelu, "auto", "drafter") is gelu
    with pytest.raises(ValueError, match="--decoder fused takes a Llama-architecture model"):
        fused_llama.choose(gelu, "fused", "verifier")
    with pytest.raises(ValueError, match="--decoder takes auto, fused, transformers, not 'eager'"):
        fused_llama.choose(gelu, "eager", "verifier")
    target = copy.deepcopy(tiny_target)
    assert fused_llama.choose(target, "transformers", "drafter") is target
    assert isinstance(fused_llama.choose(target, "auto", "drafter"), fused_llama.FusedLlamaForCausalLM)


def test_the_verifier_serves_the_fused_forward_unless_told_otherwise(model_dirs) -> None:
    for decoder, kind in (("auto", fused_llama.FusedLlamaForCausalLM), ("transformers", LlamaForCausalLM)):
        config = VerifierConfig(model=str(model_dirs["target"]), decoder=decoder, max_sequences=2, max_context=64)
        engine, _ = verifier_server.build_engine(config)
        assert type(engine.lm.model) is kind
    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--decoder", "eager"])


def test_float32_verify_rounds_choose_the_same_tokens_fused(tiny_target) -> None:
    # The verifier's rounds: several rows of a few tokens each, every position's logits wanted.
    reference = copy.deepcopy(tiny_target)
    fused = fused_llama.fuse(copy.deepcopy(tiny_target))
    want = rounds(BatchedCausalLM(reference, torch.device("cpu"), torch.float32))
    got = rounds(BatchedCausalLM(fused, torch.device("cpu"), torch.float32))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_decoder_applies_to_model_drafters_only() -> None:
    DrafterConfig(decoder="fused").validate()
    with pytest.raises(ValueError, match="model drafter only"):
        DrafterConfig(drafter="ngram", decoder="fused").validate()


def test_the_fused_copy_of_the_tiny_model_keeps_its_greedy_tokens(tiny_target) -> None:
    # The drafter the integration tests serve: the same greedy continuation either way.
    def greedy(model: object) -> list[int]:
        lm = BatchedCausalLM(model, torch.device("cpu"), torch.float32)
        tokens = [1, 17, 42, 99]
        logits = lm.forward([Row(0, 0, tokens, len(tokens) - 1)])[0]
        for _ in range(12):
            tokens.append(int(logits[-1].argmax()))
            logits = lm.forward([Row(0, len(tokens) - 1, tokens[-1:], 0)])[0]
        return tokens

    assert greedy(fused_llama.fuse(copy.deepcopy(tiny_target))) == greedy(tiny_target)
