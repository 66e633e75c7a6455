"""Start real drafter, verifier and gateway processes on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

HOST = "127.0.0.1"


# Below Linux's ephemeral range (32768 on), where the OS never hands a port to an outgoing
# connection; each pytest-xdist worker takes its own stretch, so no two workers offer one port.
PORTS_FROM, PORTS_PER_WORKER = 10000, 2000
_next_port = PORTS_FROM + PORTS_PER_WORKER * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_last_port = _next_port + PORTS_PER_WORKER


def free_port() -> int:
    """A port of this worker's stretch that is free now and was not handed out before in this run."""
    global _next_port
    while _next_port < _last_port:
        port, _next_port = _next_port, _next_port + 1
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue  # taken by something else on this machine
            return port
    raise RuntimeError(f"this test worker handed out all {PORTS_PER_WORKER} of its ports")


POLL_BACKOFF = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
]


def wait_grpc_healthy(address: str, proc: subprocess.Popen | Forked, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    # gRPC's default reconnect backoff grows to seconds while the port is still closed, which would
    # add that much to every start-up a test waits for.
    with grpc.insecure_channel(address, options=POLL_BACKOFF) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout_s}s")


@dataclass
class Service:
    name: str
    proc: subprocess.Popen | Forked
    known_port: int  # 0: not read yet from `port_file`
    log: Path
    grpc_port: int = 0  # the gateway's gRPC port
    port_file: Path | None = None  # where a backend started with --port 0 writes the port it bound

    @property
    def port(self) -> int:
        if not self.known_port and self.port_file is not None:
            self.known_port = read_port_file(self.port_file, self.proc, self.log)
        return self.known_port

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop_all([self])


def read_port_file(path: Path, proc: subprocess.Popen | Forked, log: Path, timeout_s: float = 120.0) -> int:
    """The port a service wrote to `path` once it bound it (before its model loads)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"{path.stem} exited with {proc.returncode} before binding a port:\n{log.read_text()}")
        time.sleep(0.05)
    raise TimeoutError(f"no port in {path} after {timeout_s}s:\n{log.read_text()}")


def stop_all(services: list[Service]) -> None:
    """SIGTERM every service first, then wait for each: their graceful shutdowns overlap."""
    running = [s for s in services if s.proc.poll() is None]
    for s in running:
        s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for s in running:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait()


def base_url(gateway: Service) -> str:
    return f"http://{HOST}:{gateway.port}"


def spawn(name: str, args: list[str], log_dir: Path, port: int, command: list[str] | None = None) -> Service:
    """`specd NAME ARGS`, or `COMMAND ARGS` (a script that runs NAME its own way). `specd NAME ARGS`
    is forked from this worker's zygote (tests/integration/zygote.py) unless SPECD_TEST_ZYGOTE=0."""
    log = log_dir / f"{name}-{port or uuid.uuid4().hex[:12]}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # The zygote dies with the thread that started it (PR_SET_PDEATHSIG): the main thread's only.
    if command is None and threading.current_thread() is threading.main_thread() and USE_ZYGOTE:
        forked = Zygote.get().fork([name, *args], env, log)
        if forked is not None:
            return Service(name, forked, port, log)
    argv = [*(command or [sys.executable, "-m", "specd.cli", name]), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
    return Service(name, proc, port, log)


USE_ZYGOTE = os.environ.get("SPECD_TEST_ZYGOTE", "1") != "0"


class Forked:
    """A child of the zygote, with the part of `subprocess.Popen` the tests use. The zygote reaps
    it and writes its exit status to `status` (negative: the signal that ended it)."""

    def __init__(self, pid: int, status: Path, args: list[str]) -> None:
        self.pid, self.status, self.args = pid, status, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.status.is_file():
            self.returncode = int(self.status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.01)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """This worker's fork server (tests/integration/zygote.py), started on first use. It forks only
    for the environment it started in, but for SPECD_ and OTEL_ settings (read by services as they
    run) and pytest's own PYTEST_ ones: a library may read any other as it is imported."""

    _instance: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            preexec_fn=die_with_parent,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        if self.stdout.readline() != b"ready\n":
            raise RuntimeError(f"the test zygote exited with {self.proc.wait()} before it was ready")

    @classmethod
    def get(cls) -> Zygote:
        with cls._lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = Zygote()
            return cls._instance

    def fork(self, argv: list[str], env: dict[str, str], log: Path) -> Forked | None:
        """`specd ARGV` in `env`, its output to `log`; None where `env` is not one to fork for."""
        if _runtime_free(env) != _runtime_free(self.env):
            return None
        status = log.with_suffix(".status")
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log), "status": str(status)}
        with self._lock:
            self.stdin.write(json.dumps(request).encode() + b"\n")
            self.stdin.flush()
            pid = int(self.stdout.readline())
        return Forked(pid, status, argv)


