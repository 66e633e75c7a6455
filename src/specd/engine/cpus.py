"""Which CPUs a process may run on: the `--cpus` lists every service takes."""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> set[int]:
    """'0', '0-3', '0,2,4-5' -> a set of CPU ids; '' -> empty (no pinning)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"bad CPU list {spec!r}: expected ids and ranges such as 0,2-3") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {spec!r}")
        cpus.update(range(first, last + 1))
    return cpus


def pin(spec: str) -> set[int]:
    """Restrict this process to the CPUs of `spec` (Linux); returns them, or an empty set for no pinning."""
    cpus = parse_cpus(spec)
    if not cpus:
        return cpus
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU pinning (--cpus) needs Linux")
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise ValueError(f"--cpus {spec!r} names CPUs this process may not use (it may use {sorted(available)})")
    os.sched_setaffinity(0, cpus)
    return cpus
