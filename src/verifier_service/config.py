"""Verifier configuration: CLI flags with SPECD_VERIFIER_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd import configuration
from specd.configuration import field
from specd.models import DTYPES


@dataclass(frozen=True)
class VerifierConfig:
    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(50052, "gRPC port")
    model: str = field("embedded", "target model: a local HF directory, a .gguf file, or 'embedded'")
    device: str = field("cpu", "torch device, e.g. cpu, cuda, cuda:1")
    dtype: str = field("float32", "activation/weight dtype", choices=list(DTYPES))
    max_sequences: int = field(64, "most sequences open at once")
    max_context: int = field(2048, "most positions per sequence (capped by the model's own limit)")
    max_draft_tokens: int = field(16, "most draft tokens per sequence per round")
    max_message_bytes: int = field(64 * 1024 * 1024, "largest gRPC message accepted or sent")
    threads: int = field(0, "torch intra-op threads; 0 keeps torch's default")
    log_level: str = field("INFO", "logging level")
    otlp_endpoint: str = field("", "OTLP gRPC endpoint for traces (also OTEL_EXPORTER_OTLP_ENDPOINT)")
    trace_file: str = field("", "append spans as JSON lines to this file")
    metrics_port: int = field(0, "serve Prometheus metrics over HTTP on this port; 0 disables")

    def validate(self) -> None:
        if self.max_sequences < 1 or self.max_context < 2 or self.max_draft_tokens < 0:
            raise ValueError("max_sequences >= 1, max_context >= 2 and max_draft_tokens >= 0 are required")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> VerifierConfig:
        return configuration.parse(cls, "VERIFIER", argv, "specd verifier", "Run the verifier service.")
