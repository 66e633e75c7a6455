"""Ports a service owns: found taken before a model loads, and never shared with another listener.

gRPC's servers set SO_REUSEPORT by default, which lets a second process bind a live port and take
a share of its new connections; the servers here turn it off (`SERVER_OPTIONS`), so a second
service on a taken port fails to bind instead, and these checks say so before anything loads.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SERVER_OPTIONS: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]


class PortUnavailable(OSError):
    """A port this service needs is held by another process (or cannot be bound at all)."""


def taken_ports(wanted: Mapping[str, tuple[str, int]]) -> list[str]:
    """Which of the named (host, port) pairs cannot be bound here, each with the reason: binding each
    as a server would (SO_REUSEADDR, which on Linux never lets two listeners share a port)."""
    taken = []
    for name, (host, port) in wanted.items():
        if not port:
            continue  # 0: the service picks a free one, or does not listen
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host.strip("[]"), port))
            except OSError as exc:
                taken.append(f"{name} port {host}:{port} ({exc.strerror or exc})")
    return taken


def check_free(wanted: Mapping[str, tuple[str, int]]) -> None:
    """Raise PortUnavailable naming every port of `wanted` another process holds."""
    if taken := taken_ports(wanted):
        raise PortUnavailable(f"in use by another process: {'; '.join(taken)}")


def write_port_file(path: str, port: int) -> None:
    """Write the port a service bound to `path`, whole or not at all: a reader polling for the
    file never sees it half written."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    partial.write_text(f"{port}\n")
    partial.replace(target)
