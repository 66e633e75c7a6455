"""Ports are owned: a taken port is found before anything loads, and gRPC servers never share one."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from specd.ports import SERVER_OPTIONS, PortUnavailable, check_free, taken_ports
from specd.rpc.serving import Listen, serve
from specd.rpc.tls import add_port


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


def test_a_service_on_port_0_binds_one_and_writes_it_before_it_loads(tmp_path: Path) -> None:
    port_file = tmp_path / "verifier.port"
    seen: list[int] = []

    async def stop() -> None:  # runs once serving, its signal handlers set
        os.kill(os.getpid(), signal.SIGTERM)

    def load() -> tuple[Any, Any]:
        # The port is the service's before its model loads: the file is there, and the port taken.
        seen.append(int(port_file.read_text()))
        assert taken_ports({"verifier": ("127.0.0.1", seen[0])})
        return (lambda server: []), stop

    asyncio.run(serve("verifier", Listen("127.0.0.1", 0, str(port_file)), 1 << 20, load))
    assert seen and seen[0] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["verifier.port"]  # no partial file left behind


def test_health_check_stays_open_and_watch_needs_the_key() -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from specd.rpc.tls import ApiKeyInterceptor, ApiKeys

    async def run() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[ApiKeyInterceptor(ApiKeys(["k" * 16]))])
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=5):
                        pass
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
                keyed = stub.Watch(health_pb2.HealthCheckRequest(), metadata=(("authorization", "Bearer " + "k" * 16),))
                first = await keyed.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                keyed.cancel()
        finally:
            await server.stop(0)

    asyncio.run(run())
