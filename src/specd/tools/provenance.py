"""When and from which code a measurement was made, for the JSON `specd bench` writes."""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[3]


def measured_at() -> str:
    """UTC time, to the second, ISO 8601."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def source_commit(root: Path = SOURCE) -> str | None:
    """The commit specd runs from (`-dirty` with uncommitted changes), or None when it is not run from a
    source checkout (an installed wheel's directory may sit inside some other repository)."""
    if not (root / "src" / "specd").is_dir():
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None
