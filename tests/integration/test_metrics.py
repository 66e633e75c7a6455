"""/metrics parses as Prometheus text and its speculation counters move by the right amounts."""

from __future__ import annotations

import os
import time

import httpx
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from stack import base_url


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
            before = scrape(gateway)
            body = {"model": "target", "prompt": "Hello", "max_tokens": 23, "temperature": 0, "ignore_eos": True}
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

    # 23 tokens at k=4: a target-only first round (it only makes the first token), a
    # target-only second round while the sequence joins the drafter beside that verify,
    # four rounds of 4 accepted drafts + 1 bonus token, then no drafts for the last
    # token (drafting past max_tokens is wasted work).
    assert delta("specd_spec_decode_num_drafts_total") == 4
    assert delta("specd_spec_decode_num_draft_tokens_total") == 16
    assert delta("specd_spec_decode_num_accepted_tokens_total") == 16
    for pos in range(4):
        assert delta(f"specd_spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}") == 4
    assert delta("specd_rounds_total") == 7
    assert after["specd_spec_decode_mean_acceptance_length"] == 5.0
    assert delta("specd_generation_tokens_total") == 23
    assert delta("specd_request_success_total{finished_reason=length}") == 1
    # The drafter's own metrics: four draft rounds, nothing left open, its KV cache reserved at
    # --max-sequences (64) and --branch-slots' default (as many on the CPU, a quarter on a GPU)
    # x --max-context (2048, capped at the tiny model's 512 positions), said at startup, and none
    # of it backed by memory once its sequence closed where CPU pages go back (on a GPU, with
    # SPECD_DRAFTER_DEVICE=cuda, the whole reservation is allocated up front).
    assert drafter_metrics["specd_drafter_rounds_total"] == 4
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
    assert drafter_metrics["specd_drafter_forward_seconds_count"] == 4
