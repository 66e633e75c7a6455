"""`specd bench`: what speculation buys, measured in one run on one machine.

Drives a running specd gateway (or any OpenAI-compatible server) with a workload
at a sweep of concurrencies, in several modes per level so every ratio comes
from the same run:

- target: target-only through the same stack (`num_speculative_tokens: 0`);
- fixed: k drafts every round (`num_speculative_tokens: k`);
- auto: adaptive speculation (`num_speculative_tokens: "auto"`);
- sequential, cohort, ahead: fixed k with that drafting pipeline (`pipeline: ...`);
- tree: fixed k, sequential, with `--siblings` siblings beside each block's chain (a token tree);
- fanout: fixed k, ahead, with `--branches` branches beside each draft-ahead block (fan-out
  draft-ahead: blocks drafted after other likely verdicts on the block being verified);
- auto-pipeline: adaptive k and pipeline, chosen per round (`pipeline: auto`); the
  rounds each pipeline ran are reported (`rounds_<pipeline>`);
- server: no specd extension field, whatever the server does (other servers);
- hf / hf-target: the in-process peer, Hugging Face `generate` with an assistant
  model (or prompt lookup) / alone, with the same models, k and prompts, one
  request at a time (assisted generation supports batch size 1 only).

Other servers join the same run with `--server NAME=URL`: a mode written
`MODE@NAME` runs against that server (its ratio to target-only against
`target@NAME` where the run has it), and each such row also gets its ratio to the
same mode on `--base-url` (`vs_base`, per block too): an A/B of two builds or two
configurations of the gateway, interleaved like the modes.

Modes are interleaved: each level's prompts are split into blocks, and every
mode runs every block, in order on even blocks and reversed on odd ones, so a
machine whose speed drifts during the run (a shared or throttled host can move
several percent in minutes) shifts no mode's ratio to target-only; the range of
the per-block ratios shows how much the drift moved it.

Reports output tokens/s (aggregate and per user), TTFT, TPOT, inter-token latency
and end-to-end percentiles, and from the gateway's /metrics the acceptance rate,
mean acceptance length, per-position acceptance, round costs, the Leviathan et
al. bound on speedup and the stack's efficiency against it. Writes a JSON file
with every figure and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specd.tools.benchreport import machine, print_summary
from specd.tools.benchstats import (
    RequestResult,
    acceptance,
    drafted_again,
    round_costs,
    serial_schedule,
    serial_wall_s,
    speedup_bound,
    summarize,
)
from specd.tools.provenance import measured_at, source_commit
from specd.tools.workloads import copy_workload_names, prompts_for, workload_names

HTTP_MODES = ("target", "fixed", "auto", "sequential", "cohort", "ahead", "tree", "fanout", "auto-pipeline", "server")
HF_MODES = ("hf", "hf-target")


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace, extra: dict[str, Any]
) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = prompt_tokens = 0
    text: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
                prompt_tokens = payload["usage"].get("prompt_tokens", 0)
            choices = payload.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if content:
                text.append(content)
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)  # type: ignore[operator]
                last = now
    end = time.perf_counter()
    return RequestResult((first or end) - start, end - start, tokens, gaps, "".join(text), prompt_tokens)


async def scrape(client: httpx.AsyncClient, url: str = "/metrics") -> dict[str, float]:
    try:
        r = await client.get(url)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))
            values[key] = sample.value
    return values


def mode_extra(mode: str, k: int, siblings: int = 2, branches: int = 2) -> dict[str, Any]:
    """The specd request extension that selects a mode; `server` sends none.

    `fixed` leaves the pipeline to the gateway; `sequential`, `cohort` and `ahead`
    are fixed k with that pipeline, so the three compare scheduling alone; `tree` is
    sequential with `siblings` beside each chain, so it compares with sequential; `fanout`
    is ahead with `branches` beside each draft-ahead block, so it compares with ahead.
    """
    if mode == "tree":
        return {"num_speculative_tokens": k, "pipeline": "sequential", "speculative_siblings": siblings}
    if mode == "fanout":
        return {"num_speculative_tokens": k, "pipeline": "ahead", "speculative_branches": branches}
    if mode in ("sequential", "cohort", "ahead"):
        return {"num_speculative_tokens": k, "pipeline": mode}
    if mode == "auto-pipeline":
        return {"num_speculative_tokens": "auto", "pipeline": "auto"}
    speculation = {"target": 0, "fixed": k, "auto": "auto"}
    return {"num_speculative_tokens": speculation[mode]} if mode in speculation else {}


def split_blocks(n: int, concurrency: int, blocks: int) -> list[range]:
    """The level's n prompts as contiguous blocks, each at least one wave of `concurrency`.

    Every mode runs every block, so a block's ratio compares the modes on the same
    prompts minutes apart at most; fewer, longer blocks where the prompts are few.
    """
    count = max(1, min(blocks, n // max(concurrency, 1)))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(count)]


def block_order(modes: Sequence[str], block: int) -> list[str]:
    """Modes in order on even blocks and reversed on odd ones.

    A machine whose speed drifts steadily then favours no mode: over each pair of
    blocks every mode's mean position in time is the same, so a linear drift
    cancels from every ratio.
    """
    return list(modes) if block % 2 == 0 else list(reversed(modes))


def add_deltas(total: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    """Accumulate one block's metric deltas, so a mode's blocks read as one scrape pair ({}, total)."""
    for key, value in after.items():
        total[key] = total.get(key, 0.0) + value - before.get(key, 0.0)


async def run_block(
    client: httpx.AsyncClient,
    model: str,
    prompts: list[str],
    block: range,
    concurrency: int,
    args: argparse.Namespace,
    extra: dict[str, Any],
    desc: str,
) -> list[tuple[int, RequestResult]]:
    """A block's prompts through `concurrency` closed-loop clients."""
    from tqdm import tqdm

    next_index = iter(block)
    done: list[tuple[int, RequestResult]] = []
    bar = tqdm(total=len(block), desc=desc, unit="req", file=sys.stderr, leave=False)

    async def worker() -> None:
        for i in next_index:
            done.append((i, await one_request(client, model, prompts[i], args, extra)))
            bar.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(block)))))
    finally:
        bar.close()
    return done


