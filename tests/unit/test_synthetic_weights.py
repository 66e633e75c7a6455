"""`--load-format synthetic`: a target and a drafter of any shape whose greedy tokens agree at a set rate."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tinymodels
import torch

from drafter_service.config import DrafterConfig
from specd import cli
from specd.engine import fused_llama, models, synthetic
from specd.engine.checkpoints import ModelLoadError
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.quant import quantize_copy
from verifier_service.config import VerifierConfig

# Small enough for a quick forward over every position at once, large enough that the measured
# rate has a standard deviation under 0.01 at alpha 0.8.
VOCAB = 4096
CHAIN = 2048


def _directory(tok, tmp_path: Path, name: str, **shape) -> Path:
    """A model directory (config.json and the embedded tokenizer) of a tiny Llama shape."""
    model = tinymodels.build_model(
        0, VOCAB, tok.bos_token_id or 0, tok.eos_token_id, max_position_embeddings=CHAIN, **shape
    )
    return tinymodels.save(model, tok, tmp_path / name)


@pytest.fixture(scope="module")
def target_dir(tok, tmp_path_factory) -> Path:
    return _directory(tok, tmp_path_factory.mktemp("synthetic"), "target")


@pytest.fixture(scope="module")
def drafter_dir(tok, tmp_path_factory) -> Path:
    # Another shape than the target's: narrower and one layer.
    return _directory(
        tok,
        tmp_path_factory.mktemp("synthetic"),
        "drafter",
        layers=1,
        hidden_size=48,
        num_attention_heads=3,
        num_key_value_heads=1,
    )


def _load(path: Path, seed: int, agreement: float = 1.0) -> models.LoadedModel:
    made = synthetic.SyntheticSpec(seed, agreement)
    return models.load_for_serving(str(path), "cpu", "float32", load_format="synthetic", made=made)


def _chain(loaded: models.LoadedModel, start: int) -> torch.Tensor:
    """The target's greedy sequence from token `start`, CHAIN tokens long, from its own successor map."""
    vocab = loaded.model.config.vocab_size
    order = synthetic.cycle(vocab, len(loaded.tokenizer), loaded.fingerprint.end_token_ids, 11)
    nexts = synthetic.successors(vocab, order, synthetic.SyntheticSpec(11))
    tokens = [start]
    for _ in range(CHAIN - 1):
        tokens.append(int(nexts[tokens[-1]]))
    return torch.tensor(tokens)


def _greedy(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens.unsqueeze(0)).logits[0].argmax(-1)


def _probs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.softmax(model(tokens.unsqueeze(0)).logits[0].float(), -1)


@pytest.fixture(scope="module")
def target(target_dir) -> models.LoadedModel:
    return _load(target_dir, 11)


@pytest.mark.parametrize("alpha", [0.6, 0.8, 0.95])
def test_greedy_agreement_is_alpha(target, drafter_dir, alpha: float) -> None:
    drafter = _load(drafter_dir, 11, alpha)
    tokens = _chain(target, start=1000)
    wanted = _greedy(target.model, tokens)
    # The target's greedy tokens are its chain: what a greedy request generates is `tokens`.
    assert torch.equal(wanted[:-1], tokens[1:])
    agreed = float((_greedy(drafter.model, tokens) == wanted).float().mean())
    assert abs(agreed - alpha) <= 0.03, agreed
    sampled = float(torch.minimum(_probs(target.model, tokens), _probs(drafter.model, tokens)).sum(-1).mean())
    # Reported, not held: rejection sampling's acceptance at temperature 1 (sum of min(p, q)).
    print(f"alpha {alpha}: greedy agreement {agreed:.3f}, sampled acceptance at temperature 1 {sampled:.3f}")


def test_weights_are_deterministic_per_seed(target, target_dir) -> None:
    again, other = _load(target_dir, 11), _load(target_dir, 12)
    want = target.model.state_dict()
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    assert not torch.equal(target.model.lm_head.weight, other.model.lm_head.weight)


