"""Bundled benchmark prompts, written originally for this project (not taken from any dataset).

The prompts live in ``data/prompts.jsonl``, one ``{"workload": ..., "prompt": ...}`` object a line.
Each workload stresses speculative decoding differently:

* ``chat``: short everyday questions and instructions, each answerable in a paragraph. Free-form text
  with little overlap with the prompt.
* ``code``: programming requests (Python functions, explaining a snippet, SQL, shell one-liners, regular
  expressions, small algorithms). Outputs are syntax-heavy and fairly predictable.
* ``json``: structured-output requests whose exact expected structure is spelled out in the prompt.
* ``rewrite``: prompts that quote a source text (prose or a code file) and ask for a rewrite, summary,
  tone change or code edit. Outputs copy large spans of the prompt, where prompt lookup shines.

``mixed`` (see :func:`prompts_for`) is every prompt of every workload, in file order.

Three more, in ``data/copy_prompts.jsonl``, are outputs that copy text a drafter has seen: they show
what a suffix drafter gains (``--drafter suffix``), and ``specd distill`` does not train on them
(:func:`workload_names` is the other four):

* ``code-edit``: a Python function and "rename X to Y and return the whole function".
* ``rag-quote``: a passage and a question answered by quoting the passage, several questions a passage.
* ``agent-loop``: requests that each call one tool in the same JSON shape with new arguments, in
  order, so that from the second request on the earlier responses hold the shape.

``longmix`` is the chat prompts with every fourth one replaced by a long prompt (about 1,400
tokens): six consecutive ``rewrite`` prompts, quoted together under one instruction. It measures
head-of-line blocking: how much a long prompt's prefill stalls the streams already running.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


@cache
def _load(name: str = "prompts.jsonl") -> dict[str, tuple[str, ...]]:
    by_workload: dict[str, list[str]] = {}
    text = resources.files("specd.tools").joinpath(f"data/{name}").read_text(encoding="utf-8")
    for line in text.splitlines():
        if line.strip():
            row = json.loads(line)
            by_workload.setdefault(row["workload"], []).append(row["prompt"])
    return {name: tuple(prompts) for name, prompts in by_workload.items()}


def workload_names() -> tuple[str, ...]:
    """The workloads `specd distill` trains on (the copy workloads are held out)."""
    return tuple(_load())


def copy_workload_names() -> tuple[str, ...]:
    """code-edit, rag-quote and agent-loop."""
    return tuple(_load(COPY_FILE))


COPY_FILE = "copy_prompts.jsonl"


LONG_EVERY = 4
LONG_PARTS = 6
LONG_INSTRUCTION = "Below are several requests, each with its text. Say in two sentences what they have in common."


def _long_prompts(rewrite: tuple[str, ...]) -> list[str]:
    joined = [
        "\n\n---\n\n".join(rewrite[(i + j) % len(rewrite)] for j in range(LONG_PARTS)) for i in range(len(rewrite))
    ]
    return [f"{LONG_INSTRUCTION}\n\n{text}" for text in joined]


def prompts_for(workload: str) -> tuple[str, ...]:
    """Return the prompts of ``workload``: a bundled workload's name, ``"mixed"`` (all of them) or ``"longmix"``."""
    workloads = _load()
    if workload == "mixed":
        return tuple(p for prompts in workloads.values() for p in prompts)
    if workload == "longmix":
        long = iter(_long_prompts(workloads["rewrite"]))
        return tuple(next(long) if i % LONG_EVERY == LONG_EVERY - 1 else p for i, p in enumerate(workloads["chat"]))
    copies = _load(COPY_FILE)
    if workload in copies:
        return copies[workload]
    try:
        return workloads[workload]
    except KeyError:
        choices = ", ".join([*workloads, *copies, "mixed", "longmix"])
        raise ValueError(f"unknown workload {workload!r}; choose one of: {choices}") from None
