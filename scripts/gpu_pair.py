"""scripts/gpu_check.py's `synthetic_pair` section: a synthetic Llama-3.1-8B-shaped target and a
Llama-3.2-1B-shaped drafter (`--load-format synthetic`, specd.engine.synthetic) under `specd up` on
one GPU, benched by `specd bench` (chat, 128 tokens) at 1, 8 and 32 clients in the modes target,
sequential, ahead and auto, at the drafter agreements α 0.8, 0.6 and 0.95 (one stack each, as the
agreement is the drafter's flag), with CUDA MPS and, at α 0.8, without (the other αs run without
MPS where no daemon can be had); and a two-GPU projection from the single-model steps step_ms
measured, labelled as one.

Each stack gets its share of the section's time, and each clients level its share of the stack's;
what did not fit is recorded under `synthetic_pair_runs` → `skipped`. The JSON keys the issue fixes
(`synthetic_pair` → "<alpha>" → "<mode>@<clients>" → x_target, tok_s, outside_forwards_ms,
acceptance) hold the MPS stack's figures where it ran, else the stack's without.

In the default ten-minute check (--budget-s 540, beside the CUDA suite) only the headline stack,
α 0.8 with MPS, fits; the whole matrix takes about four stacks' time (STACK_S each):
`--sections device,step_ms,verify_ms,synthetic_pair --budget-s 600` gives it that.

The check's CPU dry run runs the same code on a tiny pair, one α and one clients level.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET, DRAFTER = "llama-3.1-8b", "llama-3.2-1b"
ALPHAS = ("0.8", "0.6", "0.95")  # most valuable first
MODES = ("target", "sequential", "ahead", "auto")
CLIENTS = (1, 8, 32)
MAX_TOKENS = 128
# The stacks in the order they run: the headline α with MPS and without, then the other αs with MPS.
STACKS = [("0.8", "mps"), ("0.8", "no_mps"), ("0.6", "mps"), ("0.95", "mps")]
# A clients level is not started with less time than this left for it (a start-up, likewise).
MIN_LEVEL_S, MIN_STACK_S = 20.0, 60.0
# What a stack of the 8B + 1B pair is given at least (where there is that much left), before an
# even share: a start-up and three levels of four modes. A share of the section's time split four
# ways would leave the headline stack too little to reach its levels.
STACK_S = 150.0
KEYS = ("x_target", "tok_s", "outside_forwards_ms", "acceptance")


def configs(check: ModuleType, dry: bool) -> dict[str, dict[str, Any]]:
    """The pair's config.json files: the published shapes, with the embedded SmolLM2 tokenizer's
    start and end ids (the only tokenizer that travels; synthetic weights keep their successor
    cycle to its ids, so the 128256-row vocabulary is read at full size and never emitted past it)."""
    ids = {k: check.SHAPES["smollm2-135m"][k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if dry:
        # The narrowest the construction holds in against 49152 tokens (at 128 wide, 97% of its probe).
        heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
        tiny = {**check.TINY, **ids, **heads, "hidden_size": 256, "intermediate_size": 512}
        tiny["vocab_size"] = check.SHAPES[TARGET]["vocab_size"]
        return {"target": tiny, "drafter": {**tiny, "num_hidden_layers": 1}}
    return {"target": {**check.SHAPES[TARGET], **ids}, "drafter": {**check.SHAPES[DRAFTER], **ids}}


def write_model(check: ModuleType, directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (check.TOKENIZER / f).is_file():
            shutil.copy(check.TOKENIZER / f, directory / f)
    return directory


def plan(dry: bool) -> list[tuple[str, str]]:
    return [("0.8", "no_mps")] if dry else STACKS


def section(check: ModuleType, device: str, dry: bool, deadline: float, logs: Path) -> dict[str, Any]:
    """The stacks in turn, each in its share of what is left; the headline figures per α."""
    made = configs(check, dry)
    dirs = {role: write_model(check, logs / f"model-pair-{role}", c) for role, c in made.items()}
    runs: dict[str, Any] = {
        "shapes": {"target": "tiny" if dry else TARGET, "drafter": "tiny-1-layer" if dry else DRAFTER}
    }
    stacks = plan(dry)
    for i, (alpha, variant) in enumerate(stacks):
        name = f"{alpha}/{variant}"
        left = deadline - time.monotonic()
        if left < (5.0 if dry else MIN_STACK_S):
            runs[name] = {"skipped": f"no time left ({left:.0f} s)"}
        else:
            share = time.monotonic() + max(left / (len(stacks) - i), min(left, 0.0 if dry else STACK_S))
            # Without a daemon, an α with no stack of its own without MPS runs without it here.
            fallback = (alpha, "no_mps") not in stacks
            where = logs / f"pair-{alpha}-{variant}"
            runs[name] = mps_stack(check, device, dry, dirs, (alpha, variant, fallback), share, where)
        _publish(check, runs)
    return headline(runs)


def mps_stack(
    check: ModuleType,
    device: str,
    dry: bool,
    dirs: dict[str, Path],
    which: tuple[str, str, bool],
    deadline: float,
    logs: Path,
) -> dict[str, Any]:
    """One stack, under an MPS daemon this starts (and stops) for the `mps` variant; `which` is
    (α, variant, whether an `mps` stack runs without MPS where no daemon can be had)."""
    from specd import mps

    alpha, variant, fallback = which
    daemon, why = None, ""
    try:
        if variant == "mps":
            daemon = mps.start_daemon()
            if daemon is None:
                found = shutil.which(mps.CONTROL)
                why = f"{mps.CONTROL} -d did not start a daemon" if found else f"no {mps.CONTROL} on PATH"
                if not fallback:
                    return {"skipped": why}
        elif device != "cpu" and mps.running():
            return {"skipped": "an MPS daemon already runs on this host"}
        out = stack(check, device, dry, dirs, alpha, "auto" if daemon else "off", deadline, logs)
        return {**out, "without_mps_because": why} if why else out
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    finally:
        if daemon is not None:
            mps.stop_daemon(daemon)


def up_command(device: str, dirs: dict[str, Path], alpha: str, shared: str, ports: list[int], logs: Path) -> list[str]:
    http, grpc_port, dport, vport, dm, vm = ports
    # The CPU's bfloat16 is too coarse for the construction at the dry run's tiny width.
    dtype = "float32" if device == "cpu" else "bfloat16"
    return [
        sys.executable, "-m", "specd.cli", "up",
        "--target-model", str(dirs["target"]), "--drafter", "model", "--draft-model", str(dirs["drafter"]),
        "--drafter-device", device, "--verifier-device", device,
        "--verifier-dtype", dtype, "--drafter-dtype", dtype, "--quantize", "none",
        "--load-format", "synthetic", "--synthetic-agreement", alpha, "--synthetic-seed", "0",
        "--pipeline", "auto", "--shared-gpu", shared,
        "--http-port", str(http), "--grpc-port", str(grpc_port),
        "--drafter-port", str(dport), "--verifier-port", str(vport),
        "--drafter-metrics-port", str(dm), "--verifier-metrics-port", str(vm),
        "--max-context", "1024", "--trace-file", str(logs / "trace.jsonl"),
    ]  # fmt: skip


def stack(
    check: ModuleType,
    device: str,
    dry: bool,
    dirs: dict[str, Path],
    alpha: str,
    shared: str,
    deadline: float,
    logs: Path,
) -> dict[str, Any]:
    """`specd up` on the pair, then one `specd bench` per clients level while time allows."""
    logs.mkdir(parents=True, exist_ok=True)
    ports = [check.free_port() for _ in range(6)]
    up = up_command(device, dirs, alpha, shared, ports, logs)
    up += ["--startup-timeout", str(max(60, int(deadline - time.monotonic())))]
    start = time.monotonic()
    with (logs / "up.log").open("w") as f:
        proc = subprocess.Popen(up, cwd=check.ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict[str, Any] = {"shared_gpu": shared, "skipped": []}
    try:
        base = f"http://127.0.0.1:{ports[0]}"
        check.wait_healthy(base, proc, deadline, logs / "up.log")
        out["startup_s"] = round(time.monotonic() - start, 1)
        metrics = f"drafter=http://127.0.0.1:{ports[4]}/metrics,verifier=http://127.0.0.1:{ports[5]}/metrics"
        levels = (1,) if dry else CLIENTS
        for i, clients in enumerate(levels):
            left = deadline - time.monotonic()
            if left < (5.0 if dry else MIN_LEVEL_S):
                out["skipped"].append(f"{clients} clients: no time left ({left:.0f} s)")
                continue
            figures = level(check, dry, base, metrics, clients, left / (len(levels) - i), logs)
            if "error" in figures:
                out["skipped"].append(f"{clients} clients: {figures['error']}")
            else:
                out.update(figures)
        out["service_log"] = check.notable_lines((logs / "up.log").read_text(errors="replace"))
    finally:
        check.stop_group(proc)
    out["spans_ms"] = check.span_summary(logs / "trace.jsonl")
    return out


def level(
    check: ModuleType, dry: bool, base: str, metrics: str, clients: int, budget_s: float, logs: Path
) -> dict[str, Any]:
    """One `specd bench` at `clients`: the round figures and acceptance per mode@clients."""
    name = f"c{clients}"
    bench = [
        sys.executable, "-m", "specd.cli", "bench", "--base-url", base, "-k", "4",
        "--max-tokens", str(8 if dry else MAX_TOKENS), "--ignore-eos",
        "--num-prompts", str(2 if dry else max(2 * clients, 4)), "--blocks", "2",
        "--concurrency", str(clients), "--modes", ",".join(MODES), "--workload", "chat",
        "--output-dir", str(logs), "--name", name, "--service-metrics", metrics,
    ]  # fmt: skip
    try:
        done = subprocess.run(bench, cwd=check.ROOT, capture_output=True, text=True, timeout=budget_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"specd bench cut short at its {budget_s:.0f} s"}
    (logs / f"bench-{name}.log").write_text(done.stdout + done.stderr)
    written = logs / f"bench-{name}.json"
    if not written.is_file():
        return {
            "error": f"specd bench exited {done.returncode} without its JSON: {(done.stdout + done.stderr)[-1500:]}"
        }
    report = json.loads(written.read_text())
    figures = check.round_figures(report)
    for r in report.get("results", []):
        entry = figures.get(f"{r.get('mode')}@{r.get('concurrency')}")
        if entry is not None:
            entry["acceptance"] = r.get("acceptance_rate")
            entry.update({k: v for k, v in r.items() if k in ("mean_k", "mean_batch") or k.startswith("rounds_")})
    return figures


def headline(runs: dict[str, Any]) -> dict[str, Any]:
    """Per α and mode@clients the issue's four figures, from the MPS stack where it ran."""
    out: dict[str, Any] = {}
    for alpha in ALPHAS:
        chosen = chosen_run(runs, alpha)
        if chosen is None:
            continue
        out[alpha] = {
            key: {**{k: _rounded(cell.get(k)) for k in KEYS}, "shared_gpu": chosen["shared_gpu"]}
            for key, cell in chosen.items()
            if "@" in key and isinstance(cell, dict)
        }
    return out


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def chosen_run(runs: dict[str, Any], alpha: str) -> dict[str, Any] | None:
    """The stack whose figures stand for `alpha`: the MPS one where it ran, else the one without."""
    return next((runs[f"{alpha}/{v}"] for v in ("mps", "no_mps") if _has_cells(runs.get(f"{alpha}/{v}"))), None)


