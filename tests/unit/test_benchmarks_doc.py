"""docs/benchmarks.md's tables are what scripts/render_benchmarks.py renders from docs/bench."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from specd.tools.provenance import measured_at, source_commit

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    """scripts/NAME.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render() -> ModuleType:
    return _script("render_benchmarks")


def _result(mode: str, tps: float, ratio: float, blocks: list[float]) -> dict[str, object]:
    return {
        "mode": mode,
        "concurrency": 1,
        "output_tokens_per_s": tps,
        "speedup_vs_target": ratio,
        "speedup_vs_target_blocks": blocks,
        "speedup_vs_target_min": min(blocks),
        "speedup_vs_target_max": max(blocks),
    }


def _sections(tables: str) -> dict[str, str]:
    parts = tables.split("### ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def test_committed_tables_are_the_rendering(render: ModuleType) -> None:
    committed = (ROOT / "docs" / "benchmarks.md").read_text()
    assert committed == render.render(committed), "docs/benchmarks.md is stale: run python scripts/render_benchmarks.py"


def test_every_json_has_a_row(render: ModuleType) -> None:
    tables = render.render_tables()
    for path in (ROOT / "docs" / "bench").glob("bench-*.json"):
        assert f"[{path.name}](bench/{path.name})" in tables


def test_a_row_names_machine_date_commit_modes_and_ratios(render: ModuleType, tmp_path: Path) -> None:
    report = {
        "machine": {"cpu": "Test CPU (avx512f)", "cpus": 2, "torch": "2.13.0+cpu"},
        "date": "2026-11-27T10:00:00+00:00",
        "commit": "abc1234",
        "args": {"workload": "chat", "temperature": 0.0, "k": 4, "max_tokens": 64},
        "results": [_result("target", 16.84, 1.0, [1.0, 1.0]), _result("auto", 40.0, 2.434, [2.32, 2.62])],
        "output_mismatches_vs_target": {"target@1": 0, "auto@1": 2},
    }
    (tmp_path / "bench-x.json").write_text(json.dumps(report))
    tables = render.render_tables(tmp_path)
    assert "### Test CPU (avx512f)" in tables
    report["machine"] = {"cpu": "Test CPU (avx512f)", "cpus": 16, "gpus": ["Test GPU"]}
    (tmp_path / "bench-gpu.json").write_text(json.dumps(report))
    sections = _sections(render.render_tables(tmp_path))
    assert "[bench-gpu.json]" in sections["Test CPU (avx512f) with Test GPU"]
    assert "[bench-gpu.json]" not in sections["Test CPU (avx512f)"]
    tables = sections["Test CPU (avx512f)"]
    row = next(line for line in tables.splitlines() if line.startswith("| [bench-x.json]"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1:] == [
        "2026-11-27",
        "`abc1234`",
        "2 CPUs, torch 2.13.0+cpu",
        "chat, greedy, k=4, 64 tokens",
        "1",
        "16.8",
        "auto 2.43x (2.32–2.62); outputs differing from target-only: auto 2",
    ]


def test_missing_fields_show_a_dash_and_provenance_fills_in(render: ModuleType, tmp_path: Path) -> None:
    report = {"machine": {}, "args": {}, "results": [{"mode": "auto", "concurrency": 8, "output_tokens_per_s": 5.0}]}
    (tmp_path / "bench-y.json").write_text(json.dumps(report))
    row = render.render_tables(tmp_path).splitlines()[-1]
    assert row.split(" | ")[1:4] == ["–", "–", "–"]
    assert "auto 5.0 tok/s" in row
    (tmp_path / "provenance.json").write_text(json.dumps({"bench-y.json": {"date": "2026-11-01", "commit": "def5678"}}))
    row = render.render_tables(tmp_path).splitlines()[-1]
    assert row.split(" | ")[1:3] == ["2026-11-01", "`def5678`"]


def test_check_fails_on_stale_tables_and_text_outside_markers_stays(render: ModuleType, tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# prose kept\n\n{render.BEGIN}\nold table\n{render.END}\n\nmore prose\n")
    original = render.DOC
    render.DOC = doc
    try:
        assert render.main(["--check"]) == 1
        assert render.main([]) == 0
        assert render.main(["--check"]) == 0
    finally:
        render.DOC = original
    text = doc.read_text()
    assert text.startswith("# prose kept\n") and text.endswith("more prose\n") and "old table" not in text


def test_bench_records_when_and_from_which_code(tmp_path: Path) -> None:
    assert source_commit(tmp_path) is None  # not a source checkout: no commit rather than a wrong one
    assert measured_at()[:2] == "20" and measured_at().endswith("+00:00")
    commit = source_commit(ROOT)
    assert commit is None or commit.split("-")[0].isalnum()


def test_a_row_of_another_server_gives_its_ratio_to_the_same_mode_on_the_base(
    render: ModuleType, tmp_path: Path
) -> None:
    other = {**_result("auto@before", 38.0, 2.26, [2.2, 2.3]), "vs_base": 0.95, "vs_base_min": 0.93}
    other["vs_base_max"] = 0.97
    report = {
        "machine": {"cpu": "Test CPU", "cpus": 2},
        "results": [_result("target", 16.84, 1.0, [1.0, 1.0]), _result("auto", 40.0, 2.434, [2.32, 2.62]), other],
        "output_mismatches_vs_target": {"target@1": 0, "auto@1": 0, "auto@before@1": 1},
    }
    (tmp_path / "bench-ab.json").write_text(json.dumps(report))
    row = next(line for line in render.render_tables(tmp_path).splitlines() if line.startswith("| [bench-ab.json]"))
    assert "auto@before 2.26x (2.20–2.30) = 0.95x auto (0.93–0.97)" in row
    assert row.rstrip(" |").endswith("outputs differing from target-only: auto@before 1")


def test_every_json_the_documents_cite_exists() -> None:
    """README and docs/ quote figures from docs/bench: a cited file that is gone leaves a claim without its data."""
    import re

    cited = {}
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for name in re.findall(r"bench/([\w.+-]+\.json)", doc.read_text()):
            cited.setdefault(name, doc.name)
    missing = {name: doc for name, doc in cited.items() if not (ROOT / "docs" / "bench" / name).exists()}
    assert cited and missing == {}


@pytest.fixture(scope="module")
def sitting() -> ModuleType:
    return _script("render_sitting")


def test_readme_sitting_table_is_the_rendering(sitting: ModuleType) -> None:
    committed = (ROOT / "README.md").read_text()
    assert committed == sitting.render(committed), (
        "README's sitting table is stale: run python scripts/render_sitting.py"
    )


def test_the_sitting_table_sets_specd_against_llama_cpp_on_the_same_gguf(sitting: ModuleType, tmp_path: Path) -> None:
    report = {
        "machine": {"cpu": "Test CPU", "cpus": 2, "torch": "2.13.0+cpu"},
        "date": "2026-11-28T10:00:00+00:00",
        "commit": "abc1234",
        "args": {"temperature": 0.0},
        "results": [
            {**_result("target", 80.0, 1.0, [1.0, 1.0]), "requests": 8},
            {**_result("auto", 96.0, 1.2, [1.1, 1.3]), "requests": 8, "acceptance_rate": 0.5},
        ],
        "output_mismatches_vs_target": {"target@1": 0, "auto@1": 1},
    }
    (tmp_path / "bench-chat.json").write_text(json.dumps(report))
    runs = [{"weights": "m.Q4_1.gguf", "threads": 2, "output_tokens_per_s": v} for v in (60.0, 100.0)]
    runs.append({"weights": "m.F32.gguf", "threads": 2, "output_tokens_per_s": 40.0})
    peer = {"engine": "llama.cpp X", "workload": "chat", "runs": runs}
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    spec = {"drafter": "suffix drafter", "rows": [["chat", "bench-chat.json"]], "peer": "peer.json"}
    (tmp_path / "sitting.json").write_text(json.dumps(spec))
    table = sitting.render_table(tmp_path)
    assert "| chat | 1 | 80.0 | 1.20x (1.10–1.30) | 0.50 |" in table  # no fixed mode ran: no column
    assert "at abc1234 on Test CPU" in table and "1 of 8 greedy outputs differed" in table
    assert "60.0 and 100.0 tok/s" in table and "target-only 1.00x, auto 1.20x" in table  # against their median, 80
    report["results"].append({**_result("fixed", 88.0, 1.1, [1.1, 1.1]), "requests": 8})
    (tmp_path / "bench-chat.json").write_text(json.dumps(report))
    assert "| chat | 1 | 80.0 | 1.20x (1.10–1.30) | 1.10x (1.10–1.10) | 0.50 |" in sitting.render_table(tmp_path)
    assert "F32 copy of the same weights, 40.0 tok/s" in table
