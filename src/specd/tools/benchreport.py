"""`specd bench`'s report on the terminal: the results table and the machine it ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

from specd.engine.cpus import cpu_model

COLUMNS = [
    ("conc", "concurrency", "{:d}"),
    ("mode", "mode", "{}"),
    ("tok/s", "output_tokens_per_s", "{:.1f}"),
    ("tok/s/user", "output_tokens_per_s_per_user", "{:.1f}"),
    ("vs target", "speedup_vs_target", "{:.2f}x"),
    ("blocks", "speedup_vs_target_range", "{}"),
    ("vs HF", "speedup_vs_hf", "{:.2f}x"),
    ("vs base", "vs_base", "{:.2f}x"),
    ("base blocks", "vs_base_range", "{}"),
    ("TTFT p50", "ttft_ms_p50", "{:.0f}"),
    ("TTFT p95", "ttft_ms_p95", "{:.0f}"),
    ("TPOT p50", "tpot_ms_p50", "{:.1f}"),
    ("ITL p50", "itl_ms_p50", "{:.1f}"),
    ("ITL p95", "itl_ms_p95", "{:.1f}"),
    ("ITL p99", "itl_ms_p99", "{:.1f}"),
    ("E2E p50", "e2e_ms_p50", "{:.0f}"),
    ("accept", "acceptance_rate", "{:.3f}"),
    ("MAL", "mean_acceptance_length", "{:.2f}"),
    ("mean k", "mean_k", "{:.2f}"),
    ("bound", "bound_bound", "{:.2f}x"),
    ("eff", "efficiency_vs_bound", "{:.2f}"),
    ("outside", "round_outside_models", "{:.0%}"),
]


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and value != value):
            return "-"
        return fmt.format(value)

    table = [[c[0] for c in COLUMNS]] + [[cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths, strict=True)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + (
        "\n(latencies in ms; MAL = mean acceptance length; eff = speedup / bound;"
        " outside = share of round time outside the models' forward passes;"
        " blocks = range of the ratio to target-only over the interleaved blocks;"
        " vs base = MODE@SERVER against MODE on --base-url)"
    )


def machine() -> dict[str, Any]:
    cpu = cpu_model(platform.processor())
    info: dict[str, Any] = {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def print_summary(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"machine: {m['cpu']}, {m['cpus']} CPUs" + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else ""))
    print(format_table(rows))
    if report.get("services"):
        for service, stats in report["services"].items():
            parts = [f"peak RSS {stats['peak_rss_mib']:.0f} MiB"] if "peak_rss_mib" in stats else []
            if "kv_bytes_per_token" in stats:
                parts.append(f"KV cache {stats['kv_bytes_per_token'] / 1024:.1f} KiB/token")
            print(f"{service}: {', '.join(parts)}")
    if report.get("output_mismatches_vs_target"):
        print("requests whose text differs from target-only:", report["output_mismatches_vs_target"])
