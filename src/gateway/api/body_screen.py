"""Large request bodies are parsed and validated in a worker process before the event loop parses them.

Parsing JSON holds the interpreter: a body of hundreds of thousands of small messages holds the
gateway's one event loop while it parses, and a thread would hold the same lock. A client sending
such bodies back to back stalled every other request and stream (issue 39). So a body of at
least `SCREEN_BYTES` for a route with a request model is first parsed and checked in a worker
process: the route's pydantic model, a count of JSON values, and the route's own checks of what
makes a body large (a guided_choice list, a completions prompt's text). A body that fails there
gets the route's 400 without the loop ever parsing it (a body with several faults may be told of
another one first); one that passes is parsed again by the route as usual, and is within those
limits, so that parse is bounded. Small bodies never leave the loop: for them the round trip
costs more than it saves.

The worker is a plain child process that lives and dies with its gateway: it reads requests from a
pipe the gateway holds, so it ends when the gateway closes that pipe or dies (the kernel closes it
then), and on Linux it is killed with the gateway besides (PR_SET_PDEATHSIG), even mid-parse. A
multiprocessing pool did not: the gateway ends with os._exit, its worker held its own queue's
write end, so it never saw the end, and its resource tracker outlived both.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any

from pydantic import ValidationError

from gateway.api.prompts import size_problem
from gateway.api.protocol import CompletionRequest
from gateway.api.validation import InvalidParameter, choices_problem, validation_refusal
from specd.launch import die_with

log = logging.getLogger(__name__)

# Below this a body's parse on the loop costs less than the trip to the worker.
SCREEN_BYTES = 256 * 1024
# JSON values (objects, arrays, strings, numbers, ...) in one request body. Every bounded list
# (messages, choices, stops, logit_bias) stays far below it; it bounds what the bounds do not
# reach, such as content parts or the nesting of a schema.
MAX_JSON_VALUES = 1 << 18
# The request model of each route (module, class), imported in the worker when first needed.
MODELS = {
    "/v1/completions": ("gateway.api.protocol", "CompletionRequest"),
    "/v1/chat/completions": ("gateway.api.protocol", "ChatCompletionRequest"),
    "/v1/responses": ("gateway.api.responses_api", "ResponsesRequest"),
}
# How much the worker yields the CPU (os.nice) to the services' steps and the gateway's loop.
WORKER_NICENESS = 10
Refusal = tuple[str, str, str | None]  # message, code, param: a 400 as OpenAI's error body has it


def _values(value: Any) -> Iterator[Any]:
    """Every JSON value in `value`, depth first, without recursion (a deep body cannot overflow the stack)."""
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def screen(path: str, body: bytes, text_limit: tuple[int, int] | None = None) -> Refusal | None:
    """What the route would refuse `body` for, as its 400 says it; None when the body is valid.
    `text_limit`: (bytes, max_context) of `Prompts.check_size`, for a completions prompt's text.
    Runs in the worker process."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return "the request body is not valid JSON", "invalid_json", None
    for count, _ in enumerate(_values(parsed), 1):
        if count > MAX_JSON_VALUES:
            return f"the request body holds more than {MAX_JSON_VALUES} JSON values", "request_too_large", None
    module, name = MODELS[path]
    try:
        request = getattr(importlib.import_module(module), name).model_validate(parsed)
    except ValidationError as exc:
        return validation_refusal(exc.errors(include_url=False, include_context=False, include_input=False))
    problem = _choices_problem(request) or _prompt_problem(request, text_limit)
    if problem is not None:
        return problem.message, problem.code, problem.param
    return None


def _choices_problem(request: Any) -> InvalidParameter | None:
    choices = getattr(request, "guided_choice", None)
    return None if choices is None else choices_problem("guided_choice", choices)


def _prompt_problem(request: Any, text_limit: tuple[int, int] | None) -> InvalidParameter | None:
    """A completions prompt's shape, and its text's size against the route's bound."""
    if text_limit is None or not isinstance(request, CompletionRequest):
        return None
    problem = request.prompt_problem()
    if problem is not None:
        return problem
    prompt = request.prompt  # a string, or a non-empty list (prompt_problem refuses an empty one)
    text = prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt[0], str) else None
    return None if text is None else size_problem("prompt", (text,), *text_limit)


