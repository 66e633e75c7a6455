"""What the served chat template does with tools, found once at start-up by rendering it.

tool_choice "auto" leaves the call to the model, which can only make one if the prompt shows it
the tools (and, later in a conversation, the calls it made). A template that drops them (the
embedded SmolLM2's renders neither `tools` nor an assistant's `tool_calls`) makes "auto" silently
never call, so the gateway refuses "auto" there with a 400 naming the template; "required" and
named calls, which the grammar forces, still work. `--chat-template` (as vLLM's) serves a
template file instead of the tokenizer's, for a model whose own template lacks tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROBE = "specd_template_probe"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE,
        "description": "A function the gateway renders once to see whether the template shows tools.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}
QUESTION = {"role": "user", "content": "Hello"}
CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "call_probe", "type": "function", "function": {"name": PROBE, "arguments": {"x": 1}}}],
}


class ChatTemplateError(Exception):
    """A --chat-template file that cannot be read."""


def load(tokenizer: Any, path: str) -> None:
    """Serve the Jinja template in `path` instead of the tokenizer's own."""
    try:
        tokenizer.chat_template = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"--chat-template {path}: {exc}") from None


def _render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    return str(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))


def tools_problem(tokenizer: Any) -> str:
    """Why the template cannot show a model its tools and its calls ("" when it can): rendered
    with and without them, the prompt must differ and name the function."""
    try:
        plain = _render(tokenizer, [QUESTION], None)
        with_tools = _render(tokenizer, [QUESTION], [PROBE_TOOL])
        answered = [QUESTION, CALL, {"role": "tool", "tool_call_id": "call_probe", "content": "2"}]
        with_call = _render(tokenizer, answered, None)
    except Exception as exc:  # a template may refuse tools or tool messages outright
        return f"it fails to render tools or tool calls ({exc})"
    if with_tools == plain or PROBE not in with_tools:
        return "it does not render `tools`"
    if PROBE not in with_call:
        return "it does not render an assistant's `tool_calls`"
    return ""
