"""Verifier configuration: CLI flags with SPECD_VERIFIER_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd import configuration
from specd.configuration import ModelServiceConfig, field
from specd.engine import AUTO_ACTIVATION_CHOICES, DECODER_CHOICES


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
    activations: str = field(
        "auto",
        "what the CPU kernel multiplies the target's exact 4- and 8-bit weight blocks (a Q4_1/Q8_0 GGUF, the "
        "embedded target) by: float32 activations; int8: each activation row quantized to 8 bits per block "
        "of 32 and summed in integers, as llama.cpp computes such blocks (AVX-512 VNNI, or AVX2 with the same "
        "bits; refused without either), a cheaper step and a far cheaper verify whose outputs differ from "
        "float32's by that rounding; auto: int8 where it can run (a fused forward on the CPU reading exact "
        "blocks), else float32. Either keeps a verify's logits bitwise its steps'",
        AUTO_ACTIVATION_CHOICES,
    )

    def validate(self) -> None:
        super().validate()
        if self.activations == "int8" and (self.dtype != "float32" or self.device != "cpu"):
            raise ValueError("--activations int8 takes the CPU kernel: --device cpu and --dtype float32")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> VerifierConfig:
        return configuration.parse(cls, "VERIFIER", argv, "specd verifier", "Run the verifier service.")
