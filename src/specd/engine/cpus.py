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


def cpu_model(default: str = "unknown", cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else `default`.

    A virtual machine may show only a family name ("AMD EPYC") for CPUs whose speeds differ
    several-fold, so the family, model and stepping numbers and the widest vector extension
    are added: a figure is only comparable with one measured on the same CPU.
    """
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8") as info:
            for line in info:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return default
    name = fields.get("model name")
    if not name:
        return default
    ids = [f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model", "stepping") if fields.get(key)]
    flags = set(fields.get("flags", "").split())
    vector = next((v for v in ("amx_tile", "avx512f", "avx2", "avx") if v in flags), "")
    details = ", ".join(([" ".join(ids)] if ids else []) + ([vector.replace("_tile", "")] if vector else []))
    return f"{name} ({details})" if details else name
