"""OpenAI tool calling: which calls a request forces, the JSON the output must be, and the calls in it.

The served model's chat template decides whether the model sees the tools (`tools=` is passed
to it, as vLLM does); what specd guarantees is the shape of the output. A call is forced
by grammar, the way vLLM serves `tool_choice` "required" or a named function:

- a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
  function's arguments, a JSON object matching its `parameters`; the reply carries one call;
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`, one item
  per call (one at most with `parallel_tool_calls: false`), each item matching its tool;
- "none": the tools are shown to the template, and the output is text.

- "auto" (OpenAI's default when tools are given): nothing is forced; the model chooses between
  text and calls, written in the syntax it was trained on, which the gateway's
  `--tool-call-parser` reads out of its text (gateway.api.tool_parsers). Without a parser "auto" is
  a 400 that says what to send instead, as vLLM answers it without --tool-call-parser.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.api.json_schemas import has_local_ref, relocated
from gateway.api.validation import InvalidParameter
from specd.engine.grammar import canonical, schema_problem

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
# A function declared without parameters takes an object, as in OpenAI's API.
NO_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]
    # OpenAI's `strict`: a call's arguments always match `parameters`. Forced calls are
    # grammar-constrained whatever it says; under "auto" a strict function's call whose arguments
    # do not match is not returned as a call (see gateway.api.tool_parsers).
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request asks of tools: `mode` "none", "auto", "named" or "required"."""

    mode: str
    tools: tuple[Tool, ...]
    name: str = ""  # the function a named choice forces
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The calls are forced by grammar (a named function, or "required")."""
        return self.mode in ("named", "required")

    @property
    def most_calls(self) -> int | None:
        """The most calls a reply may carry (parallel_tool_calls: false allows one)."""
        return None if self.parallel else 1

    def schema(self) -> dict[str, Any]:
        """The JSON Schema the output must match."""
        if self.mode == "named":
            return dict(next(t.parameters for t in self.tools if t.name == self.name))
        # A tool whose parameters refer to their own parts ($defs, as Pydantic writes an Enum
        # or a nested model) is placed whole under the root's $defs, its refs rewritten there.
        defs = {t.name: relocated(t.parameters, t.name) for t in self.tools if has_local_ref(t.parameters)}
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    "parameters": {"$ref": f"#/$defs/{t.name}"} if t.name in defs else dict(t.parameters),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return array

    def response_format(self) -> dict[str, Any]:
        """The schema as a response_format, the form structured output takes it in."""
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": self.schema(), "strict": True}}

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The reply's tool_calls for an output `text`. A call's arguments are the text the model
        wrote for them, whole or not (cut short by max_tokens, as OpenAI's can be): a named call's
        are the whole text, required calls' the `parameters` of each item begun; None when no
        required call's name was written."""
        if self.mode == "named":
            return [call(self.name, text)]
        stream = CallArrayStream()
        pieces = stream.feed(text)
        calls: list[dict[str, Any]] = []
        for piece in pieces:
            if "id" in piece:
                calls.append({k: v for k, v in piece.items() if k != "index"})
            else:
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
        return calls or None


class CallArrayStream:
    """Reads "required" output as it is generated: `[{"name": "f", "parameters": {...}}, ...]`,
    laid out as the grammar forces it (the schema's key order, ", " and ": " between items and
    keys, no other whitespace; see specd.engine.grammar). `feed` returns the tool_calls delta pieces
    the new text completes, as OpenAI streams them: a call's index, id, type and name once its
    name is whole (arguments ""), then pieces of its arguments, the raw text of its `parameters`.
    Text that breaks the layout ends the reading; what was read stands."""

    HEAD, NAMED = '{"name": "', '", "parameters": '

    def __init__(self) -> None:
        self.text = ""
        self.at = 0  # how far `text` is read
        self.state = "open"  # open, item, name, arguments, after, done, broken
        self.index = -1
        self.depth = 0  # brackets open inside the arguments
        self.in_string = self.escaped = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        out: list[dict[str, Any]] = []
        while self.at < len(self.text) and self.state not in ("done", "broken"):
            if not self._step(out):
                break  # wants more text
        return out

    def _literal(self, *options: str) -> str | None:
        """The option the text continues with here (consumed); None if more text is needed."""
        rest = self.text[self.at :]
        for option in options:
            if rest.startswith(option):
                self.at += len(option)
                return option
        if not any(option.startswith(rest) for option in options):
            self.state = "broken"
        return None

    def _step(self, out: list[dict[str, Any]]) -> bool:
        if self.state == "open":
            if self._literal("[") is None:
                return False
            self.state = "item"
        elif self.state == "item":
            if self._literal(self.HEAD) is None:
                return False
            self.state = "name"
        elif self.state == "name":
            end = self.at
            while end < len(self.text) and (self.text[end].isalnum() or self.text[end] in "_-"):
                end += 1
            rest = self.text[end:]
            if not rest.startswith(self.NAMED):
                if not self.NAMED.startswith(rest):
                    self.state = "broken"
                return False  # the name, or what follows it, goes on
            self.index += 1
            out.append({"index": self.index, **call(self.text[self.at : end], "")})
            self.at = end + len(self.NAMED)
            self.state, self.depth, self.in_string, self.escaped = "arguments", 0, False, False
        elif self.state == "arguments":
            start = self.at
            while self.at < len(self.text):
                c = self.text[self.at]
                if self.in_string:
                    self.in_string = self.escaped or c != '"'
                    self.escaped = not self.escaped and c == "\\"
                elif c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    if self.depth == 0:
                        self.state = "after"  # the item's own closing brace
                        break
                    self.depth -= 1
                self.at += 1
            if self.at > start:
                out.append({"index": self.index, "function": {"arguments": self.text[start : self.at]}})
            return self.state == "after"
        elif self.state == "after":
            separator = self._literal("}, ", "}]")
            if separator is None:
                return False
            self.state = "item" if separator == "}, " else "done"
        return True

    @property
    def whole(self) -> bool:
        return self.state == "done"