def _runtime_free(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(("SPECD_", "OTEL_", "PYTEST_"))}


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child before exec: send it `sig` when the test process dies (Linux), so a test run that
    is killed leaves none of its services behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)


def stop_with_parent() -> None:
    die_with_parent(signal.SIGTERM)


PR_SET_PDEATHSIG = 1


@dataclass
class Stack:
    verifier: Service
    drafter: Service | None
    gateway: Service
    services: list[Service] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.gateway.port}"

    def stop(self) -> None:
        stop_all(list(reversed(self.services)))


def spawn_backend(kind: str, args: list[str], log_dir: Path, port: int | None = None) -> Service:
    """A backend process on `port`, not yet waited for (see `ready_backend`). By default it binds
    a port the OS picks and writes it to a file: no other process can take it between a pick and
    the bind (`free_port`'s race, with many test processes at once). Its `port` waits for the file."""
    if port:
        return spawn(kind, ["--host", HOST, "--port", str(port), *args], log_dir, port)
    port_file = log_dir / f"{kind}-{uuid.uuid4().hex[:12]}.port"
    service = spawn(kind, ["--host", HOST, "--port", "0", "--port-file", str(port_file), *args], log_dir, 0)
    service.port_file = port_file
    return service


def ready_backend(service: Service) -> Service:
    """Waits until `service` answers SERVING; stops it and raises with its log if it does not."""
    try:
        wait_grpc_healthy(service.address, service.proc)
    except Exception:
        service.stop()
        raise RuntimeError(f"{service.name} failed to start:\n{service.output()}") from None
    return service


def start_backend(kind: str, args: list[str], log_dir: Path) -> Service:
    return ready_backend(spawn_backend(kind, args, log_dir))


def spawn_gateway(
    verifier: Service | str,
    drafter: Service | str | None,
    args: list[str],
    log_dir: Path,
    command: list[str] | None = None,
) -> Service:
    """A gateway process over these backends, not yet waited for (see `ready_gateway`). It waits
    for its backends itself, so it may be spawned beside them: their start-ups overlap.
    A string is passed as is (several replicas: "a:1,b:2"); `command` runs the gateway through
    another script (see `spawn`)."""
    # Tests of the round mechanics (and of drafter faults) need k drafts every round;
    # in auto mode a drafter that is rarely right, as the tiny draft model is, stops being asked.
    if "--speculative-mode" not in args:
        args = [*args, "--speculative-mode", "fixed"]
    http_port, grpc_port = free_port(), free_port()
    gateway = spawn(
        "gateway",
        [
            "--host", HOST,
            "--http-port", str(http_port),
            "--grpc-port", str(grpc_port),
            "--verifier", verifier if isinstance(verifier, str) else verifier.address,
            "--drafter", drafter if isinstance(drafter, str) else drafter.address if drafter else "",
            *args,
        ],
        log_dir,
        http_port,
        command,
    )  # fmt: skip
    gateway.grpc_port = grpc_port
    return gateway