# The worker's start: the gateway's import path, then the loop over the pipe (argv: that path as
# JSON, the gateway's pid).
WORKER_MAIN = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from gateway.api.body_screen import serve; serve(int(sys.argv[2]))"
)
_FRAME = struct.Struct("<Q")  # each message: its length, then its pickle


class WorkerDied(Exception):
    """The worker's pipe broke: it was killed (out of memory, a signal) or exited."""


def _send(out: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_FRAME.pack(len(data)) + data)
    out.flush()


def _receive(source: IO[bytes]) -> Any:
    """The next message, or EOFError where the other end has closed the pipe."""
    head = source.read(_FRAME.size)
    if len(head) < _FRAME.size:
        raise EOFError
    (size,) = _FRAME.unpack(head)
    data = source.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def serve(parent: int) -> None:
    """The worker: screen each body the gateway sends on stdin, answer on stdout, until the
    gateway closes the pipe or dies."""
    die_with(parent)
    # Screening is the background work: when cores are short, the services' steps and the loop go first.
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever an import prints goes to the log, not into the replies
    _warm()
    requests = sys.stdin.buffer
    while True:
        try:
            path, body, text_limit = _receive(requests)
        except EOFError:
            return  # the gateway closed the pipe, or is gone
        try:
            reply: tuple[str, Any] = ("ok", screen(path, body, text_limit))
        except Exception as exc:  # the gateway logs it and lets the route parse the body
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _send(replies, reply)


def _warm() -> None:
    for module, _ in MODELS.values():
        importlib.import_module(module)


class BodyScreen:
    """The worker process and the check of which bodies go to it."""

    def __init__(self, min_bytes: int = SCREEN_BYTES, text_limit: tuple[int, int] | None = None) -> None:
        self.min_bytes = min_bytes
        self.text_limit = text_limit
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # one body in the worker at a time: its replies come in order

    def _worker(self) -> subprocess.Popen[bytes]:
        """The worker, started if there is none. Called on the event loop's thread, which lives as
        long as the gateway: PR_SET_PDEATHSIG fires when the thread that started a child ends."""
        if self._proc is None:
            argv = [sys.executable, "-c", WORKER_MAIN, json.dumps(sys.path), str(os.getpid())]
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        return self._proc

    def start(self) -> None:
        """Start the worker now, so the first large body does not wait for its imports."""
        self._worker()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _exchange(self, proc: subprocess.Popen[bytes], request: tuple[str, bytes, Any]) -> Refusal | None:
        """One body through the worker (on an executor thread). A caller cancelled meanwhile still
        has its exchange finished here, so the next body reads its own reply."""
        assert proc.stdin is not None and proc.stdout is not None
        with self._lock:
            try:
                _send(proc.stdin, request)
                status, value = _receive(proc.stdout)
            except (OSError, EOFError) as exc:
                raise WorkerDied from exc
        if status != "ok":
            raise RuntimeError(value)
        return value  # type: ignore[no-any-return]

    async def refusal(self, path: str, body: bytes) -> Refusal | None:
        """The 400 for `body`, or None to let the route parse it (small, unscreened, or valid)."""
        if len(body) < self.min_bytes or path not in MODELS:
            return None
        proc = self._worker()
        try:
            return await asyncio.get_running_loop().run_in_executor(
                None, self._exchange, proc, (path, body, self.text_limit)
            )
        except WorkerDied:
            # The worker died (killed, out of memory): a new one for the next body; this one is parsed
            # by the route, as it would be without a screen.
            log.warning("the body-screening worker died; starting another")
            self._end(proc)
            return None
        except Exception:
            # The screen only spares the loop; the route stays the judge of a body the screen failed on.
            log.exception("screening a %d-byte body for %s failed; the route parses it", len(body), path)
            return None

    def _end(self, proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
        """End `proc`: its pipe closed, then killed if it has not exited within grace_s; reaped."""
        if self._proc is proc:
            self._proc = None
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        if self._proc is not None:
            self._end(self._proc)
