"""/metrics parses as Prometheus text and its speculation counters move by the right amounts."""

from __future__ import annotations

import os
import time

import httpx
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from stack import base_url


def greedy_rounds(max_tokens: int, k: int, unready: int) -> dict[str, int]:
    """What one greedy sequence whose every draft is accepted makes at k: a target-only first
    round, `unready` target-only rounds while its drafter cache gets ready (the drafter's
    prefill runs beside the rounds), then k drafts a round but none past max_tokens."""
    made = 1 + unready
    counts = {"rounds": made, "drafts": 0, "draft_tokens": 0}
    per_pos = [0] * k
    while made < max_tokens:
        drafted = min(k, max_tokens - made - 1)  # drafting past max_tokens is wasted work
        counts["rounds"] += 1
        if drafted:
            counts["drafts"] += 1
            counts["draft_tokens"] += drafted
            per_pos[:drafted] = [n + 1 for n in per_pos[:drafted]]
        made += drafted + 1
    return counts | {f"pos{i}": n for i, n in enumerate(per_pos)}


def scrape(gateway) -> dict[str, float]:
    return parse(httpx.get(base_url(gateway) + "/metrics").text)


def parse(text: str) -> dict[str, float]:
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_drafter_equal_to_target_accepts_every_draft_token(backends, model_dirs, log_dir):
    verifier, _ = backends
    metrics_port = st.free_port()
    drafter = st.spawn_backend(
        "drafter",
        [
            "--model", str(model_dirs["target"]),
            "--dtype", "float32",
            "--quantize", "none",
            "--metrics-port", str(metrics_port),
        ],
        log_dir,
    )  # fmt: skip
    try:
        gateway = st.spawn_gateway(
            verifier,
            drafter,
            ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4", "--speculative-mode", "fixed"],
            log_dir,
        )
        try:
            st.ready_backend(drafter)
            st.ready_gateway(gateway)
            body = {"model": "target", "prompt": "Hello", "max_tokens": 23, "temperature": 0, "ignore_eos": True}
            # A first request warms the drafter up: a cold one's first open takes many rounds,
            # which run target-only beside it, and would leave the request measured few drafts.
            warm = httpx.post(base_url(gateway) + "/v1/completions", json={**body, "max_tokens": 6}, timeout=60)
            assert warm.status_code == 200
            drafter_before = parse(httpx.get(f"http://{st.HOST}:{metrics_port}/metrics").text)
            before = scrape(gateway)
            r = httpx.post(base_url(gateway) + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            after = scrape(gateway)
            # Sequences are closed on the services right after the reply: allow that a moment.
            deadline = time.monotonic() + 10
            while True:
                drafter_metrics = parse(httpx.get(f"http://{st.HOST}:{metrics_port}/metrics").text)
                if drafter_metrics["specd_drafter_open_sequences"] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            gateway.stop()
    finally:
        drafter.stop()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # 23 tokens at k=4: a target-only first round (it only makes the first token), target-only
    # rounds while the sequence joins the drafter beside them (none if it joined beside the
    # verifier's open), then rounds of 4 accepted
    # drafts + 1 bonus token, none past max_tokens. With one such round: 4 rounds of 4 drafts,
    # and a last one of 1 token.
    unready = delta("specd_spec_decode_drafter_unready_rounds_total")
    expected = greedy_rounds(23, 4, int(unready))
    drafts = expected["drafts"]
    assert drafts >= 2, unready
    assert delta("specd_spec_decode_num_drafts_total") == drafts
    assert delta("specd_spec_decode_num_draft_tokens_total") == expected["draft_tokens"]
    assert delta("specd_spec_decode_num_accepted_tokens_total") == expected["draft_tokens"]
    for pos in range(4):
        assert delta(f"specd_spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}") == expected[f"pos{pos}"]
    assert delta("specd_rounds_total") == expected["rounds"]
    # Since start, the warm-up's drafts (all accepted too) with these.
    accepted, proposed = (after[f"specd_spec_decode_num_{n}_total"] for n in ("accepted_tokens", "drafts"))
    assert after["specd_spec_decode_mean_acceptance_length"] == 1 + accepted / proposed
    assert accepted == after["specd_spec_decode_num_draft_tokens_total"]
    assert delta("specd_generation_tokens_total") == 23
    assert delta("specd_request_success_total{finished_reason=length}") == 1

    # The drafter's own metrics: four draft rounds, nothing left open, its KV cache reserved at
    # --max-sequences (64) and --branch-slots' default (as many on the CPU, a quarter on a GPU)
    # x --max-context (2048, capped at the tiny model's 512 positions), said at startup, and none
    # of it backed by memory once its sequence closed where CPU pages go back (on a GPU, with
    # SPECD_DRAFTER_DEVICE=cuda, the whole reservation is allocated up front).
    def drafter_delta(name: str) -> float:
        return drafter_metrics[name] - drafter_before[name]

    assert drafter_delta("specd_drafter_rounds_total") == drafts
    assert drafter_metrics["specd_drafter_open_sequences"] == 0
    up_front = "allocated up front" in drafter.output()
    branches = 16 if up_front else 64
    per_token = drafter_metrics["specd_drafter_kv_cache_bytes_per_token"]
    reserved = drafter_metrics["specd_drafter_kv_cache_reserved_bytes"]
    assert per_token > 0 and reserved == per_token * (64 + branches) * 512
    assert f"KV cache: {int(reserved)} bytes" in drafter.output()
    assert up_front == (os.environ.get("SPECD_DRAFTER_DEVICE", "cpu") != "cpu")
    assert drafter_metrics["specd_drafter_kv_cache_bytes"] == (reserved if up_front else 0)
    assert f"reserved for 64 sequences + {branches} fan-out branches x 512 positions" in drafter.output()
    assert drafter_delta("specd_drafter_forward_seconds_count") == drafts
