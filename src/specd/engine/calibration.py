"""Start-up timing choices kept on disk, so that a machine pays them once per model and build.

A service on the CPU times its kernels at start-up (`specd.engine.timing`): which product runs for
which row count, and what a step costs. Those choices depend only on the CPU, the cores and threads
the service runs on, the model's weights and dtype, torch and the kernel's source, so they are kept
under the cache directory keyed by exactly those, and a later start (a second `make run`, a
supervisor's restart, the other service of the same stack holding the same weights) reads them
instead of timing again. `--recalibrate` times again and replaces them.

Timing is done under a lock per core (`cores_alone`): two services that time on the same cores do so
one after the other, since each would read the other's work as its own cost; services on cores of
their own time at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from specd.engine.checkpoints import cache_dir
from specd.engine.cpus import cpu_model

log = logging.getLogger(__name__)

# Bump when what a calibration measures, or how its result is read, changes: older entries are then ignored.
CALIBRATION_VERSION = 1
# How much of each end of a weight file keys its content (a whole 8B checkpoint would take seconds to hash).
SAMPLE_BYTES = 1 << 20
KERNEL_SOURCES = ("gemv.c", "layer.c")
_STARTED = time.time()


def calibration_dir() -> Path:
    return cache_dir() / "calibration"


def file_identity(path: Path) -> str:
    """A file's size and the hash of its first and last SAMPLE_BYTES: its content, not its times."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(SAMPLE_BYTES))
        if size > 2 * SAMPLE_BYTES:
            f.seek(size - SAMPLE_BYTES)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def model_identity(spec: str, load_format: str = "auto") -> str:
    """What identifies the weights `spec` loads: every file of its directory by `file_identity` (the
    embedded model's converted directory is named by its GGUF's whole hash); for weights made at
    load time (`--load-format dummy`), its config.json and the format."""
    from specd.engine.checkpoints import materialize

    path = Path(spec) if load_format != "auto" else materialize(spec)
    if path.is_file():
        return file_identity(path)
    files = sorted(p for p in path.iterdir() if p.is_file())
    if load_format != "auto":
        files = [p for p in files if p.name == "config.json"]
    digest = hashlib.sha256(load_format.encode())
    for p in files:
        digest.update(f"{p.name}:{file_identity(p)};".encode())
    return digest.hexdigest()[:16]


def kernel_identity() -> str:
    """The hash of the CPU kernel's C sources: a change to them may change every choice."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in KERNEL_SOURCES:
        with contextlib.suppress(OSError):
            digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def machine_key(threads: int) -> dict[str, Any]:
    """The parts of a key that any timing on this process's cores shares."""
    return {
        "version": CALIBRATION_VERSION,
        "cpu": cpu_model(),
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": threads,
        "torch": importlib.metadata.version("torch"),
        "kernel": kernel_identity(),
    }


def entry_path(name: str, key: dict[str, Any], directory: Path | None = None) -> Path:
    text = json.dumps(key, sort_keys=True)
    return (directory or calibration_dir()) / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def read_entry(path: Path, key: dict[str, Any], newer_than: float = 0.0) -> Any | None:
    """The value kept at `path` for exactly `key` (written after `newer_than`), or None."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(key)):
        return None
    if float(saved.get("written", 0)) < newer_than:
        return None
    return saved.get("value")


def write_entry(path: Path, key: dict[str, Any], value: Any) -> None:
    """Keep `value` at `path` (atomically: a service reading it meanwhile sees the old file or the new one)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"key": key, "written": time.time(), "value": value}, sort_keys=True))
        os.replace(temporary, path)
    except OSError as exc:  # a read-only cache only costs the next start its timing
        log.warning("could not keep the start-up timings in %s: %s", path, exc)


def cached(
    name: str,
    key: dict[str, Any],
    measure: Callable[[], Any],
    recalibrate: bool = False,
    directory: Path | None = None,
) -> tuple[Any, bool]:
    """(`measure()`'s value for `key`, whether it was read from the cache). The measurement runs
    with this process's cores to itself among services (`cores_alone`); a service that waited
    there for another timing the same key reads the other's result. With `recalibrate`, only
    an entry written since this process started counts."""
    path = entry_path(name, key, directory)
    newer_than = _STARTED if recalibrate else 0.0
    value = read_entry(path, key, newer_than)
    if value is not None:
        log.info("start-up timing %s: kept in %s (--recalibrate times it again)", name, path)
        return value, True
    with cores_alone():
        value = read_entry(path, key, newer_than)
        if value is not None:
            log.info("start-up timing %s: measured by another service, kept in %s", name, path)
            return value, True
        value = measure()
        write_entry(path, key, value)
    return value, False


@contextlib.contextmanager
def cores_alone(cores: Iterable[int] | None = None, directory: Path | None = None) -> Iterator[None]:
    """Hold a lock for each of `cores` (default: this process's), in order, so services timing on
    any of the same cores take turns and services on cores of their own do not wait. Where the
    locks cannot be made (a read-only cache), the timing runs unlocked."""
    directory = directory or calibration_dir() / "locks"
    held: list[int] = []
    try:
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            for core in sorted(set(cores if cores is not None else os.sched_getaffinity(0))):
                fd = os.open(directory / f"core-{core}.lock", os.O_CREAT | os.O_RDWR, 0o600)
                held.append(fd)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in held:
            os.close(fd)  # releases its lock


def model_key(lm: Any, spec: str, load_format: str) -> dict[str, Any]:
    """The key of timings of `lm` (loaded from `spec`) on this process's cores and threads."""
    import torch

    return {
        **machine_key(torch.get_num_threads()),
        "model": model_identity(spec, load_format),
        "dtype": str(lm.dtype),
        "forward": type(lm.model.base_model).__name__,
    }


def calibrate_products(
    lm: Any, spec: str, load_format: str, max_rows: int, recalibrate: bool = False, activations: str = "float32"
) -> str:
    """`lm.calibrate_products(max_rows, activations=activations)`, with whatever it times (the LM
    head's torch products, where the CPU kernel cannot take them) timed once per key and read back
    at later starts. A drafter and a verifier holding the same weights on the same cores share the
    entry. Returns the activations taken ("auto" resolved)."""
    if lm.device.type != "cpu":
        if activations not in ("float32", "auto"):
            raise ValueError(f"--activations {activations} takes the CPU kernel, not a {lm.device.type} model")
        return "float32"
    key = {**model_key(lm, spec, load_format), "rows": max_rows}
    return lm.calibrate_products(
        max_rows, kept=lambda measure: cached("head", key, measure, recalibrate)[0], activations=activations
    )


def forget(directory: Path | None = None) -> int:
    """Drop every kept timing (`--recalibrate`); how many there were."""
    dropped = 0
    for path in (directory or calibration_dir()).glob("*.json"):
        with contextlib.suppress(OSError):
            path.unlink()
            dropped += 1
    return dropped
