"""Render README's (and docs/benchmarks.md's) table of the current sitting from the JSONs docs/bench/sitting.json names.

docs/bench/sitting.json lists the sitting's `specd bench` reports (one row each: a label and a
file) and, where it was measured, the llama.cpp peer's report (scripts/llamacpp_peer.py's runs on
the same GGUF, made in the same sitting). Run `python scripts/render_sitting.py` after a sitting;
`--check` exits non-zero when README's table differs from the rendering
(tests/unit/test_benchmarks_doc.py runs it). Only the part of README.md between the markers is
rendered; the prose around it is written by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "README.md"
# Every document that shows the sitting, and the path from it to docs/bench.
DOCS = {DOC: "docs/bench", ROOT / "docs" / "benchmarks.md": "bench"}
BENCH = ROOT / "docs" / "bench"
SITTING = BENCH / "sitting.json"
BEGIN = "<!-- sitting-table: begin (scripts/render_sitting.py renders it: do not edit by hand) -->"
END = "<!-- sitting-table: end -->"
NONE = "–"
FIXED = "fixed k = 4"
COLUMNS = ("workload", "clients", "target-only tok/s", "auto ({drafter})", FIXED, "acceptance (auto)")


def _mode(report: dict[str, Any], mode: str) -> dict[str, Any] | None:
    return next((r for r in report["results"] if r["mode"] == mode), None)


def _ratio(result: dict[str, Any] | None) -> str:
    if result is None:
        return NONE
    low, high = result.get("speedup_vs_target_min"), result.get("speedup_vs_target_max")
    spread = f" ({low:.2f}–{high:.2f})" if low is not None and high is not None else ""
    return f"{result['speedup_vs_target']:.2f}x{spread}"


def row(label: str, report: dict[str, Any]) -> list[str]:
    target, auto = _mode(report, "target"), _mode(report, "auto")
    acceptance = auto.get("acceptance_rate") if auto else None
    return [
        label,
        str(report["results"][0]["concurrency"]),
        f"{target['output_tokens_per_s']:.1f}" if target else NONE,
        _ratio(auto),
        _ratio(_mode(report, "fixed")),
        f"{acceptance:.2f}" if acceptance is not None else NONE,
    ]


def _mismatches(reports: dict[str, dict[str, Any]]) -> str:
    """How many greedy outputs differed from target-only's, over the sitting (sampled runs differ by design)."""
    greedy = [r for r in reports.values() if not r["args"].get("temperature")]
    differing = sum(n for r in greedy for n in r.get("output_mismatches_vs_target", {}).values())
    outputs = sum(res.get("requests", 0) for r in greedy for res in r["results"] if res["mode"] != "target")
    if differing == 0:
        return f"Every greedy output ({outputs} in all) was identical to target-only's."
    return f"{differing} of {outputs} greedy outputs differed from target-only's."


def _runs_when(peer: dict[str, Any], weights: str) -> str:
    """The tokens/s of the runs on `weights`, grouped by when they ran: "93.4 (before specd's runs),
    79.9 (after specd's runs)"."""
    groups: dict[str, list[float]] = {}
    for r in peer["runs"]:
        if weights in r["weights"]:
            groups.setdefault(r.get("when", "in the sitting"), []).append(r["output_tokens_per_s"])
    return ", ".join(f"{' and '.join(f'{v:.1f}' for v in values)} tok/s ({when})" for when, values in groups.items())


def _peer_line(peer: dict[str, Any], chat: dict[str, Any] | None) -> str:
    """llama.cpp's tokens/s on the sitting's GGUF, and specd's chat at one client against it."""
    q4 = [r["output_tokens_per_s"] for r in peer["runs"] if "Q4_1" in r["weights"]]
    f32 = [r["output_tokens_per_s"] for r in peer["runs"] if "F32" in r["weights"]]
    threads = sorted({r["threads"] for r in peer["runs"]})
    line = (
        f"**llama.cpp** ({peer['engine']}), the same Q4_1 GGUF, {', '.join(map(str, threads))} threads, "
        f"{peer['workload']}: {_runs_when(peer, 'Q4_1')}"
    )
    if peer.get("note"):
        line += f" ({peer['note']})"
    if chat is not None and q4:
        # The median: one run disturbed by the host moves it least.
        base = statistics.median(q4)
        target, auto = _mode(chat, "target"), _mode(chat, "auto")
        parts = [
            f"{name} {r['output_tokens_per_s'] / base:.2f}x"
            for name, r in (("target-only", target), ("auto", auto))
            if r
        ]
        line += f"; specd's chat at 1 client against it: {', '.join(parts)}"
    if f32:
        line += f". Footnote: llama.cpp on an F32 copy of the same weights, {_runs_when(peer, 'F32')}"
    return line + f" ([{SITTING.name}](BENCH/{SITTING.name}), [{peer['file']}](BENCH/{peer['file']}))."


def render_table(bench: Path = BENCH) -> str:
    sitting = json.loads((bench / SITTING.name).read_text())
    reports = {name: json.loads((bench / name).read_text()) for _, name in sitting["rows"]}
    first = next(iter(reports.values()))
    machine, commits = first["machine"], sorted({r.get("commit", NONE) for r in reports.values()})
    # A sitting that ran no fixed mode (2026-11-29 on: one drafting mode per prompt set) has no column.
    fixed = FIXED in COLUMNS and any(_mode(r, "fixed") for r in reports.values())
    keep = [i for i, c in enumerate(COLUMNS) if fixed or c != FIXED]
    columns = [COLUMNS[i].format(drafter=sitting["drafter"]) for i in keep]
    lines = [
        f"Measured {first['date'][:10]} at {', '.join(commits)} on {machine['cpu']}, {machine['cpus']} vCPUs, "
        f"torch {machine.get('torch', NONE)}.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    cells = [row(label, reports[name]) for label, name in sitting["rows"]]
    lines += ["| " + " | ".join(r[i] for i in keep) + " |" for r in cells]
    lines += ["", _mismatches(reports)]
    if sitting.get("peer"):
        peer = {**json.loads((bench / sitting["peer"]).read_text()), "file": sitting["peer"]}
        chat = next((reports[name] for label, name in sitting["rows"] if label == "chat"), None)
        chat = chat if chat is not None and chat["results"][0]["concurrency"] == 1 else None
        lines += ["", _peer_line(peer, chat)]
    else:
        lines += ["", "llama.cpp was not measured in this sitting."]
    return "\n".join(lines)


def render(doc_text: str, bench: Path = BENCH, links: str = "docs/bench") -> str:
    """`doc_text` with the table between the markers; `links`: the path from the document to docs/bench."""
    if BEGIN not in doc_text or END not in doc_text:
        raise SystemExit("a document has no sitting-table markers")
    head, rest = doc_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{render_table(bench).replace('](BENCH/', f']({links}/')}\n\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if README's table is stale")
    args = parser.parse_args(argv)
    stale = 0
    for doc, links in DOCS.items():
        current = doc.read_text()
        text = render(current, links=links)
        if not args.check:
            doc.write_text(text)
            print(f"wrote {doc}")
        elif current != text:
            print(f"{doc.name}'s sitting table is stale; run: python scripts/render_sitting.py", file=sys.stderr)
            stale = 1
    return stale


if __name__ == "__main__":
    raise SystemExit(main())