def _has_cells(run: Any) -> bool:
    return isinstance(run, dict) and any("@" in k for k in run)


def step_of(steps: dict[str, Any], shape: str, clients: int) -> float | None:
    """step_ms's one-token step of `shape` at the batch nearest `clients` (graphed, else eager)."""
    measured = (steps.get(shape) or {}).get("step_ms") or {}
    if not measured:
        return None
    batch = min(measured, key=lambda b: abs(int(b) - clients))
    return measured[batch].get("graphed") or measured[batch].get("eager")


def projection(pair: dict[str, Any], steps: dict[str, Any], shapes: dict[str, str]) -> dict[str, Any]:
    """A PROJECTION, not a measurement: each mode on two GPUs, the drafter on its own. A round keeps
    its measured tokens and its time outside the forwards; its forwards become the single-model
    steps step_ms measured (the drafter's mean_k steps, and a verify costed as one target step):
    drafts then verify for sequential, the larger of the two for ahead (and for auto where most of
    its rounds ran ahead). Target-only runs on one GPU either way."""
    out: dict[str, Any] = {
        "label": "projection: two GPUs, from one-GPU rounds and step_ms's single-model steps; not measured",
        "shapes": shapes,
    }
    for alpha, cells in pair.items():
        for key, cell in cells.items():
            mode, clients = key.split("@")
            target = cells.get(f"target@{clients}", {}).get("tok_s")
            draft, verify = (
                step_of(steps, shapes["drafter"], int(clients)),
                step_of(steps, shapes["target"], int(clients)),
            )
            needed = [cell.get(k) for k in ("tok_s", "round_ms", "outside_forwards_ms", "mean_k")]
            if mode == "target" or not all(check_number(v) for v in [*needed, target, draft, verify]):
                continue
            tok_s, round_ms, outside, mean_k = needed
            ahead = mode == "ahead" or (
                mode == "auto" and cell.get("rounds_ahead", 0) > cell.get("rounds_sequential", 0)
            )
            drafts = mean_k * draft
            forwards = max(drafts, verify) if ahead else drafts + verify
            rounded = forwards + outside + (cell.get("round_join_ms") or 0.0)
            projected = tok_s * round_ms / rounded
            out.setdefault(alpha, {})[key] = {
                "round_ms": round(rounded, 3),
                "tok_s": round(projected, 1),
                "x_target": round(projected / target, 3),
                "pipeline": "ahead" if ahead else "sequential",
            }
    return out


