"""A stopped service ends its process without the interpreter's teardown, after flushing its logs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import logging, logging.handlers, sys
from specd.rpc.serving import exit_at_once
# A handler that holds its records until it is flushed or closed (as logging.shutdown does).
held = logging.handlers.MemoryHandler(100, flushLevel=logging.CRITICAL, target=logging.FileHandler(sys.argv[1]))
logging.basicConfig(handlers=[held], level=logging.INFO)
logging.getLogger("svc").info("stopping")
sys.stdout.write("unflushed")  # a pipe's buffer: written out only by a flush
exit_at_once(3)
"""


def test_exit_at_once_flushes_the_log_and_stdout_and_keeps_the_code(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed"
    assert "stopping" in log.read_text()
