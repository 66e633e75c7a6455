"""`specd health HOST:PORT`: one gRPC health check, for container and exec probes.

Exits 0 when the service reports SERVING, 1 otherwise (not serving, unreachable,
TLS refused), so `HEALTHCHECK`, compose healthchecks and Kubernetes exec probes
can use it as is, over TLS too (kubelet's native gRPC probe speaks plaintext only).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import configuration
from specd.configuration import field
from specd.rpc.tls import TlsConfigError, channel_credentials, server_name_option


@dataclasses.dataclass(frozen=True)
class HealthConfig:
    service: str = field("", "service name to check; empty checks the server as a whole")
    timeout_s: float = field(3.0, "deadline of the check")
    tls_ca: str = field("", "PEM CA that signed the server's certificate: check over TLS")
    tls_cert: str = field("", "PEM client certificate, for servers that require one (mutual TLS)")
    tls_key: str = field("", "PEM private key of --tls-cert")
    server_name: str = field("", "name the server's certificate is checked against; default: the host")


def check(
    address: str,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str = "",
    service: str = "",
    timeout_s: float = 3.0,
) -> str:
    """The serving status's name (SERVING, NOT_SERVING, ...); raises grpc.RpcError when there is no answer."""
    if credentials is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, credentials, options=server_name_option(server_name))
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="specd health", description="Check a specd service's gRPC health; exit 0 only when SERVING."
    )
    parser.add_argument("address", help="HOST:PORT of a drafter, verifier or gateway (its gRPC port)")
    configuration.add_arguments(parser, HealthConfig, "HEALTH")
    ns = parser.parse_args(argv)
    config = configuration.from_namespace(HealthConfig, ns)
    try:
        credentials = channel_credentials(config.tls_ca, config.tls_cert, config.tls_key)
    except TlsConfigError as exc:
        parser.error(str(exc))
    try:
        status = check(ns.address, credentials, config.server_name, config.service, config.timeout_s)
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "ERROR"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        print(f"{ns.address}: {code}: {details}", file=sys.stderr)
        sys.exit(1)
    print(f"{ns.address}: {status}")
    sys.exit(0 if status == "SERVING" else 1)
