"""Two services on one GPU: specd up starts CUDA MPS, uses one running, or falls back to the
sequential pipeline and says why (specd.mps), checked against a fake nvidia-cuda-mps-control."""

from __future__ import annotations

import argparse
import os
import socket
import stat
from pathlib import Path

import pytest

from specd import cli, mps

# A stand-in for the MPS control client: `-d` starts the "daemon" (a file), and a command on stdin
# succeeds only while it runs; `quit` stops it. Every call is logged.
FAKE = """#!/bin/sh
state="{state}"
echo "$*" >> "{state}.calls"
if [ "$1" = "-d" ]; then
  [ -n "{refuse}" ] && exit 1
  touch "$state"; exit 0
fi
read -r command
echo "$command" >> "{state}.calls"
[ -f "$state" ] || {{ echo "Cannot find MPS control daemon process" >&2; exit 1; }}
[ "$command" = quit ] && rm -f "$state"
exit 0
"""


def fake_control(tmp_path: Path, monkeypatch, refuse: bool = False) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "daemon"
    exe = bin_dir / mps.CONTROL
    exe.write_text(FAKE.format(state=state, refuse="yes" if refuse else ""))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return state


def calls(state: Path) -> list[str]:
    path = Path(f"{state}.calls")
    return path.read_text().split("\n")[:-1] if path.exists() else []


def test_a_shared_gpu_starts_mps_and_stops_only_the_daemon_it_started(tmp_path: Path, monkeypatch) -> None:
    state = fake_control(tmp_path, monkeypatch)
    shared = mps.decide("auto", "cuda", "cuda:0", None)
    assert shared is not None and shared.mps and shared.started and shared.pipeline == "auto"
    assert "started the CUDA MPS daemon" in shared.message and state.exists()
    mps.stop_daemon(shared.started)
    assert not state.exists() and calls(state)[-1] == "quit"
    # One already running: used, and left running at exit.
    state.touch()
    again = mps.decide("auto", "cuda:0", "cuda:0", "ahead")
    assert again is not None and again.mps and not again.started and again.pipeline == "ahead"
    assert "found a CUDA MPS daemon running" in again.message
    mps.stop_daemon(again.started)
    assert state.exists() and "-d" not in calls(state)[-2:]


def test_without_mps_the_sequential_pipeline_and_why(tmp_path: Path, monkeypatch) -> None:
    fake_control(tmp_path, monkeypatch, refuse=True)
    shared = mps.decide("auto", "cuda", "cuda", None)
    assert shared is not None and not shared.mps and shared.pipeline == "sequential"
    assert "did not start a daemon" in shared.message and "sequential pipeline" in shared.message
    named = mps.decide("auto", "cuda", "cuda", "ahead")
    assert named is not None and named.pipeline == "ahead" and "will not overlap" in named.message
    with pytest.raises(ValueError, match="--shared-gpu mps: CUDA MPS cannot be had here"):
        mps.decide("mps", "cuda", "cuda", None)


def test_no_control_client_on_path(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    shared = mps.decide("auto", "cuda:1", "cuda:1", None)
    assert shared is not None and shared.pipeline == "sequential" and f"no {mps.CONTROL} on PATH" in shared.message
    off = mps.decide("off", "cuda", "cuda", None)
    assert off is not None and not off.mps and off.pipeline == "sequential"


def test_services_apart_need_no_mps(tmp_path: Path, monkeypatch) -> None:
    state = fake_control(tmp_path, monkeypatch)
    assert mps.decide("auto", "cuda:0", "cuda:1", None) is None
    assert mps.decide("auto", "cpu", "cpu", None) is None
    assert mps.decide("mps", "cpu", "cuda", None) is None
    assert calls(state) == []  # the daemon was never asked about
    assert mps.same_gpu("cuda", "cuda:0") and not mps.same_gpu("cuda:0", "cuda:1")
    with pytest.raises(ValueError, match="--shared-gpu takes auto, mps, off"):
        mps.decide("always", "cuda", "cuda", None)


def test_specd_up_says_what_it_chose(tmp_path: Path, monkeypatch, capsys) -> None:
    fake_control(tmp_path, monkeypatch, refuse=True)

    def args(**kw) -> argparse.Namespace:
        base = {"drafter_device": "cuda", "verifier_device": "cuda", "pipeline": None, "shared_gpu": "auto"}
        return argparse.Namespace(**{**base, **kw})

    a = args()
    assert cli.shared_gpu(a, "model") is not None and a.pipeline == "sequential"
    assert "specd up: both services share one GPU without MPS" in capsys.readouterr().err
    two = args(drafter_device="cuda:0", verifier_device="cuda:1")
    assert cli.shared_gpu(two, "model") is None and two.pipeline == "auto"  # two GPUs: they truly overlap
    ngram = args()
    assert cli.shared_gpu(ngram, "ngram") is None and ngram.pipeline is None  # no model drafter on the GPU


def test_specd_up_passes_the_gpu_flags_to_both_services(tmp_path: Path, monkeypatch, capsys) -> None:
    from specd import launch

    monkeypatch.setenv("PATH", str(tmp_path))  # no MPS control client here
    started: dict[str, list[str]] = {}

    class Recorder:
        stopping = False

        def __init__(self, healthy, spawn) -> None:
            pass

        def add(self, name: str, argv: list[str], health: str) -> None:
            started[name] = argv

        def start(self) -> None:
            pass

        def wait_up(self, timeout_s: float) -> None:
            raise launch.GiveUp("recorded")

        def request_stop(self) -> None:
            pass

        def stop_all(self, first: tuple[str, ...] = (), first_grace_s: float = 0.0) -> None:
            pass

    monkeypatch.setattr(launch, "Supervisor", Recorder)
    monkeypatch.setattr(cli.signal, "signal", lambda *_: None)  # pytest keeps its own handlers
    model = str(tmp_path / "model")
    argv = ["--target-model", model, "--drafter", "model", "--quantize", "none"]
    # Free ports: a `specd up` already running on the defaults must not fail this test at the port check.
    for name in ("http", "grpc", "drafter", "verifier", "drafter-metrics", "verifier-metrics"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            argv += [f"--{name}-port", str(probe.getsockname()[1])]
    argv += [
        "--drafter-device",
        "cuda",
        "--verifier-device",
        "cuda:0",
        "--load-format",
        "synthetic",
        "--synthetic-agreement",
        "0.6",
        "--synthetic-seed",
        "4",
        "--cuda-graphs",
        "off",
    ]
    with pytest.raises(SystemExit):
        cli.up(argv)
    for service in ("verifier", "drafter"):
        args = started[service]
        assert args[args.index("--load-format") + 1] == "synthetic"
        assert args[args.index("--synthetic-seed") + 1] == "4"
        assert args[args.index("--cuda-graphs") + 1] == "off"
    assert started["drafter"][started["drafter"].index("--synthetic-agreement") + 1] == "0.6"
    gateway = started["gateway"]
    assert gateway[gateway.index("--pipeline") + 1] == "sequential"
    assert f"no {mps.CONTROL} on PATH" in capsys.readouterr().err
