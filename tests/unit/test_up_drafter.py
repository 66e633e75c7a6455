"""`specd up --drafter`: which drafter service command each choice starts."""

from __future__ import annotations

import pytest

from specd.cli import resolve_drafter


@pytest.mark.parametrize(
    ("choice", "draft_model", "target", "expected"),
    [
        ("auto", None, "embedded", ("model", "embedded", "auto")),
        ("distilled", None, "embedded", ("distilled", "embedded-drafter", "none")),
        ("distilled", "/d", "/t", ("distilled", "/d", "none")),
        ("int8", None, "embedded", ("int8", "embedded", "int8")),
        ("int8", None, "/t", ("int8", "/t", "int8")),
        ("int4", None, "embedded", ("int4", "embedded", "int4")),
        ("model", "/d", "/t", ("model", "/d", "auto")),
        ("ngram", None, "embedded", ("ngram", "embedded", "auto")),
    ],
)
def test_resolve_drafter(choice, draft_model, target, expected):
    assert resolve_drafter(choice, draft_model, target, "auto") == expected


def test_distilled_needs_a_drafter_for_other_targets():
    with pytest.raises(SystemExit):
        resolve_drafter("distilled", None, "/t", "auto")
