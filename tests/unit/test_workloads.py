"""The bundled benchmark workloads, longmix's composition in particular."""

from __future__ import annotations

import json
import re

import pytest

from specd.tools.workloads import LONG_EVERY, LONG_PARTS, copy_workload_names, prompts_for, workload_names


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


def test_code_edit_prompts_quote_a_function_and_name_the_rename() -> None:
    prompts = prompts_for("code-edit")
    assert len(prompts) >= 8
    for prompt in prompts:
        old, new = re.search(r"Rename `(\w+)` to `(\w+)`", prompt).groups()  # type: ignore[union-attr]
        code = prompt.split("```python\n")[1].split("```")[0]
        assert code.startswith("def ") and re.search(rf"\b{old}\b", code) and not re.search(rf"\b{new}\b", code)
        assert "return the whole function" in prompt


def test_rag_quote_prompts_ask_several_questions_of_each_passage() -> None:
    prompts = prompts_for("rag-quote")
    passages = [p.split('"""')[1] for p in prompts]
    assert len(set(passages)) >= 4 and len(prompts) >= 2 * len(set(passages))
    assert all("quoting the passage" in p and "Question:" in p for p in prompts)


def test_agent_loop_repeats_one_tool_shape_with_new_arguments_in_order() -> None:
    prompts = prompts_for("agent-loop")
    shapes = {p.split("Request: ")[0] for p in prompts}
    requests = [p.split("Request: ")[1] for p in prompts]
    assert len(shapes) == 1 and len(set(requests)) == len(prompts) >= 8
    shape = json.loads(next(iter(shapes)).split("\n")[-3].replace("<number>", "1"))
    assert shape["tool"] == "book_flight" and set(shape["arguments"]) == {"from", "to", "date", "passengers", "class"}


def test_the_copy_workloads_are_bench_workloads_but_not_distillation_data() -> None:
    names = copy_workload_names()
    assert set(names) == {"code-edit", "rag-quote", "agent-loop"}
    assert not set(names) & set(workload_names())
    assert not set(prompts_for("code-edit")) & set(prompts_for("mixed"))
    with pytest.raises(ValueError, match="agent-loop"):
        prompts_for("nope")
