"""Large bodies are screened in a worker process: it refuses what the route would refuse, in the
route's own words, and lets everything else through to the route."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from api_harness import CHAT, COMPLETIONS, RefusingScheduler, body_for, http_post
from fastapi.routing import APIRoute

from gateway.api import body_screen
from gateway.api.body_screen import MAX_JSON_VALUES, BodyScreen, screen
from gateway.api.openai_api import OpenAIApi
from gateway.api.prompts import prompts_for
from specd.engine.ranges import MAX_MESSAGES

REFUSED = [
    (CHAT, {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)}),
    (CHAT, {"messages": [{"role": "critic", "content": "42"}]}),
    (CHAT, {"frobnicate": 1}),
    (COMPLETIONS, {"max_tokens": "many"}),
    (COMPLETIONS, {"prompt": 3.5}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": "x"}),
]


def encoded(endpoint: str, fields: dict[str, Any]) -> bytes:
    body = {"model": "m", "input": "hi"} | fields if endpoint == "/v1/responses" else body_for(endpoint, fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(("endpoint", "fields"), REFUSED)
def test_the_screen_refuses_what_the_route_refuses_in_its_words(tok, endpoint, fields):
    refusal = screen(endpoint, encoded(endpoint, fields))
    assert refusal is not None
    r, scheduler = http_post(tok, endpoint, json.loads(encoded(endpoint, fields)))
    assert r.status_code == 400 and not scheduler.submitted
    error = r.json()["error"]
    assert refusal == (error["message"], error["code"], error["param"])


def test_the_screen_lets_valid_bodies_through(tok):
    long_chat = {"messages": [{"role": "user", "content": "a " * 50_000}] * 4}
    assert screen(CHAT, encoded(CHAT, long_chat)) is None
    assert screen(COMPLETIONS, encoded(COMPLETIONS, {"prompt": list(range(60_000))})) is None


def test_bodies_that_are_not_json_or_too_many_values_are_refused():
    assert screen(CHAT, b'{"model": "m", "messages": [') == ("the request body is not valid JSON", "invalid_json", None)
    assert screen(CHAT, b"[" * 100_000 + b"]" * 100_000) is not None  # deep, not a crash
    parts = [{"type": "text", "text": "a"}] * (MAX_JSON_VALUES // 3 + 1)
    refusal = screen(CHAT, encoded(CHAT, {"messages": [{"role": "user", "content": parts}]}))
    assert refusal is not None and refusal[1] == "request_too_large", refusal


def test_small_bodies_and_unscreened_routes_never_reach_the_worker():
    screener = BodyScreen(min_bytes=1000)
    bad = encoded(CHAT, {"frobnicate": 1})
    assert len(bad) < 1000
    assert asyncio.run(screener.refusal(CHAT, bad)) is None
    assert asyncio.run(screener.refusal("/v1/models", bad + b" " * 1000)) is None
    assert screener.pid is None


def test_the_worker_refuses_a_large_body_and_a_dead_worker_is_replaced():
    screener = BodyScreen(min_bytes=1000)
    flood = encoded(CHAT, {"messages": [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)})

    async def go() -> list[Any]:
        first = await screener.refusal(CHAT, flood)
        assert screener.pid is not None
        os.kill(screener.pid, signal.SIGKILL)  # the worker killed as an out-of-memory kill would
        await asyncio.sleep(0.5)
        during = await screener.refusal(CHAT, flood)  # the route parses this one itself
        after = await screener.refusal(CHAT, flood)
        return [first, during, after]

    try:
        first, during, after = asyncio.run(go())
    finally:
        screener.close()
    assert first is not None and "messages" in first[0]
    assert during is None
    assert after == first


def test_every_route_that_takes_a_body_is_screened(tok):
    """A POST route missing from MODELS would leave its large bodies to the event loop."""
    api = OpenAIApi(RefusingScheduler(), tok, "target", health=None)  # type: ignore[arg-type]
    posts = {r.path for r in api.app().routes if isinstance(r, APIRoute) and "POST" in r.methods}
    assert posts == set(body_screen.MODELS)


def test_an_empty_prompt_list_is_refused_as_the_route_refuses_it(tok):
    body = encoded(COMPLETIONS, {"prompt": [], "user": "x" * 1000})
    prompts = prompts_for(tok, RefusingScheduler.max_context)
    refusal = screen(COMPLETIONS, body, prompts.text_limit)
    r, _ = http_post(tok, COMPLETIONS, json.loads(body))
    error = r.json()["error"]
    assert refusal == (error["message"], error["code"], error["param"]), refusal


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended: only its parent's wait is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_worker_ends_with_the_screens_close_by_itself():
    screener = BodyScreen(min_bytes=1000)
    assert asyncio.run(screener.refusal(CHAT, b"[" * 1000)) is not None  # it is up and reading its pipe
    proc = screener._proc
    assert proc is not None and _alive(proc.pid)
    assert str(proc.pid) in Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/children").read_text().split()
    screener.close()
    assert screener.pid is None and not _alive(proc.pid)
    assert proc.returncode == 0  # it saw its pipe close and exited; it was not killed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_worker_dies_with_a_killed_gateway():
    """A gateway killed by SIGKILL runs no stop: its worker must end anyway, in a session of its
    own too (no terminal's hangup reaches it)."""
    gateway = subprocess.Popen([sys.executable, "-c", GATEWAY_STANDIN], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert gateway.stdout is not None
        worker = int(gateway.stdout.readline())
        assert _alive(worker)
        gateway.kill()
        gateway.wait(10)
        assert _gone_within(worker, 10), f"worker {worker} outlived its gateway"
    finally:
        gateway.kill()
        gateway.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_die_with_ends_a_child_whose_parent_is_killed_whatever_it_is_doing():
    """What ends a worker busy parsing, which reads no pipe meanwhile: here one that only sleeps."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT_OF_SLEEPER], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == b"armed"
        parent.kill()
        parent.wait(10)
        assert _gone_within(child, 10), f"{child} outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


# A gateway's screen as the gateway holds it, started; then killed before any stop.
GATEWAY_STANDIN = """
import time
from gateway.api.body_screen import BodyScreen
screener = BodyScreen(min_bytes=1)
screener.start()
print(screener.pid, flush=True)
time.sleep(60)
"""
# A child that calls die_with and then sleeps, holding no pipe to its parent.
PARENT_OF_SLEEPER = """
import os, subprocess, sys, time
code = "import sys, time; from specd.launch import die_with; die_with(int(sys.argv[1])); print('armed', flush=True)"
code += "; time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(60)
"""
