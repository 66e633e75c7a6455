"""The gateway never imports torch: not with its modules, and not when it loads its tokenizer.
It tokenizes, validates and schedules; tensors are the services' business. Run in a fresh
interpreter, since this test process has torch loaded already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tinymodels


def test_the_gateway_and_its_tokenizer_load_without_torch(tmp_path: Path, tok, tiny_target):
    saved = tinymodels.save(tiny_target, tok, tmp_path / "model")
    code = (
        "import sys\n"
        "import gateway.server\n"
        "print('torch' in sys.modules)\n"
        "from specd.engine import checkpoints\n"
        f"checkpoints.load_tokenizer({str(saved)!r})\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    after_import, after_tokenizer = out.stdout.split()
    assert after_import == "False", "importing gateway.server imports torch"
    assert after_tokenizer == "False", "loading the gateway's tokenizer imports torch"
