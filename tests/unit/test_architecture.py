"""The package layout keeps its promises: engine code never imports grpc or the services above it,
and no two modules import each other, directly or round a longer loop (type-only imports count:
they are the same coupling)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
GENERATED = SRC / "specd" / "proto"


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        if GENERATED in path.parents:
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `path` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: {m for m in _imports(path, known) if m in known and m != name} for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_loop():
    # Without this, a finder that never reports anything would pass the test above.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_engines_never_import_grpc_or_the_layers_above():
    graph = _graph()
    engine = [m for m in graph if m.startswith("specd.engine") or m.endswith("_service.engine")]
    assert engine
    for name in engine:
        imported = _imports(_modules()[name], _modules())
        assert not any(m == "grpc" or m.startswith("grpc.") for m in imported), name
        above = [
            m
            for m in graph[name]
            if m.startswith(
                ("specd.rpc", "gateway", "specd.cli", "specd.tools", "specd.configuration", "specd.placement")
            )
        ]
        assert above == [], (name, above)


MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600


def _too_long(source: str, name: str) -> list[str]:
    """`name`'s functions (methods and nested ones too) over MAX_FUNCTION_LINES, decorators aside,
    and the module itself when over MAX_MODULE_LINES."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_long_functions_or_modules():
    # A function a reader cannot see whole, or a module past a few screens, hides its seams:
    # split it where one step ends and the next begins.
    too_long = [hit for name, path in _modules().items() for hit in _too_long(path.read_text(encoding="utf-8"), name)]
    assert too_long == []


def test_the_length_check_finds_a_long_function_and_a_long_module():
    # Without this, a check that never reports anything would pass the test above.
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    method = "class C:\n    async def m(self):\n" + body.replace("    ", "        ") + "        return 0\n"
    assert _too_long(f"def f():\n{body}", "m") == []
    assert _too_long(f"def f():\n{body}    return 0\n", "m") == ["m:1 f: 81 lines"]
    assert _too_long(method, "m") == ["m:2 m: 81 lines"]
    assert _too_long("x = 1\n" * MAX_MODULE_LINES, "m") == []
    assert _too_long("x = 1\n" * (MAX_MODULE_LINES + 1), "m") == ["m: 601 lines"]
