"""/metrics parses as Prometheus text and its speculation counters move by the right amounts."""

from __future__ import annotations

import httpx
import stack as st
from prometheus_client.parser import text_string_to_metric_families
from stack import base_url


def scrape(gateway) -> dict[str, float]:
    text = httpx.get(base_url(gateway) + "/metrics").text
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_drafter_equal_to_target_accepts_every_draft_token(backends, model_dirs, log_dir):
    verifier, _ = backends
    drafter = st.start_backend(
        "drafter", ["--model", str(model_dirs["target"]), "--dtype", "float32", "--quantize", "none"], log_dir
    )
    try:
        gateway = st.start_gateway(
            verifier, drafter, ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4"], log_dir
        )
        try:
            before = scrape(gateway)
            body = {"model": "target", "prompt": "Hello", "max_tokens": 21, "temperature": 0, "ignore_eos": True}
            r = httpx.post(base_url(gateway) + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            after = scrape(gateway)
        finally:
            gateway.stop()
    finally:
        drafter.stop()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    # 21 tokens at k=4: a target-only first round (it only makes the first token),
    # four rounds of 4 accepted drafts + 1 bonus token, then no drafts for the last
    # token (drafting past max_tokens is wasted work).
    assert delta("specd_spec_decode_num_drafts_total") == 4
    assert delta("specd_spec_decode_num_draft_tokens_total") == 16
    assert delta("specd_spec_decode_num_accepted_tokens_total") == 16
    for pos in range(4):
        assert delta(f"specd_spec_decode_num_accepted_tokens_per_pos_total{{position={pos}}}") == 4
    assert delta("specd_rounds_total") == 5
    assert delta("specd_generation_tokens_total") == 21
    assert delta("specd_request_success_total{finished_reason=length}") == 1
