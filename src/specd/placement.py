"""Where a service's torch work runs on the CPU: which cores, how many threads.

On a machine without accelerators the drafter and the verifier compete for the
same cores; pinning each to its own cores lets both compute at once, which is
what overlapped speculation needs (see docs/pipeline.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from specd.engine.cpus import pin

# Split the cores between the services only if the target, on its half, steps at most this much
# slower than on all of them: what overlapping the drafter gains with split cores (docs/benchmarks.md,
# "Placement") can then win that back.
SPLIT_IF_SLOWDOWN_AT_MOST = 1.25


@dataclass(frozen=True)
class CpuPlacement:
    """Which cores and threads `specd up` gives each service ("" and 0: no pinning, torch's default)."""

    split: bool
    verifier_cpus: str = ""
    drafter_cpus: str = ""
    verifier_threads: int = 0
    drafter_threads: int = 0
    reason: str = ""


def cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    parts: list[str] = []
    for _, run in groupby(enumerate(sorted(set(cpus))), key=lambda pair: pair[1] - pair[0]):
        ids = [cpu for _, cpu in run]
        parts.append(str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}")
    return ",".join(parts)


def split_placement(cpus: Iterable[int], reason: str = "") -> CpuPlacement:
    """The verifier on the first half of `cpus` (the larger half if odd), the drafter on the rest."""
    ordered = sorted(set(cpus))
    if len(ordered) < 2:
        raise ValueError(f"splitting the cores needs at least 2 CPUs; this process may use {ordered}")
    verifier, drafter = ordered[: (len(ordered) + 1) // 2], ordered[(len(ordered) + 1) // 2 :]
    return CpuPlacement(True, cpu_list(verifier), cpu_list(drafter), len(verifier), len(drafter), reason)


def choose_cpu_placement(step_all_s: float, step_half_s: float, cpus: Iterable[int]) -> CpuPlacement:
    """Split the cores if the target's step on the verifier's half is at most SPLIT_IF_SLOWDOWN_AT_MOST
    slower than on all of them (a memory-bound step), else share them."""
    slowdown = step_half_s / step_all_s
    reason = f"the target's one-token step took {slowdown:.2f}x as long on half the cores as on all of them"
    if slowdown <= SPLIT_IF_SLOWDOWN_AT_MOST:
        return split_placement(cpus, reason)
    return CpuPlacement(False, reason=reason)


def time_target_step(model: str, dtype: str, cpus: Iterable[int], timeout_s: float = 300.0) -> float:
    """Seconds of one batched one-token step of `model` on CPUs `cpus` (one thread each), measured in
    a child process so that neither the pinning nor the threads stay with the caller."""
    command = [sys.executable, "-m", "specd.placement", model, dtype, cpu_list(cpus)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"timing the target's step failed: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def measured_steps(
    model: str, dtype: str, cpus: Iterable[int], cache: Path | None, recalibrate: bool = False
) -> tuple[float, float, bool]:
    """(the target's step on all `cpus`, on the verifier's half of them, whether from `cache`).

    Measured once per CPU, cores, weights, torch and kernel source (`specd.engine.calibration`'s
    key), and kept in `cache` (a directory), so later starts on the same machine do not load the
    target twice more to decide; a new kernel, torch or model measures again, as `recalibrate` does.
    """
    from specd.engine import calibration

    ordered = sorted(set(cpus))
    half = ordered[: (len(ordered) + 1) // 2]
    # What the verifier runs by default: its one-row products chosen as the verifier chooses them.
    key = {**calibration.machine_key(0), "cores": ordered, "model": _weights(model), "dtype": dtype, "forward": "auto"}
    path = calibration.entry_path("placement", key, cache) if cache else None
    saved = calibration.read_entry(path, key) if path is not None and not recalibrate else None
    if isinstance(saved, list) and len(saved) == 2:
        return float(saved[0]), float(saved[1]), True
    step_all, step_half = time_target_step(model, dtype, ordered), time_target_step(model, dtype, half)
    if path is not None:
        calibration.write_entry(path, key, [step_all, step_half])
    return step_all, step_half, False


def _weights(model: str) -> str:
    """The weights' identity where their files are at hand, else the spec as given."""
    from specd.engine import calibration
    from specd.engine.checkpoints import ModelLoadError

    try:
        return calibration.model_identity(model)
    except (ModelLoadError, OSError):
        return model


def _step_seconds(model: str, dtype: str, cpus: str) -> float:
    import torch

    from specd.engine import fused_llama
    from specd.engine.kvcache import BatchedCausalLM, Row
    from specd.engine.models import load_model, parse_dtype

    pinned = pin(cpus)
    torch.set_num_threads(len(pinned))
    cpu, torch_dtype = torch.device("cpu"), parse_dtype(dtype)
    # The verifier's default forward (its --decoder auto).
    lm = BatchedCausalLM(fused_llama.choose(load_model(model, cpu, torch_dtype), "auto", "timing"), cpu, torch_dtype)
    lm.reserve(1, 64)
    lm.calibrate_products(1)  # the one-row products the verifier would choose on these cores
    with torch.inference_mode():
        lm.forward([Row(0, 0, [0] * 16, 15)])
        times = []
        for position in range(16, 28):
            start = time.perf_counter()
            lm.forward([Row(0, position, [0], 0)])
            times.append(time.perf_counter() - start)
    return sorted(times[2:])[len(times[2:]) // 2]


if __name__ == "__main__":
    print(_step_seconds(sys.argv[1], sys.argv[2], sys.argv[3]))
