"""Constraints that can never match (issue 39, item 7): each must be a 400 naming its parameter at the
door, in-process (tests/unit/test_grammar_check.py) and through a running gateway
(tests/integration/test_bad_input.py)."""

from __future__ import annotations

from typing import Any

NODE = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}, "required": ["child"]}
ENDLESS = {"$defs": {"node": NODE}, "$ref": "#/$defs/node"}

NEVER: list[tuple[dict[str, Any], str]] = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}},
        "response_format",
    ),
    ({"guided_regex": "[^\\x00-\\x{10FFFF}]"}, "guided_regex"),
    ({"guided_regex": "[a&&b]"}, "guided_regex"),
    ({"guided_choice": [f"c{i}" for i in range(30_000)]}, "guided_choice"),
    # A node that must hold a node: it compiles and its first token is allowed, yet never closes.
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": ENDLESS}}},
        "response_format",
    ),
    # What the red-team's 100,000-entry guided_choice once answered with a native backtrace.
    ({"guided_choice": ["c"] * 100_000}, "guided_choice"),
]
