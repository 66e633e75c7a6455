"""The gateway never imports torch: it tokenizes, validates and schedules, and tensors are the
services' business. Run in a fresh interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys


def test_the_gateway_imports_no_torch():
    code = "import sys, gateway.server\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False"], "importing gateway.server imports torch"
