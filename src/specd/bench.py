"""`specd bench`: drive an OpenAI-compatible endpoint and report what users measure.

Streams chat completions at a given concurrency and reports output tokens/s,
TTFT, TPOT and inter-token latency percentiles; against a specd gateway it also
reads /metrics before and after for the acceptance rate and mean acceptance length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from specd.traces import percentile
from specd.workloads import CHAT


@dataclass
class RequestResult:
    ttft_s: float
    e2e_s: float
    completion_tokens: int
    chunk_gaps_s: list[float] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace) -> RequestResult:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            choices = payload.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)  # type: ignore[operator]
                last = now
    end = time.perf_counter()
    return RequestResult((first or end) - start, end - start, tokens, gaps)


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        r = await client.get("/metrics")
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


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta("specd_spec_decode_num_drafts_total")
    draft_tokens = delta("specd_spec_decode_num_draft_tokens_total")
    accepted = delta("specd_spec_decode_num_accepted_tokens_total")
    if not drafts:
        return {}
    per_pos = {}
    for key in after:
        if key.startswith("specd_spec_decode_num_accepted_tokens_per_pos_total|position="):
            pos = int(key.rsplit("=", 1)[1])
            per_pos[pos] = delta(key) / drafts
    return {
        "acceptance_rate": accepted / draft_tokens if draft_tokens else float("nan"),
        "mean_acceptance_length": 1.0 + accepted / drafts,
        "per_position_acceptance": [per_pos[p] for p in sorted(per_pos)],
    }


async def run_level(args: argparse.Namespace, prompts: list[str], concurrency: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        # One untimed request so first-call costs do not land in the figures.
        await one_request(client, model, prompts[0], args)
        before = await scrape(client)
        queue = list(prompts)
        results: list[RequestResult] = []

        async def worker() -> None:
            while queue:
                results.append(await one_request(client, model, queue.pop(0), args))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        after = await scrape(client)
    tokens = sum(r.completion_tokens for r in results)
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in results if r.completion_tokens > 1]
    gaps = [g for r in results for g in r.chunk_gaps_s]
    summary: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "output_tokens_per_s_per_user": statistics.mean(r.completion_tokens / r.e2e_s for r in results),
    }
    for name, values in (
        ("ttft_ms", [r.ttft_s for r in results]),
        ("tpot_ms", tpot),
        ("itl_ms", gaps),
        ("e2e_ms", [r.e2e_s for r in results]),
    ):
        for q in (50, 95, 99):
            summary[f"{name}_p{q}"] = percentile(values, q) * 1000
    summary.update(acceptance(before, after))
    return summary


def load_prompts(args: argparse.Namespace) -> list[str]:
    if args.dataset:
        prompts = []
        for line in Path(args.dataset).read_text().splitlines():
            if line.strip():
                item = json.loads(line)
                prompts.append(item["prompt"] if "prompt" in item else item["messages"][-1]["content"])
    else:
        prompts = list(CHAT)
    return (prompts * (args.num_prompts // len(prompts) + 1))[: args.num_prompts]


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("conc", "concurrency", "{:d}"),
        ("tok/s", "output_tokens_per_s", "{:.1f}"),
        ("tok/s/user", "output_tokens_per_s_per_user", "{:.1f}"),
        ("TTFT p50 ms", "ttft_ms_p50", "{:.0f}"),
        ("TPOT p50 ms", "tpot_ms_p50", "{:.1f}"),
        ("ITL p50 ms", "itl_ms_p50", "{:.1f}"),
        ("ITL p95 ms", "itl_ms_p95", "{:.1f}"),
        ("accept", "acceptance_rate", "{:.3f}"),
        ("mean acc len", "mean_acceptance_length", "{:.2f}"),
    ]
    print(" | ".join(c[0] for c in cols))
    for row in rows:
        print(" | ".join(fmt.format(row[key]) if key in row else "-" for _, key, fmt in cols))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specd bench", description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    p.add_argument("--concurrency", default="1", help="comma-separated levels, e.g. 1,4,16")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate max-tokens tokens")
    p.add_argument("--dataset", default=None, help="JSONL file of {'prompt': ...} or {'messages': [...]}")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--output", default=None, help="write every figure to this JSON file")
    args = p.parse_args(argv)
    prompts = load_prompts(args)
    rows = [asyncio.run(run_level(args, prompts, int(c))) for c in args.concurrency.split(",")]
    print_table(rows)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
