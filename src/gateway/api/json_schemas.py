"""Rewrites of client JSON Schemas before the grammar engine compiles them.

- `relocated`: a schema moved under `#/$defs/<name>` of another root keeps its meaning. Every
  local `$ref` ("#", "#/$defs/X", "#/definitions/X", any JSON pointer) is prefixed with the
  new location, so Pydantic's `$defs` (an Enum, a nested model) resolve inside the tool they
  belong to, never against the wrapper around several tools.
- `closed`: an object schema that lists its properties allows no other key unless it says so
  (`additionalProperties` or `unevaluatedProperties` present), as vLLM's default backend
  (xgrammar's strict mode) generates: without it a model may invent keys until max_tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# Keywords whose values are data, not schemas: never rewritten.
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose value is a map of name -> schema.
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Combinators whose members describe one object together: closing a member alone would
# refuse the keys another member declares, so neither they nor their parent are closed.
COMBINED = "allOf"


def has_local_ref(schema: Any) -> bool:
    """Whether the schema refers to a part of itself by a local `$ref`."""
    found = False

    def look(node: dict[str, Any]) -> dict[str, Any]:
        nonlocal found
        found = found or (isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"))
        return node

    _walk(schema, look)
    return found


def relocated(schema: Any, name: str) -> Any:
    """`schema` as it reads placed at `#/$defs/<name>` of another root (name: [A-Za-z0-9_-])."""
    prefix = f"#/$defs/{name}"

    def move(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return {**node, "$ref": prefix + ref[1:]}
        return node

    return _walk(schema, move)


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists its
    properties and says nothing about other keys (outside and inside allOf, see COMBINED)."""

    def close(node: dict[str, Any]) -> dict[str, Any]:
        lists = "properties" in node or "patternProperties" in node
        says = "additionalProperties" in node or "unevaluatedProperties" in node
        if lists and not says and COMBINED not in node:
            return {**node, "additionalProperties": False}
        return node

    return _walk(schema, close, skip=COMBINED)


def _walk(schema: Any, visit: Callable[[dict[str, Any]], dict[str, Any]], skip: str = "") -> Any:
    """A copy of `schema` with `visit` applied to every subschema (children first); the
    members of keyword `skip` are copied unvisited."""
    if isinstance(schema, list):
        return [_walk(s, visit, skip) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS or key == skip:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, Mapping):
            out[key] = {k: _walk(v, visit, skip) for k, v in value.items()}
        else:
            out[key] = _walk(value, visit, skip)
    return visit(out)
