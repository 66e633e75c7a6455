"""The embedded SmolLM2-135M through `specd up`: speculative output equals the target alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
import stack as st
import torch

from specd import models

pytestmark = pytest.mark.slow


def test_specd_up_serves_the_embedded_model_exactly(tmp_path):
    ports = {name: st.free_port() for name in ("http", "grpc", "drafter", "verifier")}
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "specd.cli", "up",
                "--http-port", str(ports["http"]),
                "--grpc-port", str(ports["grpc"]),
                "--drafter-port", str(ports["drafter"]),
                "--verifier-port", str(ports["verifier"]),
                "-k", "4",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        url = f"http://{st.HOST}:{ports['http']}"
        deadline = time.monotonic() + 300
        while "specd is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        models_reply = httpx.get(url + "/v1/models").json()
        name = models_reply["data"][0]["id"]
        assert name == "SmolLM2-135M-Instruct"
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
        reply = httpx.post(
            url + "/v1/chat/completions",
            json={"model": name, "messages": messages, "max_tokens": 40, "temperature": 0},
            timeout=300,
        ).json()
        text = reply["choices"][0]["message"]["content"]

        tokenizer = models.load_tokenizer("embedded")
        target = models.load_model("embedded", torch.device("cpu"), torch.float32)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        out = target.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
        assert text == expected
        assert "Paris" in text
        assert reply["usage"]["completion_tokens"] == len(out[0]) - len(ids)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    assert code == 0, log.read_text()
