"""What cannot work is refused at start, with a clear message, before anything loads or starts.

Ports are owned: a second service, or a second `specd up`, on ports a live stack holds fails, and
the live one keeps serving. An API key that HTTP cannot carry is a start-up error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import stack as st

from specd.rpc.health import check


def run(argv: list[str], timeout_s: float = 120) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "specd.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    return done.returncode, done.stdout + done.stderr


def test_a_second_verifier_on_a_live_verifiers_port_fails_before_loading(backends, model_dirs):
    verifier, _ = backends
    code, output = run(
        ["verifier", "--host", st.HOST, "--port", str(verifier.port), "--model", str(model_dirs["target"])]
    )
    assert code == 2, output
    assert f"cannot start the verifier: in use by another process: verifier port {st.HOST}:{verifier.port}" in output
    assert "KV cache" not in output  # refused before the model loaded
    assert check(verifier.address, timeout_s=5) == "SERVING"


def test_a_gateway_on_a_taken_http_port_fails_before_waiting_for_backends(model_dirs):
    with socket.socket() as held:
        held.bind((st.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        dead = f"{st.HOST}:{st.free_port()}"  # nothing there: the gateway would wait for it
        args = ["--host", st.HOST, "--http-port", str(port), "--grpc-port", str(st.free_port())]
        code, output = run(["gateway", *args, "--verifier", dead, "--tokenizer", str(model_dirs["target"])])
    assert code == 2, output
    assert f"in use by another process: HTTP port {st.HOST}:{port}" in output
    assert "waiting for the verifier" not in output


def test_specd_up_refuses_a_live_stacks_ports_before_starting_anything(backends, model_dirs):
    verifier, drafter = backends
    ports = ["--http-port", str(st.free_port()), "--grpc-port", str(st.free_port())]
    ports += ["--verifier-port", str(verifier.port), "--drafter-port", str(drafter.port)]
    code, output = run(["up", *ports, "--target-model", str(model_dirs["target"]), "--placement", "shared"])
    assert code == 2, output
    assert "in use by another process: " in output and "nothing started" in output
    assert f"verifier port 127.0.0.1:{verifier.port}" in output and f"drafter port 127.0.0.1:{drafter.port}" in output
    assert "placement" not in output and "healthy" not in output  # no child was started
    assert check(verifier.address, timeout_s=5) == "SERVING"


def test_a_gateway_with_an_api_key_http_cannot_carry_fails_at_start(model_dirs):
    dead = f"{st.HOST}:{st.free_port()}"  # nothing there: the gateway would wait for it
    args = ["--host", st.HOST, "--http-port", str(st.free_port()), "--grpc-port", str(st.free_port())]
    args += ["--api-key", "good-key,caf\u00e9", "--verifier", dead, "--tokenizer", str(model_dirs["target"])]
    code, output = run(["gateway", *args])
    assert code == 2, output
    assert "API key 2 has characters an HTTP header cannot carry" in output
    assert "waiting for the verifier" not in output
