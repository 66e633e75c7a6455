"""Verifier configuration: CLI flags with SPECD_VERIFIER_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd import configuration
from specd.configuration import ModelServiceConfig, field
from specd.engine import DECODER_CHOICES


@dataclass(frozen=True)
class VerifierConfig(ModelServiceConfig):
    port: int = field(50052, "gRPC port")
    model: str = field("embedded", "target model: a local HF directory, a .gguf file, or 'embedded'")
    dtype: str = field(
        "float32", "dtype of the target (float32 keeps greedy output exact)", ["float32", "bfloat16", "float16"]
    )
    decoder: str = field(
        "auto",
        "the target's forward: fused (q/k/v and gate/up each one product, without transformers' per-layer "
        "work: a cheaper step, the same for target-only and speculative rounds; Llama-architecture models), "
        "transformers, or auto: fused where the model takes it",
        DECODER_CHOICES,
    )

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> VerifierConfig:
        return configuration.parse(cls, "VERIFIER", argv, "specd verifier", "Run the verifier service.")