def split_mode(mode: str) -> tuple[str, str]:
    """`MODE@NAME` -> (MODE, NAME); a mode without a server runs against --base-url ("")."""
    name, _, server = mode.partition("@")
    return name, server


async def run_level(
    args: argparse.Namespace, models: dict[str, str], modes: Sequence[str], prompts: list[str], concurrency: int
) -> tuple[list[dict[str, Any]], dict[str, list[RequestResult]]]:
    """Every HTTP mode at one concurrency, interleaved block by block (see `split_blocks`)."""
    blocks = split_blocks(len(prompts), concurrency, args.blocks)
    results: dict[str, list[RequestResult | None]] = {m: [None] * len(prompts) for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[int]] = {m: [] for m in modes}
    deltas: dict[str, dict[str, float]] = {m: {} for m in modes}
    limits = httpx.Limits(max_connections=concurrency + 4)
    clients = {
        server: httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits)
        for server, url in args.servers.items()
    }
    try:
        for b, block in enumerate(blocks):
            for mode in block_order(modes, b):
                name, server = split_mode(mode)
                client, model, extra = (
                    clients[server],
                    models[server],
                    mode_extra(name, args.k, args.siblings, args.branches),
                )
                if b == 0:
                    # Untimed requests so first-call costs (and, for auto, the cost model's start) stay out.
                    warm = prompts[: min(2, len(prompts))]
                    await asyncio.gather(*(one_request(client, model, p, args, extra) for p in warm))
                before = await scrape(client)
                desc = f"{mode:>9} @ {concurrency:>3} [{b + 1}/{len(blocks)}]"
                start = time.perf_counter()
                for i, result in await run_block(client, model, prompts, block, concurrency, args, extra, desc):
                    results[mode][i] = result
                walls[mode].append(time.perf_counter() - start)
                tokens[mode].append(sum(r.completion_tokens for i in block if (r := results[mode][i]) is not None))
                add_deltas(deltas[mode], before, await scrape(client))
    finally:
        for client in clients.values():
            await client.aclose()
    rows = [level_row(mode, concurrency, results[mode], walls[mode], tokens[mode], deltas[mode]) for mode in modes]
    return rows, {mode: [r for r in results[mode] if r is not None] for mode in modes}


