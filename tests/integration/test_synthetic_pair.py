"""A drafter and a verifier with synthetic weights (--load-format synthetic): the gateway measures
the agreement they were made with, and /v1/models says the weights are made."""

from __future__ import annotations

import httpx
import stack as st
from test_metrics import parse

ALPHA = 0.8


def test_the_gateway_measures_the_set_agreement(model_dirs, log_dir):
    made = ["--load-format", "synthetic", "--synthetic-seed", "5", "--dtype", "float32"]
    verifier = st.spawn_backend("verifier", ["--model", str(model_dirs["target"]), *made], log_dir)
    drafter = st.spawn_backend(
        "drafter",
        ["--model", str(model_dirs["target"]), *made, "--quantize", "none", "--synthetic-agreement", str(ALPHA)],
        log_dir,
    )
    services = [verifier, drafter]
    try:
        args = ["--tokenizer", str(model_dirs["target"]), "--num-speculative-tokens", "4"]
        gateway = st.spawn_gateway(verifier, drafter, args, log_dir)
        services.append(gateway)
        for backend in (verifier, drafter):
            st.ready_backend(backend)
        st.ready_gateway(gateway)
        card = httpx.get(st.base_url(gateway) + "/v1/models").json()["data"][0]
        assert card["weights"] == f"target synthetic (seed 5); drafter synthetic (seed 5, agreement {ALPHA:g})"
        st.complete_texts(st.base_url(gateway), [f"Story number {i}:" for i in range(4)], max_tokens=200)
        metrics = parse(httpx.get(st.base_url(gateway) + "/metrics").text)
    finally:
        st.stop_all(list(reversed(services)))
    accepted = [metrics[f"specd_spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(4)]
    drafts = metrics["specd_spec_decode_num_drafts_total"]
    # Each draft position is a trial only if the ones before it were accepted: the agreement rate
    # is the accepted positions over the positions reached.
    reached = drafts + sum(accepted[:-1])
    measured = sum(accepted) / reached
    print(f"agreement {ALPHA}: measured {measured:.3f} over {reached:.0f} draft positions")
    assert abs(measured - ALPHA) <= 0.05, (measured, reached)
    assert "SYNTHETIC (SEED 5, AGREEMENT 0.8)" in drafter.output() and "SYNTHETIC (SEED 5)" in verifier.output()
