"""Which JSON Schemas no finite value satisfies: found at admission, never guessed."""

from __future__ import annotations

import pytest

from gateway.api.finite_schema import never_finite


def node(types, required=("child",), child=None):
    child = child or {"$ref": "#/$defs/node"}
    return {"$defs": {"node": {"type": types, "properties": {"child": child}, "required": list(required)}},
            "$ref": "#/$defs/node"}  # fmt: skip


ENDLESS = [
    node("object"),
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    # Two definitions that need each other: an object that needs a non-empty array of itself.
    {
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1},
        },
        "$ref": "#/$defs/a",
    },
    node("object", child={"allOf": [{"$ref": "#/$defs/node"}, {"description": "x"}]}),
    node("object", child={"anyOf": [{"$ref": "#/$defs/node"}, {"$ref": "#/$defs/node"}]}),
    {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1},
]

FINITE = [
    node("object", required=()),  # the child may be left out
    node(["object", "null"]),  # the child may be null
    node("object", child={"anyOf": [{"type": "string"}, {"$ref": "#/$defs/node"}]}),
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["other"]},  # not its own child
    {"properties": {"self": {"$ref": "#"}}, "required": ["self"]},  # no type: a string satisfies it
    {"$ref": "#/$defs/missing"},  # what it cannot resolve, the engine judges
    {"type": "string"},
    True,
]


@pytest.mark.parametrize("schema", ENDLESS)
def test_a_schema_only_endless_values_satisfy_is_found(schema):
    assert never_finite(schema)


@pytest.mark.parametrize("schema", FINITE)
def test_a_schema_some_finite_value_satisfies_passes(schema):
    assert never_finite(schema) is None


def test_the_message_names_the_references_and_a_long_chain_is_linear():
    assert "#/$defs/node" in never_finite(node("object"))
    chain = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
             for i in range(3000)}  # fmt: skip
    chain["d3000"] = {"type": "string"}
    assert never_finite({"$defs": chain, "$ref": "#/$defs/d0"}) is None
    chain["d3000"] = {"$ref": "#/$defs/d0"}
    assert never_finite({"$defs": chain, "$ref": "#/$defs/d0"})
