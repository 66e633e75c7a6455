"""Ports are owned: a taken port is found before anything loads, and gRPC servers never share one."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from specd.ports import SERVER_OPTIONS, PortUnavailable, check_free, taken_ports
from specd.tls import add_port


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_listening_port_is_reported_taken_and_a_free_one_is_not() -> None:
    with _listener() as held:
        port = held.getsockname()[1]
        taken = taken_ports({"verifier": ("127.0.0.1", port), "off": ("127.0.0.1", 0)})
        assert taken == [f"verifier port 127.0.0.1:{port} (Address already in use)"]
        with pytest.raises(PortUnavailable, match=f"in use by another process: verifier port 127.0.0.1:{port}"):
            check_free({"verifier": ("127.0.0.1", port)})
    assert taken_ports({"verifier": ("127.0.0.1", port)}) == []


def test_a_second_grpc_server_cannot_bind_a_port_the_first_serves() -> None:
    async def run() -> None:
        first = grpc.aio.server(options=SERVER_OPTIONS)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = grpc.aio.server(options=SERVER_OPTIONS)
            # gRPC's default (SO_REUSEPORT on) binds here and takes a share of the first's connections.
            with pytest.raises(PortUnavailable, match=f"cannot listen on 127.0.0.1:{port}"):
                add_port(second, f"127.0.0.1:{port}", None)
            assert taken_ports({"gRPC": ("127.0.0.1", port)})
        finally:
            await first.stop(0)

    asyncio.run(run())
