"""`specd up`'s TLS options, and the links between its children that carry them: the gateway's to
the drafter and the verifier, and the drafter's own to the verifier in the one-hop exchange."""

from __future__ import annotations

import argparse

LOOPBACK = "127.0.0.1"


def add_tls_args(p: argparse.ArgumentParser) -> None:
    """One server certificate (and optionally a client one) for every hop."""
    tls = p.add_argument_group(
        "TLS", "one server certificate for all three services (its names must cover --host or --tls-server-name)"
    )
    tls.add_argument("--tls-cert", default="", help="PEM certificate: every gRPC hop and the HTTP API use TLS")
    tls.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    tls.add_argument("--tls-ca", default="", help="PEM CA that signed --tls-cert (and --tls-client-cert)")
    tls.add_argument(
        "--tls-client-cert",
        default="",
        help="mutual TLS: the gateway's client certificate; drafter and verifier "
        "then refuse clients without a certificate signed by --tls-ca",
    )
    tls.add_argument("--tls-client-key", default="", help="PEM private key of --tls-client-cert")
    tls.add_argument("--tls-server-name", default="", help="name the certificate is checked against; default: --host")


def gateway_backend_tls(args: argparse.Namespace) -> list[str]:
    """The gateway's TLS to the backends."""
    command = []
    if args.tls_ca:
        # The certificate names --host (or --tls-server-name), not the loopback address dialed.
        command += ["--backend-tls-ca", args.tls_ca, "--backend-tls-server-name", args.tls_server_name or args.host]
    if args.tls_client_cert:
        command += ["--backend-tls-cert", args.tls_client_cert, "--backend-tls-key", args.tls_client_key]
    return command


def drafter_delivery(args: argparse.Namespace) -> list[str]:
    """With --exchange direct, the drafter's link to the verifier: as the gateway's, over the same
    certificates (the drafter presents the gateway's client certificate where the verifier asks for one)."""
    if args.exchange != "direct":
        return []
    command = ["--deliver-to", f"{LOOPBACK}:{args.verifier_port}"]
    if args.tls_ca:
        command += ["--deliver-tls-ca", args.tls_ca, "--deliver-tls-server-name", args.tls_server_name or args.host]
    if args.tls_client_cert:
        command += ["--deliver-tls-cert", args.tls_client_cert, "--deliver-tls-key", args.tls_client_key]
    return command
