"""`specd bench` end to end against a running stack: interleaved blocks, exact output, one JSON report."""

from __future__ import annotations

import json

from stack import base_url

from specd.tools.bench import main as bench

# Enough rounds for the drafter to finish its chunked prefill of a prompt (a budget of what fits
# behind a verify, which a loaded machine shrinks) and then draft: with 6, fixed mode at times drafted nothing.
TOKENS = 16


def test_bench_interleaves_modes_in_blocks_and_reports_their_range(gateway_for, tmp_path, capsys):
    gateway = gateway_for(4)
    bench(
        [
            "--base-url", base_url(gateway),
            "--modes", "target,fixed,auto,fixed@again",
            "--server", f"again={base_url(gateway)}",
            "--concurrency", "1,2",
            "--num-prompts", "4",
            "--max-tokens", str(TOKENS),
            "--ignore-eos",
            "--blocks", "2",
            "--output-dir", str(tmp_path),
            "--name", "tiny",
        ]
    )  # fmt: skip
    report = json.loads((tmp_path / "bench-tiny.json").read_text())
    rows = {(r["mode"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(m, c) for m in ("target", "fixed", "auto", "fixed@again") for c in (1, 2)}
    for row in rows.values():
        # Every mode ran every block of the same prompts, and each block's tokens add up to the row's.
        assert len(row["blocks"]) == 2
        assert row["requests"] == 4
        assert sum(b["output_tokens"] for b in row["blocks"]) == row["output_tokens"] == 4 * TOKENS
        assert row["wall_s"] > 0
        assert row["speedup_vs_target_min"] <= row["speedup_vs_target"] <= row["speedup_vs_target_max"] + 1e-9
    # The fixed-k gateway drafted in fixed mode; target-only did not.
    assert rows[("fixed", 1)]["drafts"] > 0 and "drafts" not in rows[("target", 1)]
    # A second named server (here the same gateway again) runs in the same blocks, against its base mode.
    assert rows[("fixed@again", 1)]["drafts"] > 0
    assert rows[("fixed@again", 2)]["vs_base_min"] <= rows[("fixed@again", 2)]["vs_base"]
    assert set(report["output_mismatches_vs_target"].values()) == {0}
    assert report["machine"]["cpu"]
    out = capsys.readouterr().out
    assert "blocks" in out and "-" in rows[("fixed", 1)]["speedup_vs_target_range"]
