"""PNG plots of a `specd bench` run: throughput, latency percentiles, acceptance by position."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: benchmarks run on headless machines
    import matplotlib.pyplot as plt

    return plt


def _by_mode(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    modes: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        modes.setdefault(row["mode"], []).append(row)
    for series in modes.values():
        series.sort(key=lambda r: r["concurrency"])
    return modes


def plot_all(rows: Sequence[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    modes = _by_mode(rows)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, series in modes.items():
        ax.plot([r["concurrency"] for r in series], [r["output_tokens_per_s"] for r in series], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("output tokens/s (all clients)")
    ax.set_title(f"Throughput — {title}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir / "throughput.png"))

    levels = sorted({r["concurrency"] for r in rows})
    metrics = [("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "end-to-end")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4.5))
    width = 0.8 / max(1, len(modes))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for i, (mode, series) in enumerate(modes.items()):
            by_level = {r["concurrency"]: r for r in series}
            xs = [j + i * width for j, level in enumerate(levels) if level in by_level]
            p50 = [by_level[level][f"{key}_p50"] for level in levels if level in by_level]
            p95 = [by_level[level][f"{key}_p95"] for level in levels if level in by_level]
            ax.bar(xs, p95, width, alpha=0.35, color=f"C{i}")
            ax.bar(xs, p50, width, color=f"C{i}", label=mode)
        ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(levels))], [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_ylabel("ms (solid p50, light p95)")
        ax.set_yscale("log")
        ax.set_title(label)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"Latency percentiles — {title}")
    paths.append(_save(fig, out_dir / "latency.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for row in rows:
        per_pos = row.get("per_position_acceptance")
        if per_pos:
            ax.plot(
                range(1, len(per_pos) + 1), per_pos, marker="o", label=f"{row['mode']} @ {row['concurrency']} clients"
            )
            plotted = True
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(draft at this position accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Acceptance by position — {title}")
    ax.grid(True, alpha=0.3)
    if plotted:
        ax.legend(fontsize="small")
    paths.append(_save(fig, out_dir / "acceptance.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
