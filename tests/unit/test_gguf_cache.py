"""A GGUF file is converted once per content, whatever its file times."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specd.engine import checkpoints


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


def test_a_conversion_removes_those_it_supersedes_and_nothing_else(tmp_path, conversions):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    size = gguf.stat().st_size
    digest = checkpoints._content_digest(gguf, size, gguf.stat().st_mtime_ns)
    cache = tmp_path / "cache"
    v = checkpoints.CONVERSION_VERSION
    stale = [f"model-{size}-1700000000-v1", f"model-{size}-1700000500-v{v}", f"model-{digest}-v{v - 1}"]
    kept = [
        f"model-{size + 1}-1700000000-v{v}",  # another file of this name
        f"model-{'0' * 16}-v{v}",  # other content
        f"model-{digest}-v{v + 1}",  # a newer specd's
        f"other-{size}-1700000000-v{v}",  # another name
    ]
    for name in stale + kept:
        (cache / name).mkdir(parents=True)
        (cache / name / "config.json").write_text("{}")
        (cache / f"{name}.lock").write_text("")
    made = checkpoints.materialize(str(gguf))
    left = sorted(p.name for p in cache.iterdir())
    assert left == sorted([made.name, f"{made.name}.lock", *kept, *(f"{n}.lock" for n in kept)])
    # Finding a conversion already made deletes nothing.
    (cache / stale[0]).mkdir()
    assert checkpoints.materialize(str(gguf)) == made
    assert (cache / stale[0]).is_dir()
