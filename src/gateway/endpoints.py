"""Backend endpoints: `host:port`, or `dns:///name:port` for every address the name resolves to."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

DNS_SCHEME = "dns:///"

# host, port -> the addresses it resolves to (loop.getaddrinfo in production; fakes in tests).
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Endpoint:
    """One entry of --verifier / --drafter: a fixed address, or a name to resolve."""

    host: str
    port: int
    dns: bool = False

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoints(spec: str) -> list[Endpoint]:
    """`a:1,b:2,dns:///svc:3` -> endpoints; ValueError names a malformed entry."""
    endpoints = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        dns = entry.startswith(DNS_SCHEME)
        rest = entry[len(DNS_SCHEME) :] if dns else entry
        host, sep, port = rest.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise ValueError(f"bad backend endpoint {entry!r}: expected host:port or {DNS_SCHEME}name:port")
        endpoints.append(Endpoint(host, int(port), dns))
    return endpoints


async def resolve_host(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(str(info[4][0]), port) for info in infos})
