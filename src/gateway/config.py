"""Gateway configuration: CLI flags with SPECD_GATEWAY_* environment defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.endpoints import parse_endpoints
from gateway.round.speculation import HEURISTICS, PolicyConfig
from specd import configuration
from specd.configuration import field
from specd.rpc.backend_auth import BACKEND_TOKEN_ENV


@dataclass(frozen=True)
class GatewayConfig:
    host: str = field("127.0.0.1", "address to listen on (HTTP and gRPC)")
    http_port: int = field(8000, "OpenAI-compatible HTTP port")
    grpc_port: int = field(50050, "gRPC GatewayService port; 0 disables it")
    verifier: str = field(
        "127.0.0.1:50052",
        "verifier replicas: comma-separated host:port, or dns:///NAME:PORT for every address NAME resolves to "
        "(a headless Service); each sequence stays on one replica, new ones go to the least loaded healthy one",
    )
    drafter: str = field(
        "127.0.0.1:50051", "drafter replicas, as --verifier (placed independently of it); empty serves target-only"
    )
    backend_health_interval_s: float = field(
        1.5, "seconds between health checks of each replica; a failed one takes no new sequences until it passes"
    )
    backend_resolve_interval_s: float = field(10.0, "seconds between re-resolving dns:/// backend names")
    tokenizer: str = field("embedded", "tokenizer of the target: a local HF directory, a .gguf file, or 'embedded'")
    served_model_name: str = field("", "model name in the API; default: derived from --tokenizer")
    num_speculative_tokens: int = field(4, "most draft tokens per sequence per round (k); 0 is target-only")
    speculative_mode: str = field(
        "auto",
        "auto: choose k per sequence and round (0..k) for the most tokens/s from measured acceptance and costs; "
        "fixed: always k",
        ["auto", "fixed"],
    )
    pipeline: str = field(
        "sequential",
        "how drafting is scheduled against the verifier: sequential (draft, then verify), cohort (two cohorts of "
        "sequences, one drafted while the other is verified), ahead (the next block drafted while this one is "
        "verified, assuming it is accepted) or auto (the speculation policy picks one of the three each round, "
        "with k, from measured costs)",
        ["sequential", "cohort", "ahead", "auto"],
    )
    speculative_siblings: int = field(
        0,
        "token trees: the most alternative drafts (siblings) beside each block's chain, leaves at the positions "
        "the drafter is least sure of, checked in the same verify; auto mode picks 0..this per round from the "
        "measured hit rate and verify costs (docs/pipeline.md, token trees), fixed mode sends this many; capped "
        "by each round's k; 0: chains only",
    )
    speculative_branches: int = field(
        0,
        "fan-out draft-ahead: the most other blocks each draft-ahead drafts beside its main one, each after "
        "another likely verdict on the block being verified (a draft rejected, or another token after it), so "
        "that a missed guess still finds a block ready; auto mode picks 0..this per round from the measured "
        "branch hit rate and draft costs (docs/pipeline.md, fan-out draft-ahead), fixed mode asks this many; "
        "at most 8; only the ahead pipeline fans out; 0: one block",
    )
    drafter_overlap: bool = field(
        True,
        "run the drafter's exchanges of a round (draft-ahead, the other cohort's drafts, its prefill of joining "
        "sequences) while the verifier works; false: after it, for a drafter and a verifier that share cores, "
        "whose threads would otherwise fight over them (specd up sets it for its shared placement)",
    )
    exchange: str = field(
        "gateway",
        "how a round's drafts reach the verifier: gateway (the drafter answers the gateway, which sends them on "
        "with the verify: two exchanges on a round's path) or direct (the one-hop exchange: the gateway sends "
        "both their part of a round at once, and the drafter sends its drafts to the verifier itself, which "
        "needs a drafter started with --deliver-to that verifier; one replica of each). Direct runs the "
        "sequential rounds; token trees, fan-outs and draft-ahead rounds take the gateway exchange "
        "(docs/architecture.md, one hop per round)",
        ["gateway", "direct"],
    )
    speculative_disable_by_batch_size: int = field(
        0, "no drafting in rounds with at least this many sequences (vLLM's meaning); 0 never disables"
    )
    policy_off: str = field(
        "",
        "comma-separated heuristics of the auto policy to switch off, for an A/B run beside a default gateway "
        "(specd bench --server; docs/pipeline.md): " + ", ".join(HEURISTICS),
    )
    max_batch: int = field(32, "most sequences in one round")
    prefill_chunk_tokens: int = field(
        0,
        "prompt tokens the verifier prefills per round, in chunks interleaved with the running sequences' "
        "rounds, so a long prompt delays them by at most one chunk a round; 0 prefills each prompt whole at "
        "its open (the default: see docs/architecture.md, chunked prefill). The drafter always prefills what "
        "fits behind a verify, at most this many tokens when set",
    )
    backend_timeout_s: float = field(60.0, "deadline for each verifier call and round exchange")
    drafter_timeout_s: float = field(
        5.0, "deadline for each drafter call and round; past it the gateway continues target-only"
    )
    request_timeout_s: float = field(600.0, "a request not finished by then fails (HTTP 504); 0 disables")
    max_n: int = field(8, "most choices one request may ask for (n) or generate (best_of); each is its own sequence")
    tool_call_parser: str = field(
        "",
        "reads tool calls out of the model's text, which tool_choice \"auto\" (OpenAI's default with tools) needs: "
        'hermes: <tool_call> blocks of JSON, as Qwen2.5, Qwen3 and Hermes 2 Pro write them; empty: "auto" is a 400 '
        '(a named function and "required" are forced by grammar and need no parser)',
        ["", "hermes"],
    )
    chat_template: str = field(
        "",
        "a Jinja chat template file served instead of the tokenizer's (as vLLM's --chat-template): for a model "
        'whose own template does not render tools, which tool_choice "auto" needs',
    )
    json_undeclared_keys: bool = field(
        False,
        "structured output (response_format json_schema, forced tool calls, gRPC json_schema): true lets a JSON "
        "object hold keys its schema does not declare unless the schema forbids them (additionalProperties: "
        "false), as JSON Schema reads; false (the default, as vLLM's): an object that lists its properties holds "
        "only those unless its schema allows others explicitly (additionalProperties or unevaluatedProperties)",
    )
    per_request_spec_decode_metrics: str = field(
        "off",
        "per-request speculation statistics in each response's metrics.speculative_decoding (vLLM's flag and "
        "shape; the last chunk of a stream): summary, or detailed (adds every step's drafted and accepted counts)",
        ["off", "summary", "detailed"],
    )
    max_waiting: int = field(256, "requests waiting for a batch slot beyond which new ones get HTTP 429; 0 = no limit")
    http_max_body_bytes: int = field(
        8 * 1024 * 1024, "largest HTTP request body; a larger one gets 413 before it is read (or as soon as it is)"
    )
    http_read_timeout_s: float = field(
        30.0, "seconds a client has to send a request's headers, and again its body, before the connection is closed"
    )
    http_max_connections: int = field(
        1024, "most open HTTP connections and requests; beyond it new requests get 503; 0 = no limit"
    )
    max_sequences_per_key: int = field(
        0,
        "most sequences one client holds at once, waiting or running (a request with n choices holds n): its API key, "
        "or its address where the gateway has no keys; beyond it new requests get HTTP 429; 0 = no limit",
    )
    rate_limit: float = field(0.0, "requests per second per API key (Authorization: Bearer); 0 disables")
    shutdown_grace_s: float = field(10.0, "on SIGTERM, how long in-flight requests may take to finish")
    connect_timeout_s: float = field(300.0, "how long to wait for the backends at startup")
    max_message_bytes: int = field(64 * 1024 * 1024, "largest gRPC message accepted or sent")
    log_level: str = field("INFO", "logging level")
    log_stats_interval_s: float = field(10.0, "seconds between speculation summary log lines; 0 disables them")
    otlp_endpoint: str = field("", "OTLP gRPC endpoint for traces (also OTEL_EXPORTER_OTLP_ENDPOINT)")
    trace_file: str = field("", "append spans as JSON lines to this file")
    tls_cert: str = field("", "PEM certificate (chain): serve the HTTP and gRPC APIs over TLS")
    tls_key: str = field("", "PEM private key of --tls-cert")
    api_key: tuple[str, ...] = field(
        (), "comma-separated API keys: HTTP and gRPC callers must send 'Authorization: Bearer KEY'", secret=True
    )
    backend_tls_ca: str = field("", "PEM CA that signed the drafter's and verifier's certificates: TLS to both")
    backend_tls_cert: str = field("", "PEM client certificate for the backends (mutual TLS); needs --backend-tls-ca")
    backend_tls_key: str = field("", "PEM private key of --backend-tls-cert")
    backend_token: str = field(
        "",
        "token sent to the drafters and verifiers (authorization: Bearer TOKEN); of a comma-separated list, the "
        "first; better from the environment or --backend-token-file than on the command line",
        secret=True,
        env=BACKEND_TOKEN_ENV,
    )
    backend_token_file: str = field("", "file holding the backend token (instead of SPECD_BACKEND_TOKEN)")
    backend_tls_server_name: str = field("", "name the backends' certificates are checked against; default: the host")

    @property
    def heuristics_off(self) -> frozenset[str]:
        return frozenset(h.strip() for h in self.policy_off.split(",") if h.strip())

    def validate(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("speculative_disable_by_batch_size must be >= 0")
        PolicyConfig(off=self.heuristics_off)  # raises ValueError naming an unknown one
        if self.backend_health_interval_s <= 0 or self.backend_resolve_interval_s <= 0:
            raise ValueError("backend_health_interval_s and backend_resolve_interval_s must be > 0")
        parse_endpoints(self.verifier)  # raises ValueError naming a malformed entry
        parse_endpoints(self.drafter)
        if not parse_endpoints(self.verifier):
            raise ValueError("--verifier needs at least one endpoint")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if not self.drafter_overlap and self.pipeline in ("cohort", "ahead"):
            raise ValueError(
                f"--pipeline {self.pipeline} overlaps the drafter with the verifier: it needs --drafter-overlap"
            )
        if self.exchange == "direct" and (problem := one_hop_problem(self.verifier, self.drafter)):
            raise ValueError(f"--exchange direct {problem}")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if bool(self.backend_tls_cert) != bool(self.backend_tls_key):
            raise ValueError("--backend-tls-cert and --backend-tls-key go together")
        if self.backend_tls_cert and not self.backend_tls_ca:
            raise ValueError("--backend-tls-cert (mutual TLS) needs --backend-tls-ca")
        if self.backend_token and self.backend_token_file:
            raise ValueError(f"give the backend token once: {BACKEND_TOKEN_ENV} or --backend-token-file, not both")
        if self.drafter_timeout_s <= 0 or self.backend_timeout_s <= 0:
            raise ValueError("drafter_timeout_s and backend_timeout_s must be > 0")
        if self.http_max_body_bytes < 1 or self.http_read_timeout_s <= 0 or self.http_max_connections < 0:
            raise ValueError("http_max_body_bytes >= 1, http_read_timeout_s > 0 and http_max_connections >= 0")
        if self.max_n < 1:
            raise ValueError("max_n must be >= 1")
        if self.max_sequences_per_key < 0:
            raise ValueError("max_sequences_per_key must be >= 0")
        if self.max_waiting < 0 or self.request_timeout_s < 0 or self.rate_limit < 0 or self.shutdown_grace_s < 0:
            raise ValueError("max_waiting, request_timeout_s, rate_limit and shutdown_grace_s must be >= 0")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> GatewayConfig:
        return configuration.parse(cls, "GATEWAY", argv, "specd gateway", "Run the gateway.")


def one_hop_problem(verifier: str, drafter: str) -> str:
    """Why the one-hop exchange cannot run against these backends ("" if it can): the drafter
    delivers to the one verifier it was started with."""
    endpoints = parse_endpoints(verifier), parse_endpoints(drafter)
    if not endpoints[1]:
        return "needs a drafter"
    if any(len(e) != 1 or e[0].dns for e in endpoints):
        return "needs one drafter and one verifier, each at one host:port (the drafter delivers to one verifier)"
    return ""