def ready_gateway(gateway: Service, timeout_s: float = 120) -> Service:
    """Waits until the gateway's /health answers 200; stops it and raises with its log if not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if gateway.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {gateway.proc.returncode}:\n{gateway.output()}")
        try:
            if httpx.get(f"http://{HOST}:{gateway.port}/health", timeout=1).status_code == 200:
                return gateway
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    gateway.stop()
    raise TimeoutError(f"gateway not healthy:\n{gateway.output()}")


def start_gateway(*args: Any, **kwargs: Any) -> Service:
    """`spawn_gateway` with these arguments, then `ready_gateway`."""
    return ready_gateway(spawn_gateway(*args, **kwargs))


def start_stack(
    target: Path,
    draft: Path | str | None,
    log_dir: Path,
    k: int = 4,
    backend_args: tuple[str, ...] = ("--dtype", "float32"),
    gateway_args: tuple[str, ...] = (),
    mode: str = "fixed",
) -> Stack:
    """A whole stack; `mode` is the gateway's --speculative-mode (fixed by default, so
    tests of the round mechanics see k drafts every round)."""
    # All three start at once: the gateway waits for its backends, and the processes' imports overlap.
    services: list[Service] = []
    try:
        verifier = spawn_backend("verifier", ["--model", str(target), *backend_args], log_dir)
        services.append(verifier)
        drafter = None
        if draft == "ngram":
            drafter = spawn_backend("drafter", ["--drafter", "ngram"], log_dir)
        elif draft is not None:
            drafter = spawn_backend("drafter", ["--model", str(draft), "--quantize", "none", *backend_args], log_dir)
        if drafter:
            services.append(drafter)
        gateway = spawn_gateway(
            verifier,
            drafter,
            ["--tokenizer", str(target), "--num-speculative-tokens", str(k), "--speculative-mode", mode, *gateway_args],
            log_dir,
        )
        services.append(gateway)
        for backend in services[:-1]:
            ready_backend(backend)
        ready_gateway(gateway)
    except BaseException:
        stop_all(services)
        raise
    return Stack(verifier, drafter, gateway, services)


MODEL = "target"  # the name the test gateways serve


async def stream_text(client: httpx.AsyncClient, prompt: str, max_tokens: int, started: asyncio.Event | None) -> str:
    """One streamed greedy completion; sets `started` once its first text arrived."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    parts: list[str] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            parts.append(payload["choices"][0]["text"])
            if started is not None and parts[-1]:
                started.set()
    return "".join(parts)


def complete_texts(url: str, prompts: list[str], max_tokens: int, timeout_s: float = 300) -> list[str]:
    """Concurrent greedy completions of `max_tokens` tokens each (ignoring EOS); their texts."""

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    return asyncio.run(run())


@contextlib.contextmanager
def specd_up(log: Path, *args: str, timeout_s: float = 300) -> Iterator[tuple[str, dict[str, int]]]:
    """`specd up` with its defaults but for free ports and `args`; yields the API's base URL and the
    ports (http, grpc, drafter, verifier, drafter_metrics, verifier_metrics). It must exit 0 on SIGINT."""
    names = ("http", "grpc", "drafter", "verifier", "drafter_metrics", "verifier_metrics")
    ports = {name: free_port() for name in names}
    argv = [sys.executable, "-m", "specd.cli", "up"]
    for name in names:
        argv += [f"--{name.replace('_', '-')}-port", str(ports[name])]
    with open(log, "wb") as out:
        # SIGTERM, not SIGKILL, when the test process dies: `specd up` then stops its children itself.
        proc = subprocess.Popen([*argv, *args], stdout=out, stderr=subprocess.STDOUT, preexec_fn=stop_with_parent)
    try:
        deadline = time.monotonic() + timeout_s
        while "specd is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield f"http://{HOST}:{ports['http']}", ports
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log.read_text()
