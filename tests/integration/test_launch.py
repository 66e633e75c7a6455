"""deploy/launch.sh end to end on a host without GPUs: TLS, mutual TLS and an API key through `specd up`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import certs as certgen
import grpc
import httpx
import pytest
import stack as st

from specd.proto.speculative.v1 import verifier_pb2, verifier_pb2_grpc
from specd.rpc.health import check
from specd.rpc.tls import channel_credentials

LAUNCH = Path(__file__).resolve().parents[2] / "deploy" / "launch.sh"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((st.HOST, port)) == 0


@pytest.mark.timeout(240)
def test_launch_script_serves_and_stops_cleanly(model_dirs, log_dir, tmp_path):
    certs = certgen.make_certs(tmp_path / "certs")
    ports = {name: st.free_port() for name in ("http", "grpc", "drafter", "verifier")}
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        SPECD=f"{sys.executable} -m specd.cli",
        SPECD_GPU_COUNT="0",
        SPECD_VERIFIER_MODEL=str(model_dirs["target"]),
        SPECD_DRAFTER_MODEL=str(model_dirs["draft"]),
        SPECD_DRAFTER_DTYPE="float32",
        SPECD_DRAFTER_QUANTIZE="none",
        SPECD_GATEWAY_HOST=st.HOST,
        SPECD_GATEWAY_HTTP_PORT=str(ports["http"]),
        SPECD_GATEWAY_GRPC_PORT=str(ports["grpc"]),
        SPECD_DRAFTER_PORT=str(ports["drafter"]),
        SPECD_VERIFIER_PORT=str(ports["verifier"]),
        SPECD_GATEWAY_NUM_SPECULATIVE_TOKENS="3",
        SPECD_TLS_CERT=str(certs.server_cert),
        SPECD_TLS_KEY=str(certs.server_key),
        SPECD_TLS_CA=str(certs.ca),
        SPECD_TLS_CLIENT_CERT=str(certs.client_cert),
        SPECD_TLS_CLIENT_KEY=str(certs.client_key),
        SPECD_GATEWAY_API_KEY="launch-key",
    )
    log = log_dir / "launch.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", str(LAUNCH), "--max-context", "256", "--startup-timeout", "150"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # Its own process group: a failing test can end the launcher and its services together.
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while "specd is up" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"launch.sh exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not up after 180 s:\n{log.read_text()}"
            time.sleep(0.3)
        output = log.read_text()
        # No GPU counted: the CPU for both, unless the environment names the devices (a GPU check does).
        devices = [os.environ.get(f"SPECD_{s}_DEVICE", "cpu") for s in ("DRAFTER", "VERIFIER")]
        assert "drafter on {}, verifier on {}".format(*devices) in output
        assert f"https://{st.HOST}:{ports['http']}/v1" in output

        trust = ssl.create_default_context(cafile=str(certs.ca))
        url = f"https://{st.HOST}:{ports['http']}/v1/completions"
        body = {"model": "target", "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        assert httpx.post(url, json=body, verify=trust, timeout=30).status_code == 401
        reply = httpx.post(url, json=body, verify=trust, headers={"Authorization": "Bearer launch-key"}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8

        # specd up made a token for its backends: even the gateway's own client certificate
        # (mutual TLS passes) gets no answer without it; health checks stay open for probes.
        assert "answer only the gateway: by a random token made for this run" in output
        credentials = channel_credentials(str(certs.ca), str(certs.client_cert), str(certs.client_key))
        verifier = f"{st.HOST}:{ports['verifier']}"
        with grpc.secure_channel(verifier, credentials) as channel:
            stub = verifier_pb2_grpc.VerifierServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert check(verifier, credentials) == "SERVING"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=45) == 0, log.read_text()
        for name, port in ports.items():
            assert not _listening(port), f"the {name} port {port} is still open after the launcher stopped"
    finally:
        # Also reaches services the launcher failed to stop.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
