"""scripts/gpu_check.py's dry run on the CPU, its parts, and scripts/gpu_table.py's tables."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, Path, dict]:
    """One dry run of every section the CPU can run: its bench folder, its --out folder, its report."""
    root = tmp_path_factory.mktemp("dry_run")
    bench, out = root / "bench", root / "out"
    sections = "device,graph_probe,step_ms,verify_ms,synthetic_pair"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--budget-s", "600"]
    cmd += ["--bench-dir", str(bench), "--out", str(out), "--sections", sections]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [path] = bench.glob("gpu-cpu-*.json")
    return path, out, json.loads(path.read_text())


def test_the_dry_run_writes_its_json_after_every_section(dry_run) -> None:
    path, out, report = dry_run
    assert (out / path.name).read_text() == path.read_text()
    assert report["dry_run"] and report["device"]["copy_gbps"] > 0
    tiny = report["step_ms"]["tiny"]
    assert set(tiny["step_ms"]) == {"1", "2"}
    assert all(set(t) == {"eager", "graphed"} for t in tiny["step_ms"].values())
    assert set(tiny["prefill_ms"]) == {"16", "44", "128"} and all(v > 0 for v in tiny["prefill_ms"].values())
    assert set(tiny["prefill_graphed_ms"]) == {"16", "44", "128"} and tiny["prefill_buckets"][0] == 16
    assert set(tiny["prefill_first_ms"]["eager"]) == {"17", "45", "129"}
    assert set(tiny["prefill_first_ms"]["graphed"]) == {"15", "43", "127"}
    assert tiny["floor_ms"] > 0 and tiny["weight_bytes"] > 0
    # The uncaptured static path computes what the eager one does.
    assert tiny["graphed_vs_eager"]["same_argmax"]
    assert report["verify_ms"]["tiny"]["x_step"]["eager"]["1"] == 1.0
    assert set(report["wall_s"]) == {"device", "graph_probe", "step_ms", "verify_ms", "synthetic_pair"}
    # The probe's variants of the static path, uncaptured here, each give the eager logits.
    probe = report["graph_probe"]
    assert set(probe) == set(script("gpu_check").PROBE_VARIANTS)
    assert all(gap < 1e-3 for name, gap in probe.items() if name != "bfloat16"), probe


def test_the_dry_run_benches_a_synthetic_pair_under_the_issues_keys(dry_run) -> None:
    """The synthetic_pair section on a tiny synthetic pair: one stack, one α, one clients level."""
    _, _, report = dry_run
    assert set(report["synthetic_pair"]) == {"0.8"}, report.get("synthetic_pair_runs")
    cells = report["synthetic_pair"]["0.8"]
    assert set(cells) == {f"{mode}@1" for mode in ("target", "sequential", "ahead", "auto")}
    for key, cell in cells.items():
        assert set(cell) == {"x_target", "tok_s", "outside_forwards_ms", "acceptance", "shared_gpu"}, key
        assert cell["tok_s"] > 0 and cell["shared_gpu"] == "off"
    assert cells["target@1"]["x_target"] == 1.0
    assert 0 < cells["sequential@1"]["acceptance"] <= 1 and cells["sequential@1"]["outside_forwards_ms"] > 0
    projection = report["synthetic_pair_projection"]
    # Auto's rounds may all go target-only here (it drafts nothing then): no projection for it.
    assert "not measured" in projection["label"] and {"sequential@1", "ahead@1"} <= set(projection["0.8"])
    assert report["synthetic_pair_runs"]["0.8/no_mps"]["startup_s"] > 0
    assert report["synthetic_pair_skipped"] == []


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path: Path) -> None:
    check = script("gpu_check")
    report = check.Report(tmp_path / "r.json", [tmp_path / "copy"], {})

    def broken(deadline: float) -> None:
        raise RuntimeError("no GPU in this section")

    report.section("first", 1.0, broken)
    assert "RuntimeError: no GPU" in json.loads((tmp_path / "copy" / "r.json").read_text())["first"]["error"]
    # docs/bench gets the report only once the check ends: the tests it runs render that folder.
    assert not (tmp_path / "r.json").exists()
    report.section("second", 1.0, lambda deadline: {"ok": True})
    written = json.loads((tmp_path / "copy" / "r.json").read_text())
    assert written["second"] == {"ok": True} and "error" in written["first"]
    report.write(final=True)
    assert json.loads((tmp_path / "r.json").read_text()) == written


def test_xdist_progress_lines_are_counted() -> None:
    check = script("gpu_check")
    text = "[gw3] [ 12%] PASSED tests/unit/test_a.py::test_one\n[gw0] [100%] FAILED tests/unit/test_b.py::test_two[1]"
    counts = check.parse_pytest(text)
    assert (counts["passed"], counts["failed"]) == (1, 1)
    assert counts["failing"] == ["tests/unit/test_b.py::test_two[1]"]


def test_pytest_outcomes_are_counted_from_a_run_cut_short() -> None:
    check = script("gpu_check")
    text = "\n".join(
        [
            "tests/unit/test_a.py::test_one PASSED                [ 10%]",
            "tests/unit/test_a.py::test_two[0] FAILED             [ 20%]",
            "tests/unit/test_b.py::test_three SKIPPED (needs CUDA) [ 30%]",
            "ERROR collecting tests/unit/test_c.py",
            "tests/unit/test_d.py::test_four ",  # killed while it ran
        ]
    )
    counts = check.parse_pytest(text)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failing"] == ["tests/unit/test_a.py::test_two[0]"]
    assert counts["collection_errors"] == ["tests/unit/test_c.py"]


def test_a_failed_runs_report_keeps_its_tracebacks_not_its_pass_lines() -> None:
    check = script("gpu_check")
    passes = "\n".join(f"tests/unit/test_a.py::test_{n} PASSED [ {n}%]" for n in range(400))
    failures = (
        "=================== FAILURES ===================\n___ test_b ___\n"
        "E   RuntimeError: Expected a 'cuda' device type for generator\n"
    )
    text = f"{passes}\n{failures}=== short test summary info ===\nFAILED tests/unit/test_b.py::test_b\n"
    kept = check.failure_text(text)
    assert kept.startswith("=================== FAILURES") and "Expected a 'cuda' device type" in kept
    assert "PASSED" not in kept
    assert check.failure_text(passes, limit=100) == passes[-100:]  # killed before its summary: the last lines


def test_round_figures_take_the_forwards_out_of_a_round() -> None:
    check = script("gpu_check")
    bench = {
        "results": [
            {
                "mode": "ahead",
                "concurrency": 1,
                "output_tokens_per_s": 40.0,
                "round_round_ms": 42.0,
                "round_draft_ms": 10.0,
                "round_verify_ms": 30.0,
                "round_join_ms": 0.5,
                "round_outside_ms": 1.5,
                # The services' outside time overlaps the exchanges: it is no part of the round's sum.
                "round_overhead_ms": 5.0,
                "round_drafter_forward_ms": 8.0,
                "round_verifier_forward_ms": 20.0,
                "round_outside_forwards_ms": 13.5,
                "speedup_vs_target": 0.6667,
            },
            {"mode": "sequential", "concurrency": 1, "round_draft_ms": 10.0, "round_overhead_ms": 5.0},
        ]
    }
    figures = check.round_figures(bench)["ahead@1"]
    assert figures["round_ms"] == 42.0 and figures["x_target"] == 0.667 and figures["tok_s"] == 40.0
    parts = ("round_draft_ms", "round_verify_ms", "round_join_ms", "round_outside_ms")
    assert sum(figures[k] for k in parts) == figures["round_ms"]
    assert figures["outside_forwards_ms"] == 13.5
    # A report from before the round was timed whole: no round is made up from its parts.
    assert "round_ms" not in check.round_figures(bench)["sequential@1"]
    assert figures["verify_exchange_x_forward"] == 1.5
    services = {"no_mps": {"ahead@1": figures, "sequential@1": {**figures, "outside_forwards_ms": 4.0}}}
    summary = check.service_summary({**services, "mps": {"skipped": "no daemon"}})
    assert summary["round_overhead_ms"] == {"1": 4.0}
    assert summary["shared_gpu"] == {
        "no_mps": {"1": {"verify_exchange_ms": 30.0, "verifier_forward_ms": 20.0, "x_forward": 1.5}}
    }
    assert check.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert check.gpu_slug("NVIDIA H200") == "h200"


def test_the_table_shows_each_shape_beside_its_floor() -> None:
    table = script("gpu_table")
    report = {
        "device": {"name": "NVIDIA H100 80GB HBM3"},
        "step_ms": {
            "llama-3.1-8b": {
                "weight_bytes": 15e9,
                "floor_ms": 5.0,
                "step_ms": {"1": {"eager": 30.0, "graphed": 6.0}},
                "draft_step_ms": {"1": {"eager": 29.0, "graphed": 5.5}},
            },
            "llama-3.2-1b": {"error": "RuntimeError: out of memory"},
        },
        "verify_ms": {"smollm2-135m": {"ms": {"1": {"graphed": 1.5}}, "x_step": {"graphed": {"1": 1.0, "5": 1.2}}}},
        "services": {
            "mps": {
                "ahead@1": {
                    "tok_s": 120.0,
                    "x_target": 0.8,
                    "round_ms": 9.0,
                    "round_verify_ms": 3.0,
                    "round_verifier_forward_ms": 2.5,
                }
            }
        },
        "cuda_tests": {
            "unit_first": {"passed": 40, "failed": 1, "error": 0, "skipped": 2, "timed_out": True},
            "unit_0": {"passed": 10, "failed": 0, "error": 1, "skipped": 0, "timed_out": False},
            "integration_0": {"passed": 7, "failed": 0, "error": 0, "skipped": 0, "timed_out": False},
        },
    }
    report["synthetic_pair"] = {
        "0.8": {
            "auto@1": {
                "x_target": 1.7,
                "tok_s": 210.0,
                "outside_forwards_ms": 0.9,
                "acceptance": 0.8,
                "shared_gpu": "auto",
            }
        }
    }
    report["synthetic_pair_projection"] = {"label": "projection", "0.8": {"auto@1": {"x_target": 2.1}}}
    report["cuda_tests"]["total"] = {"not_run": 3}
    text = table.render([report])
    assert "| NVIDIA H100 80GB HBM3 | 0.8 | auto | 1 | auto | 210.00 | 1.70x | 0.90 | 0.80 | 2.10x |" in text
    assert "| NVIDIA H100 80GB HBM3 | llama-3.1-8b | 15.00 | 1 | 30.00 | 6.00 | 5.50 | 5.00 | 1.20x |" in text
    assert "| llama-3.2-1b | – | – | – | – | – | – | RuntimeError: out of memory |" in text
    assert "| smollm2-135m | graphed | 1.50 | – | – | – | 1.20x | – | – | – | – |" in text
    assert "| mps | ahead | 1 | 120.00 | 0.80x | 9.00 | – | 3.00 | 2.50 | 1.20x |" in text
    assert (
        "unit: 50 passed, 2 failed, 2 skipped, cut short; integration: 7 passed, 0 failed, 0 skipped; 3 selected"
        in text
    )


def test_readme_shows_the_latest_gpu_report_and_benchmarks_every_one_as_rendered() -> None:
    table = script("gpu_table")
    root = Path(__file__).resolve().parents[2]
    reports = [json.loads(p.read_text()) for p in sorted((root / "docs" / "bench").glob("gpu-*.json"))]
    assert len(reports) >= 2, "the GPU reports in docs/bench"
    latest = max(reports, key=lambda r: r["started"])
    begin, end = "<!-- gpu-table: begin -->\n", "<!-- gpu-table: end -->"
    for doc, shown in (("README.md", [latest]), ("docs/benchmarks.md", reports)):
        text = (root / doc).read_text(encoding="utf-8")
        assert text[text.index(begin) + len(begin) : text.index(end)] == table.render(shown), doc


def test_wheels_install_once_and_go_first_on_the_path(tmp_path: Path, monkeypatch) -> None:
    """A pure-Python wheel written here (a GPU host gets scripts/gpu_wheels.sh's)."""
    import zipfile

    check = script("gpu_check")
    root, site = tmp_path / "repo", tmp_path / "site"
    (root / ".whl").mkdir(parents=True)
    wheel = root / ".whl" / "specd_probe-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("specd_probe.py", "ANSWER = 42\n")
        z.writestr("specd_probe-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: specd-probe\nVersion: 1.0\n")
        z.writestr("specd_probe-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("specd_probe-1.0.dist-info/RECORD", "")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    first = check.install_wheels(root, site)
    assert first.startswith("1 wheels in") and (site / "specd_probe.py").is_file()
    assert sys.path[0] == str(site)
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(site), str(check.SRC), "/elsewhere"]
    assert check.install_wheels(root, site).endswith("installed before")


def test_span_summary_reads_a_trace_file_per_service_and_span(tmp_path: Path) -> None:
    check = script("gpu_check")

    def spans(service: str, name: str, lengths_ms: list[float], graphed: list[bool] | None = None) -> str:
        items = [
            {"name": name, "startTimeUnixNano": "1000", "endTimeUnixNano": str(1000 + int(ms * 1e6))}
            for ms in lengths_ms
        ]
        for item, flag in zip(items, graphed or [], strict=False):
            item["attributes"] = [{"key": "specd.prefill_graphed", "value": {"boolValue": flag}}]
        resource = {"attributes": [{"key": "service.name", "value": {"stringValue": service}}]}
        return json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": items}]}]})

    trace = tmp_path / "trace.jsonl"
    lines = [
        spans("specd-drafter", "drafter.prefill", [100.0, 2.0, 3.0], [False, True, True]),
        "not json",
        spans("specd-gateway", "specd.round", [4.0]),
    ]
    trace.write_text("\n".join(lines) + "\n")
    summary = check.span_summary(trace)
    assert summary["specd-drafter drafter.prefill"] == {
        "count": 3,
        "p50": 3.0,
        "p95": 100.0,
        "max": 100.0,
        "total": 105.0,
    }
    # By whether the chunk replayed captured graphs; spans that do not say are in the total alone.
    assert summary["specd-drafter drafter.prefill eager"]["max"] == 100.0
    assert summary["specd-drafter drafter.prefill graphed"]["count"] == 2
    assert summary["specd-gateway specd.round"]["count"] == 1
    assert check.span_summary(tmp_path / "missing.jsonl") == {}


def test_the_compile_section_times_a_compiled_body_beside_the_plain_one(monkeypatch) -> None:
    """Its plumbing on the tiny shape, with torch.compile as the identity (inductor takes minutes
    here; the section has run compiled on this CPU by hand): the same hidden states, both timed."""
    import torch

    check = script("gpu_check")
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    out = check.compile_section("cpu", True, time.monotonic() + 60)
    assert compiled == [{"dynamic": False}]
    assert out["max_abs_hidden_diff"] == 0.0
    assert out["plain_ms"] > 0 and out["compiled_ms"] > 0


def test_the_cuda_suite_total_counts_what_was_selected_and_never_finished() -> None:
    check = script("gpu_check")
    head = "============================= test session starts ==============================\n"
    cut = head + "collected 5 items / 1 deselected\ntests/unit/test_a.py::test_one PASSED [ 25%]\n"
    cut += "tests/unit/test_a.py::test_two ERROR [ 50%]\n"
    xdist = head + "created: 2/2 workers\n2 workers [3 items]\n\n[gw0] [ 33%] FAILED tests/unit/test_b.py::test_b\n"
    runs = {"unit_0": check.parse_pytest(cut), "integration_0": check.parse_pytest(xdist)}
    runs["unit_1"] = check.parse_pytest("killed before pytest said anything\n")
    total = check.with_total(runs)["total"]
    assert (total["passed"], total["failed"], total["error"]) == (1, 1, 1)
    # 4 selected, 2 finished; 3 selected, 1 finished; a run that never reported its selection.
    assert total["not_run"] == 4
    assert total["selection_unknown"] == ["unit_1"]


def _pair_cell(tok_s: float, **extra: float) -> dict[str, float]:
    return {"tok_s": tok_s, "x_target": 1.0, "outside_forwards_ms": 2.0, "acceptance": 0.8, **extra}


def test_the_two_gpu_projection_costs_a_round_from_the_single_model_steps() -> None:
    pair = script("gpu_pair")
    steps = {
        "big": {"step_ms": {"1": {"graphed": 6.0}, "8": {"graphed": 8.0}}},
        "small": {"step_ms": {"1": {"eager": 5.0, "graphed": 1.0}, "8": {"graphed": 2.0}}},
    }
    rounds = {"round_ms": 20.0, "round_join_ms": 0.5, "mean_k": 4.0}
    cells = {
        "target@1": _pair_cell(100.0),
        "sequential@1": _pair_cell(150.0, **rounds),
        "ahead@8": _pair_cell(400.0, **rounds),
        "auto@8": _pair_cell(300.0, **rounds, rounds_ahead=3.0, rounds_sequential=1.0),
        "target@8": _pair_cell(500.0),
        "auto@1": _pair_cell(120.0, round_ms=20.0, mean_k=4.0),  # no outside time measured: no projection
    }
    cells["auto@1"].pop("outside_forwards_ms")
    out = pair.projection({"0.8": cells}, steps, {"target": "big", "drafter": "small"})
    assert "projection" in out["label"] and "not measured" in out["label"]
    # Sequential: 4 drafter steps of 1 ms, then a 6 ms verify, beside 2 ms outside and 0.5 joining.
    assert out["0.8"]["sequential@1"] == {"round_ms": 12.5, "tok_s": 240.0, "x_target": 2.4, "pipeline": "sequential"}
    # Ahead at 8 clients: the larger of 4 x 2 ms drafting and an 8 ms verify.
    assert out["0.8"]["ahead@8"]["round_ms"] == 10.5 and out["0.8"]["ahead@8"]["x_target"] == round(
        400 * 20 / 10.5 / 500, 3
    )
    assert out["0.8"]["auto@8"]["pipeline"] == "ahead"
    assert set(out["0.8"]) == {"sequential@1", "ahead@8", "auto@8"}


def test_the_pair_headline_holds_the_issues_keys_from_the_mps_stack_where_it_ran() -> None:
    pair = script("gpu_pair")
    runs = {
        "shapes": {},
        "0.8/mps": {"shared_gpu": "auto", "auto@1": _pair_cell(3.0, round_ms=9.0), "skipped": []},
        "0.8/no_mps": {"shared_gpu": "off", "auto@1": _pair_cell(2.0)},
        "0.6/mps": {"skipped": "no time left (10 s)"},
        "0.6/no_mps": {"shared_gpu": "off", "target@8": _pair_cell(1.0)},
    }
    out = pair.headline(runs)
    assert set(out) == {"0.8", "0.6"}
    assert out["0.8"] == {"auto@1": {**dict.fromkeys(pair.KEYS), **_pair_cell(3.0), "shared_gpu": "auto"}}
    assert out["0.6"]["target@8"]["shared_gpu"] == "off"


def test_the_pair_gives_its_headline_stack_a_whole_stacks_time_and_records_what_did_not_fit(tmp_path: Path) -> None:
    """The section's time on a fake clock: each stack uses all it is given."""
    pair = script("gpu_pair")
    check = script("gpu_check")
    clock = [1000.0]
    given: list[tuple[str, float]] = []

    def stack(check, device, dry, dirs, which, deadline, logs):
        given.append((f"{which[0]}/{which[1]}", deadline - clock[0]))
        clock[0] = deadline
        return {"shared_gpu": "auto", "auto@1": _pair_cell(1.0), "skipped": ["32 clients: no time left (3 s)"]}

    pair.time = type("Clock", (), {"monotonic": staticmethod(lambda: clock[0])})
    pair.mps_stack = stack
    check.REPORT = check.Report(tmp_path / "r.json", [], {})
    out = pair.section(check, "cuda", False, clock[0] + 205.0, tmp_path)
    # An even share would be 51 s each: too little for a start-up and three levels.
    assert given == [("0.8/mps", pair.STACK_S)]
    assert set(out) == {"0.8"}
    skipped = check.REPORT.data["synthetic_pair_skipped"]
    assert skipped[0] == "0.8/mps: 32 clients: no time left (3 s)"
    assert skipped[1:] == [f"{s}: no time left (55 s)" for s in ("0.8/no_mps", "0.6/mps", "0.95/mps")]
