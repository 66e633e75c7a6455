"""Drafter configuration: CLI flags with SPECD_DRAFTER_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd import configuration
from specd.configuration import field
from specd.models import DTYPES


@dataclass(frozen=True)
class DrafterConfig:
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(50051, "gRPC port")
    drafter: str = field("model", "proposer: a draft model, or model-free n-gram prompt lookup", ["model", "ngram"])
    model: str = field("embedded", "draft model: a local HF directory, a .gguf file, or 'embedded'")
    device: str = field("cpu", "torch device, e.g. cpu, cuda:0")
    dtype: str = field("bfloat16", "activation dtype of the draft model", choices=list(DTYPES))
    quantize: str = field(
        "auto", "weight quantization: int8 weight-only (CPU), none, or auto (int8 on CPU)", ["auto", "int8", "none"]
    )
    max_sequences: int = field(64, "most sequences open at once")
    max_context: int = field(2048, "most positions per sequence (capped by the model's own limit)")
    max_draft_tokens: int = field(16, "most tokens proposed per sequence per round")
    max_support: int = field(32, "tokens kept in each sampled draft distribution sent to the verifier")
    ngram_min: int = field(1, "shortest suffix n-gram the n-gram drafter matches")
    ngram_max: int = field(4, "longest suffix n-gram the n-gram drafter matches")
    max_message_bytes: int = field(64 * 1024 * 1024, "largest gRPC message accepted or sent")
    threads: int = field(0, "torch intra-op threads; 0 keeps torch's default")
    log_level: str = field("INFO", "logging level")
    otlp_endpoint: str = field("", "OTLP gRPC endpoint for traces (also OTEL_EXPORTER_OTLP_ENDPOINT)")
    trace_file: str = field("", "append spans as JSON lines to this file")
    metrics_port: int = field(0, "serve Prometheus metrics over HTTP on this port; 0 disables")

    def validate(self) -> None:
        if self.max_sequences < 1 or self.max_context < 2 or self.max_draft_tokens < 0:
            raise ValueError("max_sequences >= 1, max_context >= 2 and max_draft_tokens >= 0 are required")
        if self.max_support < 1:
            raise ValueError("max_support must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("1 <= ngram_min <= ngram_max is required")

    @property
    def quantization(self) -> str:
        if self.quantize != "auto":
            return self.quantize
        return "int8" if self.device == "cpu" else "none"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> DrafterConfig:
        return configuration.parse(cls, "DRAFTER", argv, "specd drafter", "Run the drafter service.")
