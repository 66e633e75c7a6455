"""`specd up`'s supervisor with fake processes and a fake clock: restarts, backoff, giving up."""

from __future__ import annotations

import pytest

from specd.launch import GiveUp, RestartPolicy, Supervisor


class FakeProcess:
    def __init__(self, argv: list[str], pid: int) -> None:
        self.argv = argv
        self.pid = pid
        self.code: int | None = None
        self.terminated = False

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.terminated = True
        self.code = 0

    def kill(self) -> None:
        self.code = -9

    def wait(self, timeout: float | None = None) -> int:
        assert self.code is not None
        return self.code


class World:
    """The clock, the processes spawned so far, and which addresses answer SERVING."""

    def __init__(self) -> None:
        self.now = 0.0
        self.spawned: list[FakeProcess] = []
        self.serving: set[str] = set()
        self.lines: list[str] = []

    def spawn(self, argv: list[str]) -> FakeProcess:
        proc = FakeProcess(argv, len(self.spawned) + 1)
        self.spawned.append(proc)
        return proc

    def latest(self, name: str) -> FakeProcess:
        return [p for p in self.spawned if p.argv[0] == name][-1]

    def supervisor(self) -> Supervisor:
        s = Supervisor(
            lambda address: address in self.serving,
            self.spawn,
            RestartPolicy(),
            clock=lambda: self.now,
            say=self.lines.append,
        )
        for name in ("verifier", "drafter", "gateway"):
            s.add(name, [name], f"addr-{name}")
        return s

    def run(self, s: Supervisor, seconds: float, step_s: float = 0.1) -> None:
        end = self.now + seconds
        while self.now < end:
            s.step()
            self.now += step_s


def up(world: World) -> Supervisor:
    s = world.supervisor()
    s.start()
    world.serving |= {"addr-verifier", "addr-drafter", "addr-gateway"}
    s.step()
    assert s.all_healthy()
    return s


def test_a_child_that_dies_is_restarted_alone_with_doubling_backoff() -> None:
    world = World()
    s = up(world)
    others = {world.latest("verifier"), world.latest("gateway")}
    world.serving.discard("addr-drafter")
    delays = []
    for _ in range(4):  # it keeps dying before it is ready: 0.5, 1, 2, 4 s
        world.latest("drafter").code = -9
        died_at = world.now
        count = len(world.spawned)
        while len(world.spawned) == count:
            world.run(s, 0.1)
        delays.append(world.now - died_at)
    # Each plus up to two 0.1 s steps: the one that noticed the death, the one that restarted it.
    assert delays == pytest.approx([0.6, 1.1, 2.1, 4.1], abs=0.15)
    assert {world.latest("verifier"), world.latest("gateway")} == others  # never restarted
    assert not any(p.terminated for p in others)
    assert "the drafter was killed by SIGKILL while serving; the others keep running; restarting it in 0.5 s" in (
        world.lines
    )
    # Healthy again: the backoff starts over.
    world.serving.add("addr-drafter")
    world.run(s, 0.2)
    assert "the drafter is healthy again at addr-drafter" in world.lines
    world.latest("drafter").code = 1
    world.run(s, 0.2)
    assert world.lines[-1].endswith("restarting it in 0.5 s")


def test_a_child_that_keeps_failing_to_start_stops_everything_and_says_why() -> None:
    world = World()
    s = up(world)
    world.serving.discard("addr-verifier")
    with pytest.raises(GiveUp, match=r"the verifier failed to start 5 times within 60 s \(last: it exited with code 1"):
        for _ in range(10):
            world.latest("verifier").code = 1
            world.run(s, 12.0)
    s.stop_all(grace_s=0)
    assert all(p.terminated or p.code is not None for p in world.spawned)


def test_failures_spread_over_more_than_the_window_are_not_fatal() -> None:
    world = World()
    s = up(world)
    world.serving.discard("addr-gateway")
    for _ in range(8):  # one failed start every 20 s: never 5 within 60 s
        world.latest("gateway").code = 1
        world.run(s, 20.0)
    assert len([p for p in world.spawned if p.argv == ["gateway"]]) == 9


def test_a_configuration_error_at_first_start_is_not_retried() -> None:
    world = World()
    s = world.supervisor()
    s.start()
    world.latest("verifier").code = 2
    with pytest.raises(GiveUp, match="the verifier exited with code 2 before it was ready: a configuration error"):
        s.step()


def test_a_stop_request_stops_restarting() -> None:
    world = World()
    s = up(world)
    s.request_stop()
    world.latest("drafter").code = 0  # Ctrl-C reached it too
    world.run(s, 5.0)
    assert len(world.spawned) == 3


def test_stop_all_stops_the_gateway_first_and_the_backends_only_once_it_has_exited() -> None:
    world = World()
    s = up(world)
    order: list[str] = []
    for proc in world.spawned:

        def terminate(proc: FakeProcess = proc) -> None:
            order.append(f"terminate {proc.argv[0]}")
            proc.terminated = True

        def wait(timeout: float | None = None, proc: FakeProcess = proc) -> int:
            order.append(f"wait {proc.argv[0]}")
            proc.code = 0  # the drain ends
            return 0

        proc.terminate = terminate  # type: ignore[method-assign]
        proc.wait = wait  # type: ignore[method-assign]
    s.stop_all(grace_s=0, first=("gateway",), first_grace_s=5)
    assert order[:2] == ["terminate gateway", "wait gateway"]
    assert sorted(order[2:]) == sorted(["terminate verifier", "terminate drafter", "wait verifier", "wait drafter"])


def test_a_child_of_specd_up_is_in_its_own_group_and_dies_with_it(tmp_path) -> None:
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    pid_file = tmp_path / "child.pid"
    child = (
        "from specd.launch import die_with_parent; die_with_parent(); import os, time; "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    parent = (
        "import os, sys, time; from specd.launch import spawn_child; "
        f"spawn_child([sys.executable, '-c', {child!r}], os.environ); time.sleep(60)"
    )
    up = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert os.getpgid(pid) == pid != os.getpgid(up.pid)  # Ctrl-C to the terminal's group misses it
        up.kill()  # SIGKILL: specd up has no chance to stop it
        up.wait()
        deadline = time.monotonic() + 10
        status = Path(f"/proc/{pid}/status")
        while status.exists() and "zombie" not in status.read_text():
            assert time.monotonic() < deadline, "the child outlived specd up"
            time.sleep(0.05)
    finally:
        up.kill()
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
