"""Frozen service configs from CLI flags, with environment variables as defaults.

Each field of a config dataclass becomes `--field-name`, defaulting to
`$SPECD_<PREFIX>_<FIELD_NAME>` when set, else to the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import Any, TypeVar, get_type_hints

from specd.engine import CUDA_GRAPH_CHOICES, DTYPE_CHOICES, LOAD_FORMAT_CHOICES
from specd.rpc.backend_auth import BACKEND_TOKEN_ENV, exposure_problem

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def env_name(f: dataclasses.Field[Any], env_prefix: str) -> str:
    """The variable a field reads: its own `env` name if it has one (shared by services), else the prefixed one."""
    return f.metadata.get("env") or f"SPECD_{env_prefix}_{f.name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type, env_prefix: str) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        env = env_name(f, env_prefix)
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        parse: Any = {int: int, float: float, bool: _parse_bool, str: str}.get(kind)
        if parse is None:
            parse = _parse_list
        if env in os.environ:
            default = parse(os.environ[env])
        shown = "set" if f.metadata.get("secret") and default else repr(default)
        help_text = f"{f.metadata.get('help', '')} (env {env}; default {shown})"
        if kind is bool:
            parser.add_argument(flag, type=_parse_bool, nargs="?", const=True, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=parse, default=default, help=help_text, choices=f.metadata.get("choices"))


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    config = cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def parse(cls: type[T], env_prefix: str, argv: Sequence[str] | None, prog: str, description: str) -> T:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, cls, env_prefix)
    ns = parser.parse_args(argv)
    try:
        return from_namespace(cls, ns)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def field(default: Any, help: str, choices: Sequence[str] | None = None, secret: bool = False, env: str = "") -> Any:
    """A config field; `secret` keeps its value (say, from the environment) out of --help; `env`
    names a variable that every service reads the same way (one secret for all three)."""
    metadata: dict[str, Any] = {"help": help, "secret": secret, "env": env}
    if choices:
        metadata["choices"] = list(choices)
    if isinstance(default, (list, tuple)):
        return dataclasses.field(default_factory=lambda: tuple(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ModelServiceConfig:
    """What the drafter and verifier services both take; each subclass sets its own defaults."""

    host: str = field("127.0.0.1", "address to listen on")
    port: int = field(0, "gRPC port")
    port_file: str = field(
        "", "write the gRPC port bound to this file, before the model loads (with --port 0: the one the OS picked)"
    )
    model: str = field("embedded", "model: a local HF directory, a .gguf file, or 'embedded'")
    device: str = field("cpu", "torch device, e.g. cpu, cuda, cuda:1")
    dtype: str = field("float32", "activation dtype", choices=DTYPE_CHOICES)
    load_format: str = field(
        "auto",
        "auto: the model's weights; dummy: random weights in the shape of the model's config.json (with its "
        "tokenizer), made on the device, to time a model whose weights are not at hand; its output is meaningless; "
        "synthetic: weights of that shape made so that a drafter and a target of one --synthetic-seed agree on "
        "a set fraction of greedy tokens (the drafter's --synthetic-agreement), their text meaningless",
        LOAD_FORMAT_CHOICES,
    )
    synthetic_seed: int = field(
        0, "--load-format synthetic: the seed of the token cycle; the drafter and the target must share it"
    )
    cuda_graphs: str = field(
        "auto",
        "capture the decode and verify forwards as CUDA graphs per batch bucket (auto: on a CUDA device, "
        "for the fused Llama forward); prefill and other shapes run eagerly; nothing on the CPU",
        CUDA_GRAPH_CHOICES,
    )
    max_sequences: int = field(64, "most sequences open at once")
    max_context: int = field(2048, "most positions per sequence (capped by the model's own limit)")
    max_draft_tokens: int = field(16, "most draft tokens per sequence per round")
    max_message_bytes: int = field(64 * 1024 * 1024, "largest gRPC message accepted or sent")
    lease_s: float = field(
        30.0,
        "free a gateway's sequences when it has sent nothing (rounds, opens, closes, keep-alives) for this "
        "long: it died or was cut off; 0 keeps them until closed",
    )
    recalibrate: bool = field(
        False,
        "time the CPU kernels and steps again, replacing the timings kept for this machine, model and build "
        "(in the cache directory's calibration/; a start reads them instead of timing)",
    )
    threads: int = field(0, "torch intra-op threads; 0 keeps torch's default (with --cpus: one per CPU)")
    cpus: str = field("", "pin the service to these CPUs, e.g. 0 or 2-3 (Linux); empty: no pinning")
    log_level: str = field("INFO", "logging level")
    otlp_endpoint: str = field("", "OTLP gRPC endpoint for traces (also OTEL_EXPORTER_OTLP_ENDPOINT)")
    trace_file: str = field("", "append spans as JSON lines to this file")
    metrics_port: int = field(0, "serve Prometheus metrics over HTTP on this port; 0 disables")
    tls_cert: str = field("", "PEM certificate (chain) to serve gRPC over TLS; empty serves plaintext")
    tls_key: str = field("", "PEM private key of --tls-cert")
    tls_client_ca: str = field("", "PEM CA: require client certificates it signed (mutual TLS); needs --tls-cert")
    backend_token: str = field(
        "",
        "token every call but health checks must carry (authorization: Bearer TOKEN); comma-separated to accept "
        "several while rotating; better from the environment or --backend-token-file than on the command line",
        secret=True,
        env=BACKEND_TOKEN_ENV,
    )
    backend_token_file: str = field("", "file holding the backend token (instead of SPECD_BACKEND_TOKEN)")
    insecure: bool = field(
        False, "allow listening on a non-loopback address with no client authentication (no token, no mutual TLS)"
    )

    def validate(self) -> None:
        from specd.engine.cpus import parse_cpus

        parse_cpus(self.cpus)
        if self.synthetic_seed < 0:
            raise ValueError("synthetic_seed must be >= 0")
        if self.lease_s < 0:
            raise ValueError("lease_s must be >= 0")
        if self.max_sequences < 1 or self.max_context < 2 or self.max_draft_tokens < 0:
            raise ValueError("max_sequences >= 1, max_context >= 2 and max_draft_tokens >= 0 are required")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.backend_token and self.backend_token_file:
            raise ValueError(f"give the backend token once: {BACKEND_TOKEN_ENV} or --backend-token-file, not both")
        authenticated = bool(self.backend_token or self.backend_token_file or self.tls_client_ca)
        problem = exposure_problem(self.host, authenticated, self.insecure)
        if problem:
            raise ValueError(problem)