def test_the_head_is_untied_and_the_weights_named(target, target_dir, caplog) -> None:
    # The tiny Llama ties its head to its embeddings; the synthetic one cannot.
    assert target.model.lm_head.weight.data_ptr() != target.model.model.embed_tokens.weight.data_ptr()
    assert target.weights == "synthetic (seed 11)"
    with caplog.at_level(logging.WARNING):
        drafter = _load(target_dir, 11, 0.8)
    assert drafter.weights == "synthetic (seed 11, agreement 0.8)"
    assert "SYNTHETIC (SEED 11, AGREEMENT 0.8)" in caplog.text and "meaningless" in caplog.text


def test_no_successor_ends_a_sequence(target) -> None:
    vocab = target.model.config.vocab_size
    order = synthetic.cycle(vocab, len(target.tokenizer), target.fingerprint.end_token_ids, 11)
    nexts = synthetic.successors(vocab, order, synthetic.SyntheticSpec(11, 0.5))
    assert not set(target.fingerprint.end_token_ids) & set(nexts.tolist())
    assert sorted(order.tolist()) == sorted(set(range(vocab)) - set(target.fingerprint.end_token_ids))


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_services_forward_keeps_the_successors(target_dir, quantize: str) -> None:
    # As the services run it: fused, and (a CPU drafter's default) quantized to int8.
    loaded = _load(target_dir, 11, 0.8)
    tokens = _chain(loaded, start=7)[:256]
    eager = _greedy(loaded.model, tokens)
    fused = fused_llama.choose(loaded.model, "fused", "drafter")
    if quantize != "none":
        assert quantize_copy(fused, quantize) == quantize
    logits = BatchedCausalLM(fused, torch.device("cpu"), torch.float32).forward([Row(0, 0, tokens.tolist(), 0)])[0]
    assert torch.equal(logits.argmax(-1), eager)


@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan")])
def test_an_agreement_outside_0_to_1_is_refused(alpha: float, capsys) -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        synthetic.SyntheticSpec(0, alpha)
    with pytest.raises(SystemExit):
        DrafterConfig.from_args(["--load-format", "synthetic", "--synthetic-agreement", str(alpha)])
    with pytest.raises(SystemExit):
        cli.up(["--load-format", "synthetic", "--synthetic-agreement", str(alpha)])
    assert "--synthetic-agreement must be between 0 and 1" in capsys.readouterr().err


def test_the_services_take_the_flags() -> None:
    drafter = DrafterConfig.from_args(["--load-format", "synthetic", "--synthetic-agreement", "0.6"])
    assert (drafter.load_format, drafter.synthetic_agreement, drafter.synthetic_seed) == ("synthetic", 0.6, 0)
    verifier = VerifierConfig.from_args(["--load-format", "synthetic", "--synthetic-seed", "5"])
    assert (verifier.load_format, verifier.synthetic_seed) == ("synthetic", 5)
    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--synthetic-agreement", "0.6"])  # the target agrees with itself


def test_layers_that_move_the_argmax_are_refused(target_dir, monkeypatch) -> None:
    # Output projections left large: the residual stream no longer keeps the token's embedding.
    monkeypatch.setattr(synthetic, "OUTPUT_SCALE", 30.0)
    with pytest.raises(ModelLoadError, match="do not hold for llama"):
        _load(target_dir, 11)


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "phi3", "gemma2"])
def test_other_architectures_hold(tok, tmp_path: Path, arch: str) -> None:
    # Gemma-2 normalizes each layer's output before adding it, but into a residual stream whose
    # embedding is scaled by the square root of the hidden size, which still dominates.
    model = tinymodels.build_architecture(arch, 0, 512, tok.bos_token_id or 0, tok.eos_token_id)
    loaded = _load(tinymodels.save(model, tok, tmp_path / arch), 3)
    assert loaded.weights == "synthetic (seed 3)"
