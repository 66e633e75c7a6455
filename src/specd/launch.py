"""Child-process supervision for `specd up`.

A child that dies is restarted with backoff; the others keep running, because
each service already copes with the others coming and going (the gateway runs
target-only without a drafter, answers 503 without a verifier, and reconnects
to either). `specd up` stops everything only when asked to (the gateway first,
whose drain needs the others), or when a child cannot start: it exits with the
services' configuration-error code (2) before it was ever healthy, or fails to
start `start_failures` times within `start_window_s`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# What the services exit with when their flags, model or certificates are wrong:
# starting them again would fail the same way.
CONFIG_ERROR_EXIT = 2
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class RestartPolicy:
    first_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # A child that exits this many times before becoming healthy, within the window, is given up on.
    start_failures: int = 5
    start_window_s: float = 60.0
    poll_s: float = 0.3


class GiveUp(Exception):
    """The stack cannot run: the message says which child and why."""


@dataclass
class Child:
    name: str
    argv: list[str]
    health_address: str
    proc: Process | None = None
    healthy: bool = False  # answered SERVING since its latest start
    ever_healthy: bool = False
    restart_at: float | None = None  # when to start it again after it died
    backoff_s: float = 0.0
    failed_starts: deque[float] = field(default_factory=deque)
    restarts: int = 0


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    def __init__(
        self,
        healthy: Callable[[str], bool],
        spawn: Callable[[list[str]], Process] = subprocess.Popen,
        policy: RestartPolicy = RestartPolicy(),
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = lambda line: print(f"specd up: {line}", file=sys.stderr, flush=True),
    ) -> None:
        self._healthy = healthy
        self._spawn = spawn
        self.policy = policy
        self._clock = clock
        self._say = say
        self.children: dict[str, Child] = {}
        self._stop = False

    def add(self, name: str, argv: list[str], health_address: str) -> None:
        self.children[name] = Child(name, argv, health_address, backoff_s=self.policy.first_backoff_s)

    def request_stop(self) -> None:
        self._stop = True

    @property
    def stopping(self) -> bool:
        return self._stop

    def start(self) -> None:
        for child in self.children.values():
            self._launch(child)

    def _launch(self, child: Child) -> None:
        child.proc = self._spawn(child.argv)
        child.healthy = False
        child.restart_at = None

    def all_healthy(self) -> bool:
        return all(c.healthy for c in self.children.values())

    def step(self) -> None:
        """One pass: notice deaths, schedule and run restarts, check children that are starting.

        Raises GiveUp when a child cannot start.
        """
        if self._stop:
            return
        now = self._clock()
        for child in self.children.values():
            if child.proc is None:
                if child.restart_at is not None and now >= child.restart_at:
                    child.restarts += 1
                    self._say(f"restarting the {child.name} (restart {child.restarts})")
                    self._launch(child)
                continue
            code = child.proc.poll()
            if code is not None:
                self._died(child, code, now)
            elif not child.healthy and self._healthy(child.health_address):
                child.healthy = True
                # A start that got as far as serving resets the backoff: the next death is a new incident.
                child.backoff_s = self.policy.first_backoff_s
                if child.ever_healthy:
                    self._say(f"the {child.name} is healthy again at {child.health_address}")
                else:
                    self._say(f"{child.name} is healthy at {child.health_address}")
                child.ever_healthy = True

    def _died(self, child: Child, code: int, now: float) -> None:
        was_healthy = child.healthy
        child.proc = None
        child.healthy = False
        how = describe_exit(code)
        if not was_healthy:
            if code == CONFIG_ERROR_EXIT and not child.ever_healthy:
                raise GiveUp(f"the {child.name} {how} before it was ready: a configuration error (its log is above)")
            window = self.policy.start_window_s
            child.failed_starts.append(now)
            while child.failed_starts and now - child.failed_starts[0] > window:
                child.failed_starts.popleft()
            if len(child.failed_starts) >= self.policy.start_failures:
                raise GiveUp(
                    f"the {child.name} failed to start {len(child.failed_starts)} times within {window:.0f} s "
                    f"(last: it {how}; its log is above)"
                )
        delay = child.backoff_s
        child.backoff_s = min(self.policy.max_backoff_s, child.backoff_s * 2)
        child.restart_at = now + delay
        state = "while serving" if was_healthy else "before it was ready"
        self._say(f"the {child.name} {how} {state}; the others keep running; restarting it in {delay:g} s")

    def wait_up(self, timeout_s: float) -> None:
        """Supervise until every child is healthy; raises GiveUp past the deadline or on a stop."""
        deadline = self._clock() + timeout_s
        while not self.all_healthy():
            if self._stop:
                raise GiveUp("interrupted during startup")
            self.step()
            if self._clock() > deadline:
                late = ", ".join(c.name for c in self.children.values() if not c.healthy)
                raise GiveUp(f"not healthy after {timeout_s:.0f} s: {late}")
            time.sleep(self.policy.poll_s)

    def run(self) -> None:
        """Supervise until a stop is requested; raises GiveUp when a child cannot start."""
        while not self._stop:
            self.step()
            time.sleep(self.policy.poll_s)

    def stop_all(self, grace_s: float = 15.0, first: Sequence[str] = (), first_grace_s: float = 0.0) -> None:
        """Stop the children named in `first` (the gateway) and wait up to first_grace_s for them to drain,
        then the rest: the backends must serve the gateway's in-flight requests until they finish."""
        self._stop = True
        leading = [c.proc for n, c in self.children.items() if n in first and c.proc is not None]
        rest = [c.proc for n, c in self.children.items() if n not in first and c.proc is not None]
        _terminate(leading, first_grace_s)
        _terminate(rest, grace_s)


def _terminate(procs: list[Process], grace_s: float) -> None:
    """SIGTERM each, then SIGKILL whatever has not exited within grace_s."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# Set by `specd up` in its children's environment: the pid they must not outlive.
PARENT_ENV = "SPECD_UP_PID"


def die_with_parent() -> None:
    """In a child of `specd up` (PARENT_ENV set): get SIGTERM when it dies, and stop at once if it
    is gone already. Set here rather than between fork and exec, where a threaded parent must not run Python."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent:
        die_with(int(parent), signal.SIGTERM, "specd up, which started this service, has exited")


def die_with(parent: int, sig: int = signal.SIGKILL, why: str = "the process that started this one has exited") -> None:
    """Get `sig` when `parent` (this process's parent, by pid) dies, and exit now if it has died
    already. Linux only (PR_SET_PDEATHSIG), where it holds whatever this process is doing; the
    parent's thread that started this one must live as long as the parent does."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        raise SystemExit(why)


def spawn_child(argv: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """A child in its own process group, so a terminal's Ctrl-C reaches only `specd up` (which
    stops the children in order)."""
    return subprocess.Popen(argv, env={**env, PARENT_ENV: str(os.getpid())}, process_group=0)