def level_row(
    mode: str,
    concurrency: int,
    results: list[RequestResult | None],
    walls: list[float],
    tokens: list[int],
    deltas: dict[str, float],
) -> dict[str, Any]:
    finished = [r for r in results if r is not None]
    row = {"mode": mode, "concurrency": concurrency, **summarize(finished, sum(walls))}
    row["blocks"] = [{"output_tokens": t, "wall_s": w} for t, w in zip(tokens, walls, strict=True)]
    row.update(acceptance({}, deltas))
    if deltas:
        row.update(round_costs({}, deltas))
    return row


def block_speedups(row: dict[str, Any], base: dict[str, Any], key: str = "speedup_vs_target") -> dict[str, Any]:
    """The ratio to `base` (target-only) within each block, and their range: how far drift moved it."""
    pairs = list(zip(row.get("blocks", []), base.get("blocks", []), strict=False))
    if len(pairs) < 2 or len(row["blocks"]) != len(base["blocks"]):
        return {}
    if any(not (b["output_tokens"] > 0 and b["wall_s"] > 0) for pair in pairs for b in pair):
        return {}
    ratios = [
        (mine["output_tokens"] / mine["wall_s"]) / (theirs["output_tokens"] / theirs["wall_s"])
        for mine, theirs in pairs
    ]
    return {
        f"{key}_blocks": ratios,
        f"{key}_min": min(ratios),
        f"{key}_max": max(ratios),
        f"{key}_range": f"{min(ratios):.2f}-{max(ratios):.2f}x",
    }


def add_bounds(rows: list[dict[str, Any]], k: int) -> None:
    """Speedup over target-only, and the Leviathan bound from single-stream model costs."""
    by_mode = {(r["mode"], r["concurrency"]): r for r in rows}
    hf = {r["concurrency"]: r for r in rows if r["mode"] == "hf"}
    for row in rows:
        name, server = split_mode(row["mode"])
        conc = row["concurrency"]
        base = by_mode.get((f"target@{server}", conc)) if server else None
        base = base or by_mode.get(("target", conc))
        same = by_mode.get((name, conc)) if server else None
        if same is not None:
            row["vs_base"] = row["output_tokens_per_s"] / same["output_tokens_per_s"]
            row.update(block_speedups(row, same, "vs_base"))
        if base is not None:
            row["speedup_vs_target"] = row["output_tokens_per_s"] / base["output_tokens_per_s"]
            row.update(block_speedups(row, base))
        peer = hf.get(row["concurrency"])
        if peer is not None:
            row["speedup_vs_hf"] = row["output_tokens_per_s"] / peer["output_tokens_per_s"]
        # The bound prices drafting and verifying one after the other, as the sequential
        # pipeline runs them; fixed k runs the gateway's pipeline, which may overlap them, so
        # its efficiency can pass 1. Draft-ahead and cohort rounds always overlap: no bound.
        if (
            name not in ("fixed", "sequential")
            or row["concurrency"] != 1
            or base is None
            or "acceptance_rate" not in row
        ):
            continue
        # At one client each round has one sequence, so per-round means are that
        # sequence's costs: a target step is a target-only round's forward; the
        # speculative run's rounds without a draft (each request's first) are
        # target steps too and come out of its verify time.
        target_step = base.get("round_verifier_forward_ms", float("nan"))
        drafts, rounds = row["drafts"], row.get("rounds", 0)
        if not drafts or not rounds:
            continue
        verify_total = row["round_verifier_forward_ms"] * rounds - (rounds - drafts) * target_step
        draft_total = row["round_drafter_forward_ms"] * rounds
        bound = speedup_bound(
            row["acceptance_rate"], k, draft_total / row["draft_tokens"], verify_total / drafts, target_step
        )
        if bound:
            row.update({f"bound_{key}": value for key, value in bound.items()})
            row["efficiency_vs_bound"] = row["speedup_vs_target"] / bound["bound"]


