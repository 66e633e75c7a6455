"""The bundled benchmark workloads, longmix's composition in particular."""

from __future__ import annotations

import pytest

from specd.tools.workloads import LONG_EVERY, LONG_PARTS, prompts_for, workload_names


def test_longmix_replaces_every_fourth_chat_prompt_with_six_quoted_rewrites() -> None:
    chat, rewrite, longmix = prompts_for("chat"), prompts_for("rewrite"), prompts_for("longmix")
    assert len(longmix) == len(chat)
    for i, prompt in enumerate(longmix):
        if i % LONG_EVERY == LONG_EVERY - 1:
            assert sum(part in prompt for part in rewrite) == LONG_PARTS
            assert len(prompt) > 5 * max(len(p) for p in chat)
        else:
            assert prompt == chat[i]
    longs = [p for i, p in enumerate(longmix) if i % LONG_EVERY == LONG_EVERY - 1]
    assert len(set(longs)) == len(longs)


def test_longmix_is_not_a_bundled_workload_so_distill_does_not_train_on_it() -> None:
    assert "longmix" not in workload_names() and "mixed" not in workload_names()


def test_unknown_workload_names_the_choices() -> None:
    with pytest.raises(ValueError, match="longmix"):
        prompts_for("nope")
