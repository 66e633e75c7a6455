"""Whether a JSON Schema admits any finite value at all (no torch, no llguidance here).

A schema whose required properties lead back to the object that holds them (a node that must
have a child node) compiles, and its first token is allowed, yet no output can ever close it:
generation runs until the grammar engine gives up mid-round. This finds it at admission.

It is the textbook "productive symbols" fixed point of a context-free grammar, over the
schema's `$ref`s: a reference is productive once its target can be satisfied by a finite
value given the references already known to be. Only what certainly needs an infinite value
is reported; keywords it does not model (`not`, `if`, a schema without `type`) count as
satisfiable, so a schema is never refused on a guess.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gateway.api.json_schemas import DATA_KEYWORDS


def never_finite(schema: Any) -> str | None:
    """Why no finite value satisfies `schema` (naming the references that recurse without end), or None."""
    refs = sorted(_refs(schema))
    targets = {ref: _resolve(schema, ref) for ref in refs}
    users: dict[str, set[str]] = defaultdict(set)  # ref -> the refs whose targets mention it
    for ref, target in targets.items():
        for used in _refs(target):
            users[used].add(ref)
    known: set[str] = set()  # productive refs
    work = list(refs)
    while work:
        ref = work.pop()
        if ref not in known and _productive(targets[ref], known):
            known.add(ref)
            work.extend(users[ref] - known)
    if _productive(schema, known):
        return None
    endless = [ref for ref in refs if ref not in known]
    if not endless:
        return "a required property's schema can never be satisfied"
    return f"every value must nest without end: a required property leads back through {', '.join(endless[:5])}"


def _refs(schema: Any) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                found.add(ref)
            stack.extend(v for k, v in node.items() if k not in DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local JSON pointer names; True (anything) where it names nothing."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _productive(schema: Any, known: set[str]) -> bool:
    """Whether some finite value satisfies `schema`, given the refs known to be satisfiable."""
    if not isinstance(schema, dict):
        return schema is not False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in known:
        return False
    if not all(_productive(s, known) for s in _list(schema, "allOf")):
        return False
    for keyword in ("anyOf", "oneOf"):
        options = _list(schema, keyword)
        if options and not any(_productive(s, known) for s in options):
            return False
    types = schema.get("type")
    if types is None:
        return True  # a value of another type than object or array is one
    kinds = types if isinstance(types, list) else [types]
    return any(_kind_productive(schema, kind, known) for kind in kinds)


def _kind_productive(schema: dict[str, Any], kind: Any, known: set[str]) -> bool:
    if kind == "object":
        properties = schema.get("properties")
        if not isinstance(properties, dict):
            return True
        required = [p for p in schema.get("required") or [] if isinstance(p, str) and p in properties]
        return all(_productive(properties[p], known) for p in required)
    if kind == "array":
        needed = schema.get("minItems") or 0
        prefix = _list(schema, "prefixItems")
        if not isinstance(needed, int) or needed <= 0:
            return True
        if not all(_productive(s, known) for s in prefix[:needed]):
            return False
        return needed <= len(prefix) or _productive(schema.get("items", True), known)
    return True


def _list(schema: dict[str, Any], keyword: str) -> list[Any]:
    value = schema.get(keyword)
    return value if isinstance(value, list) else []
