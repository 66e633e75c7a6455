"""Adaptive speculation and per-request k through real services."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import stack as st
from references import greedy_references
from stack import base_url
from test_metrics import greedy_rounds, parse

PROMPT = "The capital of France is"


def scrape(gateway: st.Service) -> dict[str, float]:
    return parse(httpx.get(base_url(gateway) + "/metrics").text)


@pytest.fixture(scope="module")
def auto_gateway(backends, model_dirs, log_dir) -> Iterator[st.Service]:
    """A gateway in auto mode whose drafter is the target itself: every draft is accepted."""
    verifier, _ = backends
    drafter = st.spawn_backend(
        "drafter", ["--model", str(model_dirs["target"]), "--dtype", "float32", "--quantize", "none"], log_dir
    )
    try:
        gateway = st.spawn_gateway(
            verifier,
            drafter,
            ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4", "--speculative-mode", "auto"],
            log_dir,
        )
        try:
            st.ready_backend(drafter)
            st.ready_gateway(gateway)
            yield gateway
        finally:
            gateway.stop()
    finally:
        drafter.stop()


def complete(gateway: st.Service, **extra) -> httpx.Response:
    body = {"model": "target", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(base_url(gateway) + "/v1/completions", json=body, timeout=120)


def reference(tok, tiny_target, n: int) -> list[int]:
    return greedy_references(tok, tiny_target, [PROMPT], n)[PROMPT]


def test_auto_mode_drafts_when_drafts_are_accepted_and_stays_exact(auto_gateway, tok, tiny_target):
    expected = tok.decode(reference(tok, tiny_target, 20))
    before = scrape(auto_gateway)
    for _ in range(4):
        r = complete(auto_gateway)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
    after = scrape(auto_gateway)
    drafts = after["specd_spec_decode_num_drafts_total"] - before.get("specd_spec_decode_num_drafts_total", 0)
    accepted = after["specd_spec_decode_num_accepted_tokens_total"] - before.get(
        "specd_spec_decode_num_accepted_tokens_total", 0
    )
    assert drafts > 0 and accepted > 0
    # Each round's chosen k per sequence lands in the histogram; the gains are finite ratios.
    assert after["specd_spec_decode_chosen_k_count"] > before.get("specd_spec_decode_chosen_k_count", 0)
    assert after["specd_spec_decode_predicted_gain"] > 0
    assert after["specd_spec_decode_observed_gain"] > 0


def test_request_can_fix_its_own_k(auto_gateway, tok, tiny_target):
    expected = tok.decode(reference(tok, tiny_target, 20))
    # Warms the drafter up: a cold one's first open takes many rounds, run target-only beside it.
    assert complete(auto_gateway, num_speculative_tokens=2, max_tokens=4).status_code == 200
    before = scrape(auto_gateway)
    r = complete(auto_gateway, num_speculative_tokens=0)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    middle = scrape(auto_gateway)
    assert middle["specd_spec_decode_num_drafts_total"] == before["specd_spec_decode_num_drafts_total"]
    r = complete(auto_gateway, num_speculative_tokens=2)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected
    after = scrape(auto_gateway)
    drafts = after["specd_spec_decode_num_drafts_total"] - middle["specd_spec_decode_num_drafts_total"]
    tokens = after["specd_spec_decode_num_draft_tokens_total"] - middle["specd_spec_decode_num_draft_tokens_total"]
    # 20 tokens at k=2, all accepted: a first target-only round, target-only rounds while the
    # sequence's drafter cache gets ready beside them (few, the drafter warm), then rounds
    # of 3 tokens at the request's own k, none past max_tokens. With none (ready at its first
    # token): six rounds of 3 tokens and a last one of 1.
    unready = (
        after["specd_spec_decode_drafter_unready_rounds_total"]
        - middle["specd_spec_decode_drafter_unready_rounds_total"]
    )
    counts = greedy_rounds(20, 2, int(unready))
    assert counts["drafts"] >= 2, unready
    assert drafts == counts["drafts"]
    assert tokens == counts["draft_tokens"]
    assert after["specd_rounds_total"] - middle["specd_rounds_total"] == counts["rounds"]
    r = complete(auto_gateway, num_speculative_tokens="auto")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("value", [5, -1, "sometimes", 2.5])
def test_bad_num_speculative_tokens_is_a_400(auto_gateway, value):
    r = complete(auto_gateway, num_speculative_tokens=value)
    assert r.status_code == 400
    assert r.json()["error"]["message"]


def test_disable_by_batch_size_turns_drafting_off(gateway_for, tok, tiny_target):
    gateway = gateway_for(4, "--speculative-disable-by-batch-size", "1")
    before = scrape(gateway)
    r = complete(gateway)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == tok.decode(reference(tok, tiny_target, 20))
    after = scrape(gateway)
    assert after["specd_spec_decode_num_drafts_total"] == before.get("specd_spec_decode_num_drafts_total", 0)
    assert after["specd_spec_decode_chosen_k_bucket{le=0.0}"] > before.get(
        "specd_spec_decode_chosen_k_bucket{le=0.0}", 0
    )