def compare_outputs(outputs: dict[tuple[str, int], list[RequestResult]]) -> dict[str, Any]:
    """At temperature 0 every mode must produce the target's text; count where they differ."""
    reference = None
    for key in sorted(outputs):
        if key[0] == "target":
            reference = [r.text for r in outputs[key]]
            break
    if reference is None:
        return {}
    report = {}
    for (mode, conc), results in sorted(outputs.items()):
        texts = [r.text for r in results]
        n = min(len(texts), len(reference))
        report[f"{mode}@{conc}"] = sum(1 for a, b in zip(texts[:n], reference[:n], strict=True) if a != b)
    return report


async def service_stats(args: argparse.Namespace, prompt_tokens: float) -> dict[str, Any]:
    """Peak RSS and KV-cache bytes per sequence of each service whose metrics were given."""
    stats: dict[str, Any] = {}
    targets = [("gateway", args.base_url.rstrip("/") + "/metrics")]
    for item in args.service_metrics.split(","):
        if "=" in item:
            name, url = item.split("=", 1)
            targets.append((name.strip(), url.strip()))
    async with httpx.AsyncClient(timeout=10) as client:
        for name, url in targets:
            values = await scrape(client, url)
            service: dict[str, Any] = {}
            for key, value in values.items():
                if key.endswith("_peak_rss_bytes"):
                    service["peak_rss_mib"] = value / 2**20
                elif key.endswith("_kv_cache_bytes_per_token") and value:
                    service["kv_bytes_per_token"] = value
                    service["kv_bytes_per_sequence"] = value * (prompt_tokens + args.max_tokens)
            if service:
                stats[name] = service
    return stats


def server_root(url: str) -> str:
    """A server's URL without a trailing slash or `/v1`: the bench adds `/v1/...` and `/metrics`."""
    return url.rstrip("/").removesuffix("/v1")


