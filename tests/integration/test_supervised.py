"""Faults under `specd up`, as a user runs it: the supervisor restarts what dies and the stack recovers.

Each test starts its own `specd up` on tiny models and loopback ports (the two that kill a backend
and see it recover share one, which the SIGTERM test then stops), then SIGKILLs one of its
children (found through /proc: they are the launcher's child processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from references import PROMPTS as ALL_PROMPTS
from references import api_text, greedy_references

from specd.proto.speculative.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

MODEL = "target"
PROMPTS = list(ALL_PROMPTS[:8])
LONGEST = 48
LEASE_S = 3.0
# The backends answer only callers with this token; specd up passes it to its children,
# and the test uses it to read the backends' open-sequence counts.
BACKEND_TOKEN = "supervised-test-token-" + "0" * 16
AUTH = (("authorization", f"Bearer {BACKEND_TOKEN}"),)


@dataclass
class Up:
    """A running `specd up` and where its three children listen."""

    proc: subprocess.Popen
    log: Path
    ports: dict[str, int]
    killed_at: float = 0.0  # time.monotonic() of the latest kill

    @property
    def base_url(self) -> str:
        return f"http://{st.HOST}:{self.ports['http']}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def child(self, name: str) -> int:
        """The pid of the launcher's child running `specd <name>`."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"specd.cli" in argv and name.encode() in argv:
                return int(entry)
        raise AssertionError(f"no {name} child of specd up:\n{self.output()[-3000:]}")

    def kill(self, name: str) -> int:
        pid = self.child(name)
        os.kill(pid, signal.SIGKILL)
        self.killed_at = time.monotonic()
        return pid

    def metrics(self, port_name: str = "http") -> dict[str, float]:
        url = self.base_url + "/metrics" if port_name == "http" else f"http://{st.HOST}:{self.ports[port_name]}/"
        text = httpx.get(url, timeout=10).text
        return {
            s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels
        }

    def health(self) -> httpx.Response:
        return httpx.get(self.base_url + "/health", timeout=10)

    def open_sequences(self, kind: str) -> int:
        with grpc.insecure_channel(f"{st.HOST}:{self.ports[kind]}") as ch:
            if kind == "verifier":
                stub = verifier_pb2_grpc.VerifierServiceStub(ch)
                request = verifier_pb2.GetVerifierInfoRequest()
                return stub.GetVerifierInfo(request, timeout=5, metadata=AUTH).open_sequences
            d = drafter_pb2_grpc.DrafterServiceStub(ch)
            return d.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(), timeout=5, metadata=AUTH).open_sequences


def start_up(target: Path, draft: Path, log_dir: Path, name: str, *extra: str, env: dict[str, str] | None = None) -> Up:
    ports = {n: st.free_port() for n in ("http", "grpc", "drafter", "verifier", "drafter_metrics", "verifier_metrics")}
    log = log_dir / f"specd-up-{name}-{ports['http']}.log"
    argv = [
        sys.executable, "-m", "specd.cli", "up",
        "--host", st.HOST,
        "--http-port", str(ports["http"]),
        "--grpc-port", str(ports["grpc"]),
        "--drafter-port", str(ports["drafter"]),
        "--verifier-port", str(ports["verifier"]),
        "--drafter-metrics-port", str(ports["drafter_metrics"]),
        "--verifier-metrics-port", str(ports["verifier_metrics"]),
        "--target-model", str(target),
        "--draft-model", str(draft),
        "--drafter-dtype", "float32",
        "--quantize", "none",
        "-k", "4",
        # Drafts every round: the drafter-fault test judges speculation by the draft counter.
        "--speculative-mode", "fixed",
        # Faults, not placement, are tested here: no start-up measurement, the sequential pipeline.
        "--placement", "shared",
        "--max-context", "256",
        # Short, so a stall costs little; not so short that a busy machine trips it.
        "--drafter-timeout-s", "2",
        "--backend-timeout-s", "10",
        "--lease-s", str(LEASE_S),
        "--startup-timeout", "150",
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", SPECD_BACKEND_TOKEN=BACKEND_TOKEN, **(env or {})),
            start_new_session=True,  # a failing test can end the launcher and its children together
        )
    up = Up(proc, log, ports)
    deadline = time.monotonic() + 180
    while "specd is up" not in up.output():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(up)
            raise RuntimeError(f"specd up did not come up:\n{up.output()[-5000:]}")
        time.sleep(0.3)
    return up