def call(name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def tool_choice(tools: Sequence[Any] | None, choice: Any, parallel: bool | None) -> ToolChoice | None:
    """The request's tool choice, checked; None when it has no tools. Raises InvalidParameter."""
    declared = _tools(tools or [])
    if not declared:
        if choice not in (None, "none"):
            raise InvalidParameter("tool_choice", "tool_choice needs tools to choose from")
        if parallel is not None:
            raise InvalidParameter("parallel_tool_calls", "parallel_tool_calls needs tools")
        return None
    allow_many = True if parallel is None else parallel
    if choice is None or choice == "auto":
        return ToolChoice("auto", declared, parallel=allow_many)
    if choice == "none":
        return ToolChoice(choice, declared, parallel=allow_many)
    if choice == "required":
        return _compiles(ToolChoice(choice, declared, parallel=allow_many))
    if (
        isinstance(choice, Mapping)
        and set(choice) == {"type", "function"}
        and choice["type"] == "function"
        and isinstance(choice["function"], Mapping)
        and set(choice["function"]) == {"name"}
    ):
        name = choice["function"]["name"]
        if not isinstance(name, str) or name not in {t.name for t in declared}:
            raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        return _compiles(ToolChoice("named", declared, name, allow_many))
    raise InvalidParameter(
        "tool_choice",
        'tool_choice must be "none", "required", "auto" or {"type": "function", "function": {"name": ...}}',
    )


def _compiles(choice: ToolChoice) -> ToolChoice:
    """The choice, if the grammar engine takes the JSON its calls must be; else a 400 naming tools."""
    if problem := schema_problem(canonical(choice.schema())):
        raise InvalidParameter("tools", f"the tools' parameters are not a JSON Schema the grammar supports: {problem}")
    return choice


def _tools(tools: Sequence[Any]) -> tuple[Tool, ...]:
    if not isinstance(tools, list):
        raise InvalidParameter("tools", "tools must be a list")
    declared: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping) or set(tool) != {"type", "function"} or tool["type"] != "function":
            raise InvalidParameter("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        if not isinstance(function, Mapping) or not set(function) <= FUNCTION_FIELDS:
            raise InvalidParameter("tools", f"{where}.function may hold only {', '.join(sorted(FUNCTION_FIELDS))}")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidParameter("tools", f"{where}.function.name must be 1-64 letters, digits, _ or -")
        if name in {t.name for t in declared}:
            raise InvalidParameter("tools", f"{where}: the function name {name!r} is declared twice")
        if "description" in function and not isinstance(function["description"], str):
            raise InvalidParameter("tools", f"{where}.function.description must be a string")
        if "strict" in function and not isinstance(function["strict"], bool | None):
            raise InvalidParameter("tools", f"{where}.function.strict must be a boolean")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, Mapping):
            raise InvalidParameter("tools", f"{where}.function.parameters must be a JSON Schema object")
        strict = bool(function.get("strict"))
        if strict and (problem := arguments_schema_problem(parameters)):
            raise InvalidParameter("tools", f"{where}.function.parameters is not a JSON Schema: {problem}")
        declared.append(Tool(name, parameters, strict))
    return tuple(declared)


def arguments_schema_problem(schema: Mapping[str, Any]) -> str | None:
    """Why `schema` cannot check a strict function's arguments, or None."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    return None


def arguments_match(schema: Mapping[str, Any], arguments: Any) -> bool:
    """Whether `arguments` (parsed JSON) is an instance of `schema` (its own draft, else 2020-12)."""
    import jsonschema

    return jsonschema.validators.validator_for(schema)(schema).is_valid(arguments)
