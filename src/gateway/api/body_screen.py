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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from pydantic import ValidationError

from gateway.api.prompts import size_problem
from gateway.api.protocol import CompletionRequest
from gateway.api.validation import InvalidParameter, choices_problem, validation_refusal

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


def _start_worker() -> None:
    # Screening is the background work: when cores are short, the services' steps and the loop go first.
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    _warm()


def _warm() -> None:
    for module, _ in MODELS.values():
        importlib.import_module(module)


class BodyScreen:
    """The worker process and the check of which bodies go to it."""

    def __init__(self, min_bytes: int = SCREEN_BYTES, text_limit: tuple[int, int] | None = None) -> None:
        self.min_bytes = min_bytes
        self.text_limit = text_limit
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the gateway's gRPC threads must not be copied mid-call.
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(1, mp_context=context, initializer=_start_worker)
        return self._pool

    def start(self) -> None:
        """Start the worker now, so the first large body does not wait for its imports."""
        self._executor().submit(_warm)

    async def refusal(self, path: str, body: bytes) -> Refusal | None:
        """The 400 for `body`, or None to let the route parse it (small, unscreened, or valid)."""
        if len(body) < self.min_bytes or path not in MODELS:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._executor(), screen, path, body, self.text_limit
            )
        except BrokenProcessPool:
            # The worker died (killed, out of memory): a new one for the next body; this one is parsed
            # by the route, as it would be without a screen.
            log.warning("the body-screening worker died; starting another")
            self._pool = None
            return None
        except Exception:
            # The screen only spares the loop; the route stays the judge of a body the screen failed on.
            log.exception("screening a %d-byte body for %s failed; the route parses it", len(body), path)
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
