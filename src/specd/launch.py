"""Child-process supervision for `specd up`."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Mapping

import grpc

from specd.health import check


class Launcher:
    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._stop = False

    def request_stop(self) -> None:
        self._stop = True

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        self.procs[name] = subprocess.Popen(argv, env=env)

    def _check_alive(self) -> None:
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"the {name} exited with code {code} (its log is above)")

    def wait_healthy(
        self,
        name: str,
        address: str,
        timeout_s: float,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str = "",
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._stop:
                raise RuntimeError("interrupted during startup")
            self._check_alive()
            try:
                if check(address, credentials, server_name, timeout_s=1.0) == "SERVING":
                    print(f"specd up: {name} is healthy at {address}", file=sys.stderr, flush=True)
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {name} was not healthy at {address} after {timeout_s:.0f}s")
            time.sleep(0.5)

    def supervise(self) -> int:
        """Block until a stop is requested (exit 0) or a child dies (exit 1)."""
        while not self._stop:
            try:
                self._check_alive()
            except RuntimeError as exc:
                print(f"specd up: {exc}; stopping the others", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.3)
        return 0

    def stop_all(self, grace_s: float = 15.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