def servers(p: argparse.ArgumentParser, base_url: str, items: Sequence[str]) -> dict[str, str]:
    """{"": --base-url, NAME: URL for each --server NAME=URL}."""
    named = {"": base_url}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name.strip() or not url.strip() or name.strip() in named:
            p.error(f"--server needs a new NAME=URL, not {item!r}")
        named[name.strip()] = server_root(url.strip())
    return named


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specd bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the gateway (or any OpenAI-compatible server), with or without the /v1 an OpenAI client's base URL has",
    )
    p.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another server in the same run (repeatable): modes written MODE@NAME run against it, and each\n"
        "such row also gets its ratio to MODE on --base-url (vs_base): an interleaved A/B of two gateways",
    )
    p.add_argument("--model", default=None, help="model name; default: the first of /v1/models (of each server)")
    p.add_argument(
        "--modes", default="target,fixed,auto,hf", help=f"comma-separated: {', '.join(HTTP_MODES + HF_MODES)}"
    )
    p.add_argument("-k", type=int, default=4, help="draft tokens per round for fixed mode and the HF peer")
    p.add_argument("--siblings", type=int, default=2, help="siblings beside each block's chain in tree mode")
    p.add_argument("--branches", type=int, default=2, help="branches beside each draft-ahead block in fanout mode")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per level; default max(16, 2 x concurrency)")
    p.add_argument(
        "--workload",
        default="chat",
        help=f"bundled prompts: {', '.join([*workload_names(), *copy_workload_names()])}, mixed or longmix",
    )
    p.add_argument("--dataset", default=None, help="JSONL file of {'prompt': ...} or {'messages': [...]} instead")
    p.add_argument(
        "--blocks",
        type=int,
        default=4,
        help="split each level's prompts into up to this many blocks (each at least one wave of clients);\n"
        "every mode runs every block, in order and then reversed, so a machine whose speed drifts\n"
        "during the run moves no ratio; the per-block ratios' range is reported (1: mode after mode)",
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature above 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens tokens")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output-dir", default="bench-results", help="where the JSON file and plots go")
    p.add_argument("--name", default="", help="a label for this run (file names, plot titles)")
    p.add_argument(
        "--service-metrics",
        default="",
        help="name=URL of the drafter's and verifier's --metrics-port, for peak RSS and KV bytes, e.g.\n"
        "drafter=http://127.0.0.1:9101/metrics,verifier=http://127.0.0.1:9102/metrics",
    )
    hf = p.add_argument_group("the HF peer (modes hf, hf-target): use the same models as the stack")
    hf.add_argument("--hf-target", default="embedded")
    hf.add_argument("--hf-target-dtype", default="float32")
    hf.add_argument("--hf-draft", default="embedded", help="assistant model, or 'ngram' for prompt lookup")
    hf.add_argument("--hf-draft-dtype", default="bfloat16")
    hf.add_argument(
        "--hf-draft-quantize",
        default="auto",
        choices=["auto", "int8", "int4", "none"],
        help="as the drafter service's --quantize (auto: int4 where the weights are 4-bit already, else int8)",
    )
    hf.add_argument("--hf-device", default="cpu")
    args = p.parse_args(argv)
    args.base_url = server_root(args.base_url)
    args.servers = servers(p, args.base_url, args.server)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in args.modes:
        name, server = split_mode(mode)
        if "@" in mode and (name in HF_MODES or server not in args.servers):
            p.error(f"{mode!r}: no --server named {server!r} (HTTP modes only)")
        if mode not in HF_MODES and name not in HTTP_MODES:
            p.error(f"unknown mode {mode!r}; choose from {', '.join(HTTP_MODES + HF_MODES)}")
    if args.blocks < 1:
        p.error("--blocks needs a positive integer")
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1:
        p.error("--concurrency needs positive integers")
    return args


def load_prompts(args: argparse.Namespace) -> list[str]:
    if args.dataset:
        prompts = []
        for line in Path(args.dataset).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                prompts.append(item["prompt"] if "prompt" in item else item["messages"][-1]["content"])
        if not prompts:
            raise SystemExit(f"{args.dataset} holds no prompts")
        return prompts
    return list(prompts_for(args.workload))


