"""A fork server for the tests' services: imports what a service imports once, then forks a child
per service asked for, which runs `specd NAME ARGS` as `python -m specd.cli` would.

A service's start is mostly imports (torch, transformers' model classes, grpc): a few seconds of
CPU each, paid by about a hundred services in `make test`, on the two cores its workers share.
A forked child starts from the imported modules instead; what it runs from there, model loading
included, is the command's own code. Tests of how services are launched and supervised go
through `specd up` and the launch scripts, which this never touches.

Protocol, one JSON line each way: {"argv", "env", "cwd", "log", "status"} in, the child's pid out.
The child's exit status (a negative signal number where a signal ended it, as Popen's) is
written to "status" once the child is reaped. The server exits when its stdin closes, and dies
with the test process that started it; its children die with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1


def preload() -> None:
    # What `specd verifier|drafter|gateway` imports before it serves, lazily included.
    import grpc  # noqa: F401
    import torch  # noqa: F401
    import transformers.modeling_utils
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import drafter_service.server  # noqa: F401
    import gateway.server  # noqa: F401
    import specd.cli  # noqa: F401
    import verifier_service.server  # noqa: F401


def write_status(path: str, status: int) -> None:
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with open(path + ".tmp", "w") as f:
        f.write(str(code))
    os.replace(path + ".tmp", path)


def reap(statuses: dict[int, str]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        write_status(statuses.pop(pid), status)


def serve() -> dict[str, Any] | None:
    """Forks on each request; returns the request in the child, None in the server at EOF."""
    statuses: dict[int, str] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        reap(statuses)
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            statuses[pid] = request["status"]
            os.write(1, f"{pid}\n".encode())


def become(request: dict[str, Any]) -> None:
    """In the child: the service's own process, as `subprocess.Popen` would have set it up."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["specd", *request["argv"]]


def main() -> None:
    # As for `python -m`: the working directory first on the path, not this file's folder.
    sys.path[0] = os.getcwd()
    preload()
    os.write(1, b"ready\n")
    request = serve()
    if request is None:
        return
    become(request)
    from specd.cli import main as specd

    # The interpreter's own exit follows, as for `python -m specd.cli`: threads joined, atexit run.
    specd(request["argv"])


if __name__ == "__main__":
    main()
