#!/usr/bin/env python3
"""README's GPU tables from scripts/gpu_check.py's JSON files (markdown on stdout).

python3 scripts/gpu_table.py docs/bench/gpu-*.json
python3 scripts/gpu_table.py --readme FILE docs/bench/gpu-*.json   # rewrites FILE's GPU tables (README: the latest run)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _ms(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "–"


def _ratio(a: Any, b: Any) -> str:
    ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
    return f"{a / b:.2f}x" if ok else "–"


def step_rows(report: dict[str, Any]) -> list[str]:
    gpu = report.get("device", {}).get("name", "?")
    rows = []
    for name, shape in report.get("step_ms", {}).items():
        if not isinstance(shape, dict) or "step_ms" not in shape:
            why = shape.get("error") or shape.get("skipped") if isinstance(shape, dict) else None
            rows.append(f"| {gpu} | {name} | – | – | – | – | – | – | {why or 'not measured'} |")
            continue
        floor = shape.get("floor_ms")
        gb = shape["weight_bytes"] / 1e9
        drafts = shape.get("draft_step_ms", {})
        for batch, t in shape["step_ms"].items():
            eager, graphed = t.get("eager"), t.get("graphed")
            draft = drafts.get(batch, {}).get("graphed")
            rows.append(
                f"| {gpu} | {name} | {gb:.2f} | {batch} | {_ms(eager)} | {_ms(graphed)} | {_ms(draft)} | {_ms(floor)} "
                f"| {_ratio(graphed, floor)} |"
            )
    return rows


def verify_rows(report: dict[str, Any]) -> list[str]:
    gpu = report.get("device", {}).get("name", "?")
    rows = []
    for name, entry in report.get("verify_ms", {}).items():
        if not isinstance(entry, dict) or "x_step" not in entry:
            continue
        for label, per in entry["x_step"].items():
            one = entry["ms"].get("1", {}).get(label)
            cells = " | ".join(f"{per[n]:.2f}x" if n in per else "–" for n in map(str, range(2, 10)))
            rows.append(f"| {gpu} | {name} | {label} | {_ms(one)} | {cells} |")
    return rows


def service_rows(report: dict[str, Any]) -> list[str]:
    gpu = report.get("device", {}).get("name", "?")
    rows = []
    for variant, runs in report.get("services", {}).items():
        if not isinstance(runs, dict):
            continue
        for key, r in runs.items():
            if not isinstance(r, dict) or "@" not in key:
                continue
            mode, clients = key.split("@")
            exchange, forward = r.get("round_verify_ms"), r.get("round_verifier_forward_ms")
            speed = r.get("x_target")
            rows.append(
                f"| {gpu} | {variant.replace('_', ' ')} | {mode} | {clients} "
                f"| {_ms(r.get('tok_s'))} | {f'{speed:.2f}x' if isinstance(speed, (int, float)) else '–'} "
                f"| {_ms(r.get('round_ms'))} "
                f"| {_ms(r.get('outside_forwards_ms'))} | {_ms(r.get('round_verify_ms'))} "
                f"| {_ms(r.get('round_verifier_forward_ms'))} | {_ratio(exchange, forward)} |"
            )
    return rows


def pair_rows(report: dict[str, Any]) -> list[str]:
    """The synthetic 8B + 1B pair per α, mode and clients, beside its two-GPU projection."""
    gpu = report.get("device", {}).get("name", "?")
    projected = report.get("synthetic_pair_projection", {})
    rows = []
    for alpha, cells in report.get("synthetic_pair", {}).items():
        if not isinstance(cells, dict):
            continue
        for key, c in cells.items():
            mode, clients = key.split("@")
            two = projected.get(alpha, {}).get(key, {}).get("x_target")
            rows.append(
                f"| {gpu} | {alpha} | {mode} | {clients} | {c.get('shared_gpu', '?')} | {_ms(c.get('tok_s'))} "
                f"| {_x(c.get('x_target'))} | {_ms(c.get('outside_forwards_ms'))} | {_ms(c.get('acceptance'))} "
                f"| {_x(two)} |"
            )
    return rows


def _x(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else "–"


def tests_line(report: dict[str, Any]) -> str:
    """The CUDA tests' counts, the parallel groups of one kind (unit_0, unit_1, ...) added up."""
    kinds: dict[str, dict[str, Any]] = {}
    for part, r in report.get("cuda_tests", {}).items():
        if isinstance(r, dict) and "passed" in r and part != "total":
            kind = kinds.setdefault(part.split("_")[0], {"passed": 0, "failed": 0, "skipped": 0, "cut": False})
            kind["passed"] += r["passed"]
            kind["failed"] += r["failed"] + r.get("error", 0)
            kind["skipped"] += r["skipped"]
            kind["cut"] = kind["cut"] or bool(r.get("timed_out"))
    line = "; ".join(
        f"{kind}: {k['passed']} passed, {k['failed']} failed, {k['skipped']} skipped{', cut short' if k['cut'] else ''}"
        for kind, k in kinds.items()
    )
    not_run = report.get("cuda_tests", {}).get("total", {}).get("not_run")
    return f"{line}; {not_run} selected and not run" if line and isinstance(not_run, int) else line


def render(reports: list[dict[str, Any]]) -> str:
    """The tables of `reports`, oldest run first (by each report's `started`)."""
    reports = sorted(reports, key=lambda r: str(r.get("started", "")))
    out = [
        "| GPU | shape | weights GB | batch | step eager ms | step graphed ms | draft step graphed ms "
        "| bandwidth floor ms | graphed / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        out += step_rows(r)
    out += [
        "",
        "| GPU | shape | forward | 1-token step ms | " + " | ".join(f"{n} pos." for n in range(2, 10)) + " |",
        "|---|---|---|---|" + "---|" * 8,
    ]
    for r in reports:
        out += verify_rows(r)
    services = [row for r in reports for row in service_rows(r)]
    if services:
        out += [
            "",
            "| GPU | shared GPU | pipeline | clients | tok/s | vs target-only | round ms | outside the forwards ms "
            "| verify exchange ms | verifier forward ms | exchange / forward |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *services,
        ]
    pair = [row for r in reports for row in pair_rows(r)]
    if pair:
        out += [
            "",
            "| GPU | α | mode | clients | shared GPU | tok/s | vs target-only | outside the forwards ms | acceptance "
            "| two GPUs vs target-only (projected) |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *pair,
        ]
    for r in reports:
        line = tests_line(r)
        if line:
            how = " How they ran: the JSON's `notes`." if r.get("notes") else ""
            out += ["", f"Tests on {r.get('device', {}).get('name', '?')}: {line}.{how}"]
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- gpu-table: begin -->\n", "<!-- gpu-table: end -->"


def into_readme(readme: Path, table: str) -> None:
    """Replace what stands between README's gpu-table markers with `table`."""
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + BEGIN + table + END + rest.split(END, 1)[1], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    paths = list(argv if argv is not None else sys.argv[1:])
    readme = None
    if paths[:1] == ["--readme"] and len(paths) > 1:
        readme, paths = Path(paths[1]), paths[2:]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    table = render([json.loads(Path(p).read_text()) for p in sorted(paths)])
    if readme is not None:
        into_readme(readme, table)
    else:
        print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
