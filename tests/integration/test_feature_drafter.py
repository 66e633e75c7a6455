"""The shipped feature drafter through `specd up --drafter distilled` on the embedded model: it reads the
verifier's hidden states, its drafts are accepted as often as its model card says, and greedy output is
the target's own."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import stack as st
import torch

from specd import models

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three colours of the rainbow.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    ports = {name: st.free_port() for name in ("http", "grpc", "drafter", "verifier")}
    log: Path = tmp_path_factory.mktemp("up-feature") / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "specd.cli", "up",
                "--http-port", str(ports["http"]),
                "--grpc-port", str(ports["grpc"]),
                "--drafter-port", str(ports["drafter"]),
                "--verifier-port", str(ports["verifier"]),
                "--drafter", "distilled",
                "--speculative-mode", "fixed",
                "--placement", "shared",
                "-k", "3",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while "specd is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield f"http://{st.HOST}:{ports['http']}", log
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log.read_text()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_the_feature_drafter_drafts_from_the_targets_states_and_output_stays_the_targets(up):
    base, log = up
    tokenizer = models.load_tokenizer("embedded")
    target = models.load_model("embedded", torch.device("cpu"), torch.float32)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        reply = httpx.post(
            base + "/v1/chat/completions",
            json={"model": NAME, "messages": messages, "max_tokens": 48, "temperature": 0},
            timeout=300,
        ).json()
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        out = target.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)
        assert reply["choices"][0]["message"]["content"] == tokenizer.decode(
            out[0, len(ids) :], skip_special_tokens=True
        ), question
    metrics = httpx.get(base + "/metrics", timeout=30).text
    drafted = metric(metrics, "specd_spec_decode_num_draft_tokens")
    accepted = metric(metrics, "specd_spec_decode_num_accepted_tokens")
    assert drafted > 50
    # The model card's held-out acceptance at k = 4 is 0.10; a head fed zeros instead of the target's
    # states drafts from the token embedding alone and is accepted far less often.
    assert accepted / drafted > 0.05, (accepted, drafted)
    assert "it reads the target's hidden states" in log.read_text(errors="replace")