def session_processes(sid: int) -> list[str]:
    """The running processes (zombies have ended) of session `sid`, as "pid command line" each.
    specd up runs in a session of its own here: every process it or its children start is in
    it, and stays in it when PID 1 adopts it, which is how a leftover hides from a parent's view."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")[:300]
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{entry} {argv.decode(errors='replace')}")
    return found


def leftovers(up: Up, within_s: float = 30.0) -> list[str]:
    """What of specd up's session still runs `within_s` after specd up itself has exited (its
    children's own stops take a few seconds: the gateway drains, the backends' grace)."""
    assert up.proc.poll() is not None
    deadline = time.monotonic() + within_s
    while (left := session_processes(up.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for line in left:  # not left for the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return left


def stop(up: Up) -> int | None:
    """SIGTERM specd up, as systemd and Kubernetes stop it; its exit code. Raises if any process
    of its session is left."""
    code = None
    if up.proc.poll() is None:
        up.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = up.proc.wait(45)
    if code is not None:
        left = leftovers(up)
        assert not left, f"left running after specd up exited on SIGTERM: {left}"
    with contextlib.suppress(ProcessLookupError):
        os.killpg(up.proc.pid, signal.SIGKILL)
    up.proc.wait()
    return code


@pytest.fixture(scope="module")
def supervised(model_dirs, log_dir) -> Iterator[Up]:
    """One `specd up` for the tests that kill one child and see the stack recover, and last for the
    one that stops it with SIGTERM (a file's tests run on one worker, in order); each reads the log
    from where it began (`since`)."""
    up = start_up(model_dirs["target"], model_dirs["draft"], log_dir, "shared", "--shutdown-grace-s", str(GRACE_S))
    try:
        yield up
    finally:
        stopped_by_a_test = up.proc.poll() is not None  # which checked its exit code
        code = stop(up)
        assert stopped_by_a_test or code == 0, f"specd up exited with {code} on SIGTERM:\n{up.output()[-3000:]}"


GRACE_S = 30.0  # the gateway's drain time at SIGTERM; generous, as this machine may be slow


@pytest.fixture(scope="module")
def references(tok, tiny_target) -> dict[str, list[int]]:
    return greedy_references(tok, tiny_target, PROMPTS, LONGEST)


def expected_text(tok, references, prompt: str, max_tokens: int) -> str:
    return api_text(tok, references[prompt][:max_tokens])


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.2) -> float:
    """Seconds it took; fails past timeout_s."""
    start = time.monotonic()
    while True:
        with contextlib.suppress(httpx.HTTPError, grpc.RpcError):
            if predicate():
                return time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(interval_s)


async def streams_with_a_kill(up: Up, prompts: list[str], victim: str) -> list[str | BaseException]:
    """Stream every prompt; once each has its first text, SIGKILL the victim child; every outcome."""
    async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as client:
        started = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.create_task(st.stream_text(client, p, LONGEST, e)) for p, e in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 90)
        up.kill(victim)
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 150)


@pytest.mark.slow  # 40-90 s here: a restart of the drafter child and a reconnect
def test_drafter_killed_under_specd_up_costs_no_request_and_speculation_resumes(supervised, tok, references):
    up = supervised
    since = len(up.output())
    prompts = (PROMPTS * 2)[:16]
    outcomes = asyncio.run(streams_with_a_kill(up, prompts, "drafter"))
    for prompt, outcome in zip(prompts, outcomes, strict=True):
        assert outcome == expected_text(tok, references, prompt, LONGEST), (prompt, outcome)
    # The streams may all have ended before the supervisor has seen the death.
    death = "the drafter was killed by SIGKILL while serving; the others keep running"
    wait_until(lambda: death in up.output()[since:], 30, "the supervisor to see the drafter's death")
    # The supervisor starts it again on the same port; the gateway takes it back.
    wait_until(lambda: up.health().json()["drafter"] == "ok", 90, "the gateway to take the drafter back")
    assert up.metrics()["specd_drafter_reconnects_total"] >= 1
    before = up.metrics()["specd_spec_decode_num_drafts_total"]

    async def again() -> list[str]:
        async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as client:
            return await asyncio.gather(*(st.stream_text(client, p, LONGEST, None) for p in PROMPTS[:4]))

    texts = asyncio.run(again())
    assert texts == [expected_text(tok, references, p, LONGEST) for p in PROMPTS[:4]]
    assert up.metrics()["specd_spec_decode_num_drafts_total"] > before, "speculation did not resume"
    # The gateway and verifier were never restarted.
    assert "restarting the gateway" not in up.output()[since:] and "restarting the verifier" not in up.output()[since:]


def test_verifier_killed_under_specd_up_fails_in_flight_requests_then_recovers(supervised):
    up = supervised
    since = len(up.output())
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=up.base_url, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(4)]
            deadline = time.monotonic() + 60
            while (await client.get("/health")).json()["running"] < 4:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            up.kill("verifier")
            return await asyncio.gather(*tasks)

    for reply in asyncio.run(run()):
        assert reply.status_code == 503, reply.text
        assert reply.headers["retry-after"]
    killed = time.monotonic()

    def served() -> bool:
        r = httpx.post(up.base_url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200

    wait_until(served, 60, "a new request to succeed after the verifier died", interval_s=0.5)
    print(f"first request served {time.monotonic() - killed:.1f} s after the verifier was killed")
    assert "the verifier was killed by SIGKILL while serving; the others keep running" in up.output()[since:]
    assert "restarting the gateway" not in up.output()[since:] and "restarting the drafter" not in up.output()[since:]


@pytest.mark.slow  # 90-200 s here: ten gateway restarts
def test_a_gateway_killed_ten_times_under_load_frees_its_sequences_at_once(model_dirs, log_dir):
    # A lease of 120 s: only the presence streams ending can free a dead gateway's sequences in the
    # 2 s asked. 80 stranded sequences would overflow the backends' 64 slots: if they were held,
    # the later kills' streams and the burst of 32 would be refused.
    up = start_up(model_dirs["target"], model_dirs["draft"], log_dir, "ten-kills", "--lease-s", "120")
    freed_after: list[float] = []
    cut = 0  # streams the kills cut off (the rest had finished first)
    try:
        for kill in range(10):
            healthy_lines = up.output().count("the gateway is healthy again")
            outcomes = asyncio.run(streams_with_a_kill(up, PROMPTS[:8], "gateway"))
            cut += sum(isinstance(o, BaseException) for o in outcomes)
            wait_until(
                lambda: not any(up.open_sequences(kind) for kind in ("verifier", "drafter")),
                30,
                f"both services to hold no sequences after kill {kill + 1}",
                interval_s=0.05,
            )
            freed_after.append(time.monotonic() - up.killed_at)
            # Each kill hits a serving gateway: wait for the supervisor to see the new one healthy.
            wait_until(
                lambda n=healthy_lines: up.output().count("the gateway is healthy again") > n,
                90,
                f"the gateway to come back after kill {kill + 1}",
            )
            wait_until(lambda: up.health().status_code == 200, 60, "the gateway's /health")
        expired = up.metrics("verifier_metrics")["specd_verifier_sequences_expired_total"]

        async def burst() -> list[httpx.Response]:
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(32)))

        replies = asyncio.run(burst())
    finally:
        code = stop(up)
    freed = ", ".join(f"{s:.2f}" for s in freed_after)
    print(f"{cut} of 80 streams cut; each kill's sequences freed {freed} s after it")
    assert cut > 0, "every stream had finished before its kill: nothing was stranded"
    assert expired > 0, "nothing freed as gone: were the sequences closed some other way?"
    assert max(freed_after) < 2.0, freed_after
    assert [r.status_code for r in replies] == [200] * 32, [r.text for r in replies if r.status_code != 200][:2]
    assert "restarting the verifier" not in up.output() and "restarting the drafter" not in up.output()
    assert code == 0, up.output()[-3000:]


def test_a_verifier_restarted_with_another_tokenizer_is_refused(model_dirs, log_dir, tmp_path, tok):
    # The model directory changes on disk while `specd up` runs; the verifier's restart picks it up.
    target = Path(shutil.copytree(model_dirs["target"], tmp_path / "target"))
    up = start_up(target, model_dirs["draft"], log_dir, "other-tokenizer")
    try:
        other = type(tok).from_pretrained(str(target))
        other.add_tokens(["<specd-extra-token>"])
        other.save_pretrained(target)
        up.kill("verifier")
        refusal = f"refusing verifier at {st.HOST}:{up.ports['verifier']}: its tokenizer differs from the gateway's"
        wait_until(lambda: refusal in up.output(), 90, "the gateway to refuse the changed verifier")
        assert f"vocab size {len(tok) + 1} != {len(tok)}" in up.output()
        assert up.health().status_code == 503
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(up.base_url + "/v1/completions", json=body, timeout=30).status_code == 503
        # Put right and restarted, it is taken back.
        tok.save_pretrained(target)
        for name in ("added_tokens.json",):
            with contextlib.suppress(FileNotFoundError):
                (target / name).unlink()
        up.kill("verifier")
        wait_until(lambda: up.health().status_code == 200, 90, "the gateway to take the verifier back")
        assert httpx.post(up.base_url + "/v1/completions", json=body, timeout=30).status_code == 200
        # A gateway killed outright runs no stop: its children (the body-screening worker) end anyway.
        children = children_of(up.child("gateway"))
        assert children, "the gateway had no body-screening worker"
        up.kill("gateway")

        def running(pids: set[int]) -> set[int]:
            return pids & {int(line.split()[0]) for line in session_processes(up.proc.pid)}

        wait_until(lambda: not running(children), 10, f"the killed gateway's children {children} to end")
        # Nor does specd up killed outright leave anything: its children die with it, theirs with them.
        os.kill(up.proc.pid, signal.SIGKILL)
        up.proc.wait(10)
        left = leftovers(up)
        assert not left, f"left running after specd up was killed: {left}"
    finally:
        stop(up)


def children_of(pid: int) -> set[int]:
    """The children of process `pid`, started by any of its threads (read before it is killed)."""
    children: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            children.update(map(int, Path(f"/proc/{pid}/task/{task}/children").read_text().split()))
    return children


async def streams_with_a_stop(up: Up, prompts: list[str], max_tokens: int) -> tuple[list[str], list[int], int]:
    """Stream every prompt; once each has its first text, SIGTERM `specd up` and send small requests
    until one is refused. The streams' texts, the probes' statuses, and how many streams were unfinished."""
    async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as client:
        started = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.create_task(st.stream_text(client, p, max_tokens, e)) for p, e in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 90)
        up.proc.send_signal(signal.SIGTERM)
        unfinished = sum(not t.done() for t in tasks)
        statuses: list[int] = []
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
        while 503 not in statuses and len(statuses) < 200:
            statuses.append((await client.post("/v1/completions", json=body)).status_code)
            await asyncio.sleep(0.05)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120), statuses, unfinished


@pytest.mark.slow  # 30-60 s here: streams and specd up's ordered stop
def test_sigterm_lets_in_flight_streams_finish_and_refuses_new_requests(supervised, tok, tiny_target):
    """Last of the file's tests on the shared `specd up`: it stops it."""
    up = supervised
    since = len(up.output())
    # Long enough to outlast the backends' own 5 s grace: stopped together with the gateway, they would cut these.
    longest = 200
    references = greedy_references(tok, tiny_target, PROMPTS, longest)
    sent = time.monotonic()
    texts, statuses, unfinished = asyncio.run(streams_with_a_stop(up, PROMPTS, longest))
    drained_s = time.monotonic() - sent
    code = up.proc.wait(GRACE_S + 30)
    print(f"{unfinished} of 8 streams in flight at SIGTERM; all done {drained_s:.1f} s later; probes {statuses}")
    assert unfinished > 0, "every stream had finished before the signal: nothing was tested"
    assert texts == [expected_text(tok, references, p, longest) for p in PROMPTS]
    assert drained_s < GRACE_S
    assert statuses[-1] == 503, statuses
    assert code == 0, up.output()[-3000:]
    assert "UNAVAILABLE" not in up.output()[since:]
