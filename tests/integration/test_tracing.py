"""One trace per request across gateway, drafter and verifier processes, from a shared --trace-file."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import defaultdict

import httpx
import pytest
import stack as st

from specd.tools.traces import load_spans


@pytest.fixture(scope="module")
def traced(model_dirs, log_dir, tmp_path_factory):
    """Run requests through three traced processes, stop them (flushing spans), return the spans."""
    trace_file = tmp_path_factory.mktemp("traces") / "spans.jsonl"
    flags = ("--dtype", "float32", "--trace-file", str(trace_file))
    s = st.start_stack(
        model_dirs["target"],
        model_dirs["draft"],
        log_dir,
        k=4,
        backend_args=flags,
        gateway_args=("--trace-file", str(trace_file)),
    )
    try:
        url = st.base_url(s.gateway)
        body = {"model": "target", "prompt": "Hello there", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200

        async def many() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                replies = await asyncio.gather(
                    *(c.post("/v1/completions", json={**body, "prompt": f"Request {i}"}) for i in range(8))
                )
            assert all(r.status_code == 200 for r in replies)

        asyncio.run(many())
    finally:
        s.stop()
    # The file is OTLP JSON (one ExportTraceServiceRequest a line); specd traces reads it back.
    spans = [dataclasses.asdict(span) for span in load_spans([trace_file])]
    return spans, trace_file


def test_every_request_is_one_trace_across_three_services(traced):
    spans, _ = traced
    by_id = {s["span_id"]: s for s in spans}
    requests = [s for s in spans if s["name"] == "specd.request"]
    assert len(requests) == 9
    assert len({r["trace_id"] for r in requests}) == 9  # each request its own trace
    for request in requests:
        assert request["service"] == "specd-gateway"
        assert request["parent_span_id"] is None
        assert request["attributes"]["specd.completion_tokens"] == 12
        assert request["attributes"]["specd.finish_reason"] == "length"
        trace = [s for s in spans if s["trace_id"] == request["trace_id"]]
        assert {s["service"] for s in trace} == {"specd-gateway", "specd-drafter", "specd-verifier"}
        rounds = [s for s in trace if s["name"] == "specd.round"]
        assert rounds and all(r["parent_span_id"] == request["span_id"] for r in rounds)
        # Every round verified; the first is target-only (the drafter joins after the first token).
        verifies = [s for s in trace if s["name"] == "verifier.verify"]
        assert len(verifies) == len(rounds)
        exchanges = [s for s in trace if s["name"] == "drafter.draft"]
        # Some exchanges may only prefill a chunk of the prompt (k 0) beside a verify.
        drafts = [s for s in exchanges if s["attributes"]["specd.k"] > 0]
        assert len(drafts) == sum(1 for r in rounds if r["attributes"]["specd.k"] > 0) >= 1
        for s in verifies + exchanges:
            assert by_id[s["parent_span_id"]]["name"] == "specd.round"
        for name, parent in (
            ("verifier.forward", "verifier.verify"),
            ("verifier.rejection_sampling", "verifier.verify"),
            ("drafter.step", "drafter.draft"),
            ("drafter.rollback", "drafter.draft"),
        ):
            children = [s for s in trace if s["name"] == name]
            assert children and all(by_id[c["parent_span_id"]]["name"] == parent for c in children)
        # Each round span says what it did and where its time went.
        accepted = sum(r["attributes"]["specd.accepted"] for r in rounds)
        assert accepted + len(rounds) == 12
        for r in rounds:
            a = r["attributes"]
            assert a["specd.round_ms"] >= a["specd.verify_ms"] > 0
            assert a["specd.verifier_ms"] >= a["specd.verifier_forward_ms"] > 0
            assert a["specd.overhead_ms"] == pytest.approx(
                a["specd.round_ms"] - a["specd.drafter_ms"] - a["specd.verifier_ms"]
            )
            parts = a["specd.draft_ms"] + a["specd.verify_ms"] + a["specd.join_ms"] + a["specd.outside_ms"]
            assert parts == pytest.approx(a["specd.round_ms"]) and a["specd.outside_ms"] >= 0
        # Each service's open of the request is a span of its trace, under the request.
        for service in ("verifier", "drafter"):
            opens = [s for s in trace if s["name"] == f"{service}.open"]
            assert len(opens) == 1 and opens[0]["parent_span_id"] == request["span_id"], service
            assert opens[0]["attributes"]["specd.prompt_tokens"] > 0


def test_concurrent_requests_share_rounds_but_keep_their_own_traces(traced):
    spans, _ = traced
    rounds = [s for s in spans if s["name"] == "specd.round"]
    by_round: dict[int, list[dict]] = defaultdict(list)
    for r in rounds:
        by_round[r["attributes"]["specd.round_id"]].append(r)
    shared = [group for group in by_round.values() if len(group) > 1]
    assert shared, "8 concurrent requests should have shared rounds"
    for group in shared:
        assert len({r["trace_id"] for r in group}) == len(group)  # one span per request it served
        assert {r["attributes"]["specd.batch_size"] for r in group} == {group[0]["attributes"]["specd.batch_size"]}
        assert group[0]["attributes"]["specd.batch_size"] >= len(group)
    # The services' spans of a shared round sit in the trace of the request they served.
    requests = {s["trace_id"]: s for s in spans if s["name"] == "specd.request"}
    for s in spans:
        if s["name"] in ("verifier.verify", "drafter.draft"):
            assert s["trace_id"] in requests


def test_specd_traces_summarises_the_recorded_file(traced):
    import subprocess
    import sys

    spans, trace_file = traced
    out = subprocess.run(
        [sys.executable, "-m", "specd.cli", "traces", str(trace_file), "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    summary = json.loads(out.stdout)
    rounds = [s for s in spans if s["name"] == "specd.round"]
    assert summary["rounds"]["count"] == len({r["attributes"]["specd.round_id"] for r in rounds})
    assert summary["requests"]["count"] == 9
    speculative = [r["attributes"] for r in rounds if r["attributes"]["specd.k"] > 0]
    expected_rate = sum(a["specd.accepted"] for a in speculative) / sum(a["specd.k"] for a in speculative)
    assert summary["acceptance"]["rate"] == pytest.approx(expected_rate)
    request_traces = {s["trace_id"] for s in spans if s["name"] == "specd.request"}
    assert summary["slowest_rounds"]
    for slow in summary["slowest_rounds"]:
        assert set(slow["trace_ids"]) <= request_traces
    text = subprocess.run(
        [sys.executable, "-m", "specd.cli", "traces", str(trace_file)], capture_output=True, text=True, check=True
    ).stdout
    for expected in ("specd-gateway", "specd-drafter", "specd-verifier", "verifier.forward", "overhead"):
        assert expected in text