def check_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value > 0


def _publish(check: ModuleType, runs: dict[str, Any]) -> None:
    """Into the check's report after every stack, so a check cut short keeps what ran."""
    report = check.REPORT
    if report is None:
        return
    report.data["synthetic_pair"] = pair = headline(runs)
    report.data["synthetic_pair_runs"] = runs
    steps = report.data.get("step_ms") or {}
    dry = runs["shapes"]["target"] == "tiny"
    # The dry run's step_ms has the tiny target's shape alone: it stands for both.
    shapes = {"target": "tiny", "drafter": "tiny"} if dry else {"target": TARGET, "drafter": DRAFTER}
    report.data["synthetic_pair_projection"] = projection(_full(runs, pair), steps, shapes)
    report.data["synthetic_pair_skipped"] = [
        f"{name}: {why}"
        for name, run in runs.items()
        if isinstance(run, dict) and name != "shapes"
        for why in ([run["skipped"]] if isinstance(run.get("skipped"), str) else run.get("skipped", []))
    ]
    report.write()


def _full(runs: dict[str, Any], pair: dict[str, Any]) -> dict[str, Any]:
    """The headline stacks' whole cells (the projection needs their rounds and mean k)."""
    out: dict[str, Any] = {}
    for alpha, cells in pair.items():
        run = chosen_run(runs, alpha) or {}
        out[alpha] = {k: run[k] for k in cells}
    return out
