from __future__ import annotations

from collections.abc import Callable

import pytest
import tinymodels
import torch

from drafter_service.engine import ModelDrafter
from drafter_service.ngram_engine import NgramDrafter
from drafter_service.suffix_engine import SuffixDrafter
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.grammar import GrammarCompiler
from specd.engine.kvcache import BatchedCausalLM
from verifier_service.engine import VerifierEngine

DEVICE = tinymodels.device_under_test()


@pytest.fixture(scope="session")
def fingerprint(tok) -> TokenizerFingerprint:
    return TokenizerFingerprint.of(tok)


@pytest.fixture(scope="session")
def vocab_size(tiny_target) -> int:
    return int(tiny_target.config.vocab_size)


@pytest.fixture(scope="session")
def close_draft(tiny_target):
    """A drafter that agrees with tiny_target on most greedy tokens (tiny_draft on none)."""
    return tinymodels.perturbed(tiny_target, 0.02, seed=3)


@pytest.fixture
def make_verifier(tiny_target, fingerprint) -> Callable[..., VerifierEngine]:
    def make(max_sequences: int = 8, max_context: int = 512, max_draft_tokens: int = 8) -> VerifierEngine:
        lm = BatchedCausalLM(tinymodels.on_test_device(tiny_target), DEVICE, torch.float32)
        return VerifierEngine(lm, fingerprint, max_sequences, max_context, max_draft_tokens)

    return make


@pytest.fixture
def make_drafter(tiny_draft, fingerprint) -> Callable[..., ModelDrafter]:
    def make(
        max_sequences: int = 8,
        max_context: int = 512,
        max_draft_tokens: int = 8,
        max_support: int = 16,
        model=None,
        branch_slots: int = -1,
    ) -> ModelDrafter:
        lm = BatchedCausalLM(tinymodels.on_test_device(tiny_draft if model is None else model), DEVICE, torch.float32)
        return ModelDrafter(
            lm, fingerprint, max_sequences, max_context, max_draft_tokens, max_support, branch_slots=branch_slots
        )

    return make


@pytest.fixture
def make_ngram(vocab_size) -> Callable[..., NgramDrafter]:
    def make(
        max_sequences: int = 8, max_context: int = 512, max_draft_tokens: int = 8, min_n: int = 1, max_n: int = 4
    ) -> NgramDrafter:
        return NgramDrafter(vocab_size, max_sequences, max_context, max_draft_tokens, min_n, max_n)

    return make


@pytest.fixture
def make_suffix(vocab_size) -> Callable[..., SuffixDrafter]:
    def make(
        max_sequences: int = 8, max_context: int = 512, max_draft_tokens: int = 8, depth: int = 16, responses: int = 32
    ) -> SuffixDrafter:
        return SuffixDrafter(vocab_size, max_sequences, max_context, max_draft_tokens, depth, responses)

    return make


@pytest.fixture(scope="session")
def grammars(tok, tiny_target) -> GrammarCompiler:
    """Grammar compilation for the tiny models' vocabulary (structured-output tests)."""
    return GrammarCompiler(tok, int(tiny_target.config.vocab_size))


@pytest.fixture(scope="session")
def kernel():
    """The gemv kernel (specd.engine.gemv), built and loaded; skips where it cannot be."""
    from specd.engine import gemv

    loaded = gemv.load()
    if loaded is None:
        pytest.skip("the gemv kernel cannot be built here (no C compiler, or not Linux on x86-64 with AVX2/FMA)")
    return loaded
