"""A GGUF file is converted once per content, whatever its file times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specd import checkpoints


@pytest.fixture
def conversions(tmp_path, monkeypatch) -> list[Path]:
    """Every conversion made, into a cache under tmp_path (the real one loads weights: not needed here)."""
    made: list[Path] = []

    def convert(gguf: Path, dest: Path) -> None:
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        made.append(dest)

    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoints, "_convert_gguf", convert)
    return made


def test_the_same_content_rewritten_later_is_not_converted_again(tmp_path, conversions):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    first = checkpoints.materialize(str(gguf))
    # A reinstall writes the same bytes with new file times.
    gguf.write_bytes(gguf.read_bytes())
    os.utime(gguf, ns=(gguf.stat().st_atime_ns + 10**9, gguf.stat().st_mtime_ns + 10**9))
    assert checkpoints.materialize(str(gguf)) == first
    assert conversions == [first]


def test_other_content_of_the_same_size_and_name_gets_its_own_conversion(tmp_path, conversions):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    first = checkpoints.materialize(str(gguf))
    gguf.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    second = checkpoints.materialize(str(gguf))
    assert second != first
    assert conversions == [first, second]
