"""CUDA MPS for a drafter and a verifier that share one GPU.

Two processes on one GPU without MPS get the GPU in turns: the driver time-slices their contexts,
so a draft-ahead or cohort pipeline, which runs a draft beside a verify, does not overlap at all
(on an H100 a verify exchange grew from 28 to 115 ms; docs/measurements.md, "Measured on a GPU").
The MPS daemon (`nvidia-cuda-mps-control -d`) lets both processes' kernels run at once. `specd up`
(and deploy/launch.sh) start it where both services go to one GPU, or use one already running,
and otherwise choose the sequential pipeline, which never runs the two at once.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass

CONTROL = "nvidia-cuda-mps-control"
SHARED_GPU_CHOICES = ("auto", "mps", "off")


def _control(command: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str] | None:
    """`command` sent to the MPS control client; None where there is no client on PATH."""
    exe = shutil.which(CONTROL)
    if exe is None:
        return None
    try:
        return subprocess.run([exe], input=command + "\n", capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None


def running() -> bool:
    """Whether an MPS control daemon answers (its client reaches it through the pipe directory)."""
    done = _control("get_server_list")
    return done is not None and done.returncode == 0


def start_daemon() -> bool | None:
    """Start the MPS control daemon: True if this call started it, False if one ran already,
    None where it cannot be had (no client on PATH, or the daemon did not come up)."""
    if shutil.which(CONTROL) is None:
        return None
    if running():
        return False
    try:
        done = subprocess.run([CONTROL, "-d"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    # The daemon forks away from `-d` before its pipe answers.
    deadline = time.monotonic() + 5.0
    while not running():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    return True


def stop_daemon(started: bool | None) -> None:
    """Stop the daemon if `start_daemon` started it (never one that ran before)."""
    if started:
        _control("quit")


def same_gpu(a: str, b: str) -> bool:
    """Whether two torch device names are the same CUDA device (cuda is cuda:0)."""
    if not (a.startswith("cuda") and b.startswith("cuda")):
        return False
    return (a.partition(":")[2] or "0") == (b.partition(":")[2] or "0")


@dataclass(frozen=True)
class SharedGpu:
    """What `specd up` does about two services on one GPU."""

    mps: bool  # the two run under MPS
    started: bool  # this `specd up` started the daemon (and stops it at exit)
    pipeline: str | None  # the pipeline to run, where it must change; None: as chosen
    message: str


def decide(choice: str, drafter_device: str, verifier_device: str, pipeline: str | None) -> SharedGpu | None:
    """For `--shared-gpu` `choice`: None where the services do not share a GPU, else whether they
    run under MPS (starting the daemon where none runs) and, without it, the sequential pipeline
    unless one was named. Raises ValueError where `mps` was asked for and cannot be had."""
    if choice not in SHARED_GPU_CHOICES:
        raise ValueError(f"--shared-gpu takes {', '.join(SHARED_GPU_CHOICES)}, not {choice!r}")
    if not same_gpu(drafter_device, verifier_device):
        return None
    if choice == "off":
        return SharedGpu(False, False, pipeline or "sequential", _without("--shared-gpu off", pipeline))
    started = start_daemon()
    if started is None:
        why = f"no {CONTROL} on PATH" if shutil.which(CONTROL) is None else f"{CONTROL} -d did not start a daemon"
        if choice == "mps":
            raise ValueError(f"--shared-gpu mps: CUDA MPS cannot be had here ({why})")
        return SharedGpu(False, False, pipeline or "sequential", _without(why, pipeline))
    how = "started the CUDA MPS daemon" if started else "found a CUDA MPS daemon running"
    return SharedGpu(True, started, pipeline or "auto", f"both services share {verifier_device}: {how}")


def _without(why: str, pipeline: str | None) -> str:
    if pipeline in ("ahead", "cohort", "auto"):
        return (
            f"both services share one GPU without MPS ({why}): the driver time-slices them, so the "
            f"{pipeline} pipeline asked for will not overlap a draft with a verify"
        )
    return (
        f"both services share one GPU without MPS ({why}): the driver would time-slice them, "
        "so the sequential pipeline, which never runs the two at once"
    )