def level_prompts(prompts: list[str], args: argparse.Namespace, concurrency: int) -> list[str]:
    n = args.num_prompts or max(16, 2 * concurrency)
    return (prompts * (n // len(prompts) + 1))[:n]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    prompts = load_prompts(args)
    name = args.name or f"{args.workload if not args.dataset else Path(args.dataset).stem}"
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int], list[RequestResult]] = {}
    for warning in (repeated := drafted_again(args.modes, args.levels)):
        print(f"specd bench: {warning}", file=sys.stderr, flush=True)
    http_modes = [m for m in args.modes if m not in HF_MODES]
    models = {server: args.model or first_model(url) for server, url in args.servers.items()} if http_modes else {}
    _run_http_levels(args, models, http_modes, prompts, rows, outputs)
    hf_runs = _run_hf_baselines(args, prompts, rows, outputs)
    order = {m: i for i, m in enumerate(args.modes)}
    rows.sort(key=lambda r: (r["concurrency"], order[r["mode"]]))
    add_bounds(rows, args.k)
    sent = [r for (mode, _), results in outputs.items() if mode not in HF_MODES for r in results]
    prompt_tokens = sum(r.prompt_tokens for r in sent) / len(sent) if sent else 0.0
    report: dict[str, Any] = {
        "name": name,
        "command": "specd bench " + " ".join(sys.argv[2:] if argv is None else argv),
        "machine": machine(),
        "date": measured_at(),
        "commit": source_commit(),
        "args": {k: v for k, v in vars(args).items() if k != "levels"},
        "hf_peers": hf_runs,
        "results": rows,
        "drafted_again": repeated,
    }
    if http_modes:
        report["services"] = asyncio.run(service_stats(args, prompt_tokens))
    if args.temperature == 0:
        report["output_mismatches_vs_target"] = compare_outputs(outputs)
    print_summary(rows, report)
    json_path = out_dir / f"bench-{name}.json"
    json_path.write_text(json.dumps(report, indent=2, default=float))
    from specd.tools.benchplots import plot_all

    plots = plot_all(rows, out_dir / f"plots-{name}", name)
    print(f"wrote {json_path} and {', '.join(str(p) for p in plots)}")


def first_model(url: str) -> str:
    return str(httpx.get(url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"])


def _run_http_levels(
    args: argparse.Namespace,
    models: dict[str, str],
    http_modes: list[str],
    prompts: list[str],
    rows: list[dict[str, Any]],
    outputs: dict[tuple[str, int], list[RequestResult]],
) -> None:
    """Each concurrency level against the server, in every HTTP mode; adds rows and outputs."""
    for concurrency in args.levels:
        batch = level_prompts(prompts, args, concurrency)
        if not http_modes:
            continue
        level_rows, level_results = asyncio.run(run_level(args, models, http_modes, batch, concurrency))
        for row in level_rows:
            rows.append(row)
            outputs[(row["mode"], concurrency)] = level_results[row["mode"]]
            print(f"{row['mode']} @ {concurrency}: {row['output_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)


def _run_hf_baselines(
    args: argparse.Namespace,
    prompts: list[str],
    rows: list[dict[str, Any]],
    outputs: dict[tuple[str, int], list[RequestResult]],
) -> dict[str, Any]:
    """The in-process Hugging Face peers (hf-* modes); adds rows and outputs, returns each mode's peer name."""
    hf_runs: dict[str, Any] = {}
    for mode in [m for m in args.modes if m in HF_MODES]:
        from tqdm import tqdm

        from specd.tools.hf_baseline import HfBaseline, HfConfig

        config = HfConfig(
            target=args.hf_target,
            target_dtype=args.hf_target_dtype,
            draft="none" if mode == "hf-target" else args.hf_draft,
            draft_dtype=args.hf_draft_dtype,
            draft_quantize=args.hf_draft_quantize,
            device=args.hf_device,
            k=args.k,
        )
        baseline = HfBaseline(config)
        # One serial pass over the longest level's prompts serves every level: a
        # batch-size-1 server's queueing at N clients follows from its solo timings.
        longest = level_prompts(prompts, args, max(args.levels))
        bar = tqdm(total=len(longest), desc=f"{mode:>9} (serial)", unit="req", file=sys.stderr, leave=False)
        solo = baseline.run(longest, args.max_tokens, args.temperature, args.ignore_eos, bar, top_p=args.top_p)
        bar.close()
        hf_runs[mode] = baseline.name
        del baseline
        for concurrency in args.levels:
            n = len(level_prompts(prompts, args, concurrency))
            served = serial_schedule(solo[:n], concurrency)
            row = {"mode": mode, "concurrency": concurrency, **summarize(served, serial_wall_s(solo[:n]))}
            row["peer"] = hf_runs[mode]
            rows.append(row)
            outputs[(mode, concurrency)] = served
    return hf_runs
