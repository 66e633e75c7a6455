"""Drafter configuration: CLI flags with SPECD_DRAFTER_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd import configuration
from specd.configuration import ModelServiceConfig, field
from specd.engine import ACTIVATION_CHOICES, DECODER_CHOICES, DTYPE_CHOICES


@dataclass(frozen=True)
class DrafterConfig(ModelServiceConfig):
    port: int = field(50051, "gRPC port")
    model: str = field(
        "embedded",
        "draft model: a local HF directory, a drafter from specd distill, a .gguf file, 'embedded' (the target "
        "itself), or 'embedded-drafter' (the drafter distilled for it)",
    )
    dtype: str = field(
        "auto",
        "activation dtype of the draft model; auto: float32 for an unquantized model on the CPU (a distilled "
        "drafter, or the target's own 4-bit blocks read through the CPU kernel), else bfloat16",
        ["auto", *DTYPE_CHOICES],
    )
    drafter: str = field(
        "model",
        "proposer: a draft model; model-free n-gram prompt lookup; or the model-free suffix drafter (the "
        "likeliest continuations of the longest match in a trie over the sequence's own text and one over its "
        "tenant's latest responses, SuffixDecoding)",
        ["model", "ngram", "suffix"],
    )
    quantize: str = field(
        "auto",
        "weight quantization (CPU): int8 or int4 weight-only, none, or auto: on the CPU, where the weights "
        "are 4-bit already (a Q4_1 GGUF, the embedded target), none with float32 activations, their exact "
        "blocks read through the CPU kernel (int4 where --dtype is bfloat16 or the kernel cannot be built), "
        "else int8; none for a distilled drafter or on a GPU",
        ["auto", "int8", "int4", "none"],
    )
    int8_wide_rows: int = field(
        -1,
        "quantized (int8 or int4) drafter: from how many rows (prompt tokens or batched sequences) a forward "
        "uses bfloat16 copies of the weights instead of the quantized kernel; -1 measures which is faster "
        "at start-up, 0 never",
    )
    decoder: str = field(
        "auto",
        "the draft model's forward: fused (q/k/v and gate/up each one product, without transformers' per-layer "
        "work: a cheaper draft step; Llama-architecture models), transformers, or auto: fused where the model "
        "takes it",
        DECODER_CHOICES,
    )
    activations: str = field(
        "float32",
        "model drafter reading exact 4- or 8-bit weight blocks through the CPU kernel: float32 activations, or "
        "int8: each activation row quantized to 8 bits per block of 32 and summed in integers (AVX-512 VNNI, or "
        "AVX2 with the same bits; refused without either), cheaper draft steps whose outputs differ from float32's "
        "by that rounding",
        ACTIVATION_CHOICES,
    )
    max_support: int = field(32, "tokens kept in each sampled draft distribution sent to the verifier")
    branch_slots: int = field(
        -1,
        "KV slots beside the sequences' own for fan-out draft-ahead branches (DraftTask.num_branches), each "
        "kept until its sequence's next round; a round out of them drafts fewer branches. -1: as many as "
        "--max-sequences on the CPU (pages are backed as written), a quarter as many on a GPU (the slots are "
        "reserved up front); 0: no branches",
    )
    synthetic_agreement: float = field(
        0.8,
        "--load-format synthetic: the fraction of tokens whose greedy successor the drafter shares with the "
        "target's (0 to 1)",
    )
    ngram_min: int = field(1, "shortest suffix n-gram the n-gram drafter matches")
    ngram_max: int = field(4, "longest suffix n-gram the n-gram drafter matches")
    suffix_depth: int = field(
        16, "suffix drafter: longest substring its tries count (a match is at most one token shorter)"
    )
    suffix_responses: int = field(
        32, "suffix drafter: responses kept per tenant (API key) in its global trie, the least recent dropped"
    )
    suffix_tenants: int = field(16, "suffix drafter: tenants whose global tries it keeps, the least recent dropped")
    suffix_factor: float = field(
        2.0, "suffix drafter: the most drafts per token of the match they continue (a short match drafts little)"
    )
    suffix_min_prob: float = field(
        0.1, "suffix drafter: no draft whose estimated probability (its path's frequencies multiplied) is below this"
    )

    deliver_to: str = field(
        "",
        "the one-hop exchange (the gateway's --exchange direct): the verifier (host:port) this drafter sends a "
        "round's drafts to itself when the round asks, authenticated with the first --backend-token; empty: none",
    )
    deliver_tls_ca: str = field("", "PEM CA that signed the --deliver-to verifier's certificate: TLS to it")
    deliver_tls_cert: str = field("", "PEM client certificate for the --deliver-to verifier (mutual TLS)")
    deliver_tls_key: str = field("", "PEM private key of --deliver-tls-cert")
    deliver_tls_server_name: str = field("", "name the verifier's certificate is checked against; default: its host")

    def validate(self) -> None:
        super().validate()
        client_cert = bool(self.deliver_tls_cert), bool(self.deliver_tls_key)
        if client_cert[0] != client_cert[1] or (self.deliver_tls_cert and not self.deliver_tls_ca):
            raise ValueError("--deliver-tls-cert and --deliver-tls-key go together, and need --deliver-tls-ca")
        if (self.deliver_tls_ca or self.deliver_tls_server_name) and not self.deliver_to:
            raise ValueError("the --deliver-tls-* options apply to --deliver-to, which is not set")
        if not 0.0 <= self.synthetic_agreement <= 1.0:
            raise ValueError(f"synthetic_agreement must be between 0 and 1, not {self.synthetic_agreement}")
        if self.max_support < 1:
            raise ValueError("max_support must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("1 <= ngram_min <= ngram_max is required")
        if self.suffix_depth < 2 or self.suffix_responses < 0 or self.suffix_tenants < 1:
            raise ValueError("suffix_depth must be >= 2, suffix_responses >= 0 and suffix_tenants >= 1")
        if self.suffix_factor <= 0 or not 0 <= self.suffix_min_prob <= 1:
            raise ValueError("suffix_factor must be > 0 and suffix_min_prob in [0, 1]")
        if self.branch_slots < -1:
            raise ValueError("branch_slots must be -1 (as many as max_sequences), 0 (none) or a number of slots")
        if self.int8_wide_rows < -1:
            raise ValueError("int8_wide_rows must be -1 (measure), 0 (never) or a number of rows")
        if self.activations != "float32" and (self.drafter != "model" or self.quantize not in ("auto", "none")):
            raise ValueError("--activations int8 applies to a model drafter whose weights are not re-quantized")
        if self.decoder != "auto" and self.drafter != "model":
            raise ValueError("--decoder applies to a model drafter only")
        if self.int8_wide_rows != -1 and (self.drafter != "model" or self.quantization == "none"):
            raise ValueError("int8_wide_rows applies to a quantized model drafter only (--quantize int8 or int4)")

    @property
    def quantization(self) -> str:
        """int8, int4, none, or auto-cpu: int4 or int8 once the weights show whether they are 4-bit."""
        if self.quantize != "auto":
            return self.quantize
        return "auto-cpu" if self.device == "cpu" else "none"

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> DrafterConfig:
        return configuration.parse(cls, "DRAFTER", argv, "specd drafter", "Run the drafter service.")
