"""`specd distill` on a tiny target: the drafter it writes is served, fingerprinted and exact."""

from __future__ import annotations

import subprocess
import sys

import pytest
import stack as st
from references import PROMPTS, greedy_references
from test_exactness import grpc_generate

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, model_dirs):
    out = tmp_path_factory.mktemp("distilled") / "drafter"
    work = out.parent / "work"
    cmd = [
        sys.executable, "-m", "specd.cli", "distill",
        "--target", str(model_dirs["target"]),
        "--out", str(out),
        "--work-dir", str(work),
        "--budget-minutes", "0.1",
        "--gen-batch", "8",
        "--max-new-tokens", "12",
        "--draft-vocab", "256",
        "--teacher-dtype", "float32",
        "--eval-max-tokens", "8",
        "--threads", "1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, work


def test_distill_writes_a_drafter_with_a_model_card(distilled):
    out, work = distilled
    for name in ("config.json", "model.safetensors", "specd_drafter.json", "README.md", "tokenizer.json"):
        assert (out / name).is_file(), name
    card = (out / "README.md").read_text()
    assert ("specd distill" in card and "--seed" not in card) or "seed 0" in card
    assert (work / "train.pt").is_file()  # a checkpoint to resume from


def test_distilled_drafter_is_served_and_greedy_output_is_the_targets(distilled, model_dirs, tok, tiny_target, log_dir):
    out, _ = distilled
    references = greedy_references(tok, tiny_target, PROMPTS[:4], MAX_TOKENS)
    # start_gateway checks the drafter's tokenizer fingerprint against the verifier's.
    stack = st.start_stack(model_dirs["target"], out, log_dir, k=4)
    try:
        for prompt in PROMPTS[:4]:
            reply = grpc_generate(stack.gateway, prompt, MAX_TOKENS)
            assert list(reply.token_ids) == references[prompt], prompt
        assert "refusing drafter" not in stack.gateway.output()
    finally:
        stack.stop()
