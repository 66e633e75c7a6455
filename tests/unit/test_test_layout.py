"""The test tree itself: pytest imports test modules by basename (no __init__.py), so two modules
with one name in tests/unit and tests/integration break collection of the whole suite, which a
targeted run of either never shows."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
