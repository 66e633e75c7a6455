"""`specd up --drafter`: which drafter service command each choice starts."""

from __future__ import annotations

import pytest

from specd.drafter_choice import resolve_drafter


@pytest.mark.parametrize(
    ("choice", "draft_model", "target", "expected"),
    [
        ("auto", None, "embedded", ("suffix", "embedded", "auto")),
        ("auto", "embedded", "embedded", ("suffix", "embedded", "auto")),
        ("auto", "/d", "/t", ("model", "/d", "auto")),
        ("auto", "embedded-drafter", "embedded", ("distilled", "embedded-drafter", "none")),
        ("distilled", None, "embedded", ("distilled", "embedded-drafter", "none")),
        ("distilled", "/d", "/t", ("distilled", "/d", "none")),
        ("int8", None, "embedded", ("int8", "embedded", "int8")),
        ("int8", None, "/t", ("int8", "/t", "int8")),
        ("int4", None, "embedded", ("int4", "embedded", "int4")),
        ("model", "/d", "/t", ("model", "/d", "auto")),
        ("ngram", None, "embedded", ("ngram", "embedded", "auto")),
        ("suffix", None, "embedded", ("suffix", "embedded", "auto")),
    ],
)
def test_resolve_drafter(choice, draft_model, target, expected):
    assert resolve_drafter(choice, draft_model, target, "auto") == expected


def test_distilled_needs_a_drafter_for_other_targets():
    with pytest.raises(SystemExit):
        resolve_drafter("distilled", None, "/t", "auto")


def test_auto_drafts_with_the_target_copy_off_the_cpu():
    assert resolve_drafter("auto", None, "embedded", "auto", "cuda:0") == ("model", "embedded", "auto")
    assert resolve_drafter("auto", None, "embedded", "auto", "cpu")[0] == "suffix"
