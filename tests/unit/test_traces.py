"""`specd traces` on a small synthetic trace with hand-checked figures, in both input formats."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import pytest

from gateway.metrics import RoundTimes
from specd.tools.traces import load_spans, main, parse_text, percentile, render_text, summarise

TRACE_A = "a" * 32
TRACE_B = "b" * 32
GATEWAY, DRAFTER, VERIFIER = "specd-gateway", "specd-drafter", "specd-verifier"
T0 = 1_700_000_000_000_000_000
MS = 1_000_000

# (round_id, batch_size, round_ms, draft_ms, verify_ms, drafter_ms, verifier_ms, drafter_fwd, verifier_fwd, overhead)
ROUND_TIMES = {
    1: (1, 10.0, 4.0, 5.0, 3.5, 4.5, 3.0, 4.0, 2.0),
    2: (2, 20.0, 8.0, 10.0, 7.0, 9.0, 6.0, 8.0, 4.0),
    3: (1, 6.0, 0.0, 5.0, 0.0, 4.5, 0.0, 4.0, 1.5),
}
PHASE_KEYS = (
    "batch_size",
    "round_ms",
    "draft_ms",
    "verify_ms",
    "drafter_ms",
    "verifier_ms",
    "drafter_forward_ms",
    "verifier_forward_ms",
    "overhead_ms",
)


class Builder:
    """Writes specd --trace-file spans with sequential ids and explicit start/duration."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []

    def add(
        self,
        trace: str,
        name: str,
        service: str,
        start_ms: float,
        dur_ms: float,
        parent: str | None = None,
        links: list[dict[str, Any]] | None = None,
        **attrs: Any,
    ) -> str:
        span_id = f"{len(self.spans) + 1:016x}"
        self.spans.append(
            {
                "trace_id": trace,
                "span_id": span_id,
                "parent_span_id": parent,
                "name": name,
                "service": service,
                "start_ns": T0 + int(start_ms * MS),
                "end_ns": T0 + int((start_ms + dur_ms) * MS),
                "attributes": {f"specd.{k}" if not k.startswith("x_") else k[2:]: v for k, v in attrs.items()},
                "links": links or [],
                "status": "OK",
            }
        )
        return span_id


def round_attrs(round_id: int, k: int, accepted: int) -> dict[str, Any]:
    times = dict(zip(PHASE_KEYS, ROUND_TIMES[round_id], strict=True))
    return {"round_id": round_id, "k": k, "accepted": accepted, **times}


def synthetic_trace() -> list[dict[str, Any]]:
    """Request A: round 1 alone (k=4, 3 accepted), round 2 batched with B (k=4, 1 accepted).
    Request B: round 2 (k=2, 2 accepted), round 3 alone target-only (k=0)."""
    b = Builder()
    req_a = b.add(TRACE_A, "specd.request", GATEWAY, 0, 40, prompt_tokens=5, completion_tokens=9, ttft_ms=12.0,
                  tpot_ms=5.0, acceptance_rate=0.5, finish_reason="stop")  # fmt: skip
    req_b = b.add(TRACE_B, "specd.request", GATEWAY, 10, 30, prompt_tokens=7, completion_tokens=4, ttft_ms=30.0,
                  tpot_ms=7.0, acceptance_rate=1.0, finish_reason="length")  # fmt: skip
    b.add(TRACE_A, "gateway.tokenize", GATEWAY, 0, 0.5, parent=req_a)
    # Round 1: A alone, drafted 4.
    r1 = b.add(TRACE_A, "specd.round", GATEWAY, 1, 10, parent=req_a, **round_attrs(1, 4, 3))
    d1 = b.add(TRACE_A, "drafter.draft", DRAFTER, 1.2, 3.5, parent=r1)
    b.add(TRACE_A, "drafter.rollback", DRAFTER, 1.2, 0.5, parent=d1)
    for step in range(4):
        b.add(TRACE_A, "drafter.step", DRAFTER, 1.7 + step * 0.75, 0.75, parent=d1, step=step)
    v1 = b.add(TRACE_A, "verifier.verify", VERIFIER, 5.5, 4.5, parent=r1)
    b.add(TRACE_A, "verifier.forward", VERIFIER, 5.5, 3.0, parent=v1)
    b.add(TRACE_A, "verifier.rejection_sampling", VERIFIER, 8.5, 1.0, parent=v1)
    # Round 2: A and B batched; the services' spans hang off A's round span and link to B's.
    r2a = b.add(TRACE_A, "specd.round", GATEWAY, 12, 20, parent=req_a, **round_attrs(2, 4, 1))
    r2b = b.add(TRACE_B, "specd.round", GATEWAY, 12, 20, parent=req_b, **round_attrs(2, 2, 2))
    link = [{"trace_id": TRACE_B, "span_id": r2b, "attributes": {"specd.batch_index": 1}}]
    d2 = b.add(TRACE_A, "drafter.draft", DRAFTER, 12.5, 7, parent=r2a, links=link)
    b.add(TRACE_A, "drafter.rollback", DRAFTER, 12.5, 1.0, parent=d2)
    for step in range(4):
        b.add(TRACE_A, "drafter.step", DRAFTER, 13.5 + step * 1.5, 1.5, parent=d2, step=step)
    v2 = b.add(TRACE_A, "verifier.verify", VERIFIER, 21, 9, parent=r2a, links=link)
    b.add(TRACE_A, "verifier.forward", VERIFIER, 21, 7.0, parent=v2)
    b.add(TRACE_A, "verifier.rejection_sampling", VERIFIER, 28, 2.0, parent=v2)
    # Round 3: B alone, target-only.
    r3 = b.add(TRACE_B, "specd.round", GATEWAY, 33, 6, parent=req_b, x_note=["target", "only"], x_flag=True,
               **round_attrs(3, 0, 0))  # fmt: skip
    v3 = b.add(TRACE_B, "verifier.verify", VERIFIER, 33.5, 4.5, parent=r3)
    b.add(TRACE_B, "verifier.forward", VERIFIER, 33.5, 4.0, parent=v3)
    b.add(TRACE_B, "verifier.rejection_sampling", VERIFIER, 37.5, 0.5, parent=v3)
    return b.spans


# ---------------------------------------------------------------- OTLP conversion


def otlp_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}  # protojson writes int64 as a string
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list):
        return {"arrayValue": {"values": [otlp_value(v) for v in value]}}
    return {"stringValue": str(value)}


def otlp_attrs(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": otlp_value(v)} for k, v in attrs.items()]


def otlp_span(span: dict[str, Any]) -> dict[str, Any]:
    out = {
        "traceId": span["trace_id"],
        "spanId": span["span_id"],
        "name": span["name"],
        "kind": 1,
        "startTimeUnixNano": str(span["start_ns"]),
        "endTimeUnixNano": str(span["end_ns"]),
        "attributes": otlp_attrs(span["attributes"]),
        "links": [
            {"traceId": x["trace_id"], "spanId": x["span_id"], "attributes": otlp_attrs(x["attributes"])}
            for x in span["links"]
        ],
        "status": {"code": 1},
    }
    if span["parent_span_id"]:
        out["parentSpanId"] = span["parent_span_id"]
    return out


def otlp_request(spans: list[dict[str, Any]]) -> dict[str, Any]:
    services = list(dict.fromkeys(s["service"] for s in spans))
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": otlp_attrs({"service.name": service})},
                "scopeSpans": [
                    {"scope": {"name": "specd"}, "spans": [otlp_span(s) for s in spans if s["service"] == service]}
                ],
            }
            for service in services
        ]
    }


# ---------------------------------------------------------------- fixtures


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "trace.jsonl", synthetic_trace())


@pytest.fixture
def summary(trace_file: Path) -> dict[str, Any]:
    return summarise(load_spans([trace_file]))


# ---------------------------------------------------------------- tests


def test_percentile_interpolates() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_span_counts_per_service(summary: dict[str, Any]) -> None:
    counts = {(r["service"], r["name"]): r["count"] for r in summary["spans"]}
    assert counts == {
        (DRAFTER, "drafter.draft"): 2,
        (DRAFTER, "drafter.rollback"): 2,
        (DRAFTER, "drafter.step"): 8,
        (GATEWAY, "gateway.tokenize"): 1,
        (GATEWAY, "specd.request"): 2,
        (GATEWAY, "specd.round"): 4,
        (VERIFIER, "verifier.forward"): 3,
        (VERIFIER, "verifier.rejection_sampling"): 3,
        (VERIFIER, "verifier.verify"): 3,
    }
    forward = next(r for r in summary["spans"] if r["name"] == "verifier.forward")
    assert forward["p50_ms"] == pytest.approx(4.0)  # durations 3, 7, 4
    assert forward["p95_ms"] == pytest.approx(6.7)
    steps = next(r for r in summary["spans"] if r["name"] == "drafter.step")
    assert steps["p50_ms"] == pytest.approx(1.125)  # four of 0.75 ms, four of 1.5 ms


def test_round_phases(summary: dict[str, Any]) -> None:
    rounds = summary["rounds"]
    assert rounds["count"] == 3
    assert rounds["span_count"] == 4
    # Percentiles are over the four spans: round_ms 6, 10, 20, 20.
    assert rounds["phases"]["round_ms"]["p50_ms"] == pytest.approx(15.0)
    assert rounds["phases"]["round_ms"]["p99_ms"] == pytest.approx(20.0)
    assert rounds["phases"]["verify_ms"]["p50_ms"] == pytest.approx(7.5)
    assert rounds["phases"]["overhead_ms"]["p50_ms"] == pytest.approx(3.0)
    assert rounds["phases"]["draft_ms"]["p50_ms"] == pytest.approx(6.0)
    # Distinct rounds: forwards (3+4) + (6+8) + (0+4) = 25 of 10 + 20 + 6 = 36 ms.
    assert rounds["outside_models_share"] == pytest.approx(11 / 36)


def test_acceptance(summary: dict[str, Any]) -> None:
    acc = summary["acceptance"]
    # Speculative spans (k, accepted): (4, 3), (4, 1), (2, 2); one target-only span.
    assert acc["speculative_spans"] == 3
    assert acc["target_only_spans"] == 1
    assert acc["rate"] == pytest.approx(6 / 10)
    assert acc["mean_acceptance_length"] == pytest.approx(3.0)
    assert [(p["position"], p["drafted"], p["accepted"]) for p in acc["per_position"]] == [
        (0, 3, 3),
        (1, 3, 2),
        (2, 2, 1),
        (3, 2, 0),
    ]
    assert [p["rate"] for p in acc["per_position"]] == pytest.approx([1.0, 2 / 3, 0.5, 0.0])


def test_requests(summary: dict[str, Any]) -> None:
    req = summary["requests"]
    assert req["count"] == 2
    assert req["ttft_ms"]["p50"] == pytest.approx(21.0)
    assert req["ttft_ms"]["p95"] == pytest.approx(29.1)
    assert req["tpot_ms"]["p50"] == pytest.approx(6.0)
    assert req["finish_reasons"] == {"length": 1, "stop": 1}


def test_slowest_rounds(trace_file: Path) -> None:
    slowest = summarise(load_spans([trace_file]), slowest=2)["slowest_rounds"]
    assert [r["round_id"] for r in slowest] == [2, 1]
    top = slowest[0]
    assert top["trace_ids"] == [TRACE_A, TRACE_B]
    assert top["batch_size"] == 2
    assert top["round_ms"] == 20.0
    assert top["verifier_forward_ms"] == 8.0
    assert slowest[1]["trace_ids"] == [TRACE_A]


def test_otlp_gives_same_summary(tmp_path: Path, trace_file: Path, summary: dict[str, Any]) -> None:
    records = synthetic_trace()
    per_line = write_jsonl(tmp_path / "otlp.jsonl", [otlp_request(records[:9]), otlp_request(records[9:])])
    pretty = tmp_path / "otlp.json"
    pretty.write_text(json.dumps(otlp_request(records), indent=2))
    native = load_spans([trace_file])
    for path in (per_line, pretty):
        spans = load_spans([path])
        assert sorted(spans, key=lambda s: s.span_id) == sorted(native, key=lambda s: s.span_id)
        assert summarise(spans) == summary
    round3 = next(s for s in load_spans([pretty]) if s.attributes.get("specd.round_id") == 3)
    assert round3.attributes["note"] == ["target", "only"]
    assert round3.attributes["flag"] is True


def test_same_span_in_two_files_counts_once(tmp_path: Path, trace_file: Path) -> None:
    otlp = write_jsonl(tmp_path / "otlp.jsonl", [otlp_request(synthetic_trace())])
    assert len(load_spans([trace_file, otlp])) == len(synthetic_trace())


def test_render_text(summary: dict[str, Any]) -> None:
    text = render_text(summary)
    assert "verifier.rejection_sampling" in text
    assert "share of round time outside the two models: 30.6%" in text
    assert "acceptance rate: 60.0% (6/10 draft tokens)" in text
    assert f"{TRACE_A},{TRACE_B}" in text


def test_main_json(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(trace_file), "--format", "json", "--slowest", "1"])
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"spans", "rounds", "overlap", "acceptance", "requests", "slowest_rounds"}
    assert len(out["slowest_rounds"]) == 1
    assert out["acceptance"]["mean_acceptance_length"] == pytest.approx(3.0)


def test_main_text(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(trace_file)])
    out = capsys.readouterr().out
    assert out.startswith("Spans: 28")
    assert "Slowest rounds: 3" in out


def test_empty_and_roundless_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    main([str(empty)])
    out = capsys.readouterr().out
    assert "(no spans)" in out and "(no specd.round spans)" in out and "(no specd.request spans)" in out
    drafter_only = write_jsonl(tmp_path / "drafter.jsonl", [s for s in synthetic_trace() if s["service"] == DRAFTER])
    main([str(drafter_only), "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"]["count"] == 0
    assert out["rounds"]["outside_models_share"] is None
    assert out["acceptance"]["rate"] is None
    assert out["slowest_rounds"] == []
    assert sum(r["count"] for r in out["spans"]) == 12


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"hello": 1}', "neither a specd span"),
        ('{"trace_id": "x", "span_id": "y"}', "name"),
    ],
)
def test_malformed_line_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad_line: str, message: str
) -> None:
    good = json.dumps(synthetic_trace()[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")
    with pytest.raises(SystemExit) as exc:
        main([str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}:3:" in err
    assert message in err


def test_malformed_pretty_document_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps(otlp_request(synthetic_trace()[:2]), indent=2).splitlines()
    text[5] += ","  # a trailing comma on line 6
    path = tmp_path / "bad.json"
    path.write_text("\n".join(text))
    with pytest.raises(SystemExit) as exc:
        main([str(path)])
    assert exc.value.code == 2
    assert f"{path}:6: invalid JSON" in capsys.readouterr().err


def test_truncated_first_line_names_line_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = json.dumps(synthetic_trace()[0])
    path = tmp_path / "cut.jsonl"
    path.write_text(f"{good[:40]}\n{good}\n")
    with pytest.raises(SystemExit):
        main([str(path)])
    assert f"{path}:1: invalid JSON" in capsys.readouterr().err


def test_otlp_base64_ids_and_status_names(tmp_path: Path) -> None:
    span = otlp_span(synthetic_trace()[0])
    span["traceId"] = base64.b64encode(bytes.fromhex(TRACE_A)).decode()
    span["spanId"] = base64.b64encode(bytes.fromhex("00000000000000ff")).decode()
    span["status"] = {"code": "STATUS_CODE_ERROR"}
    request = {"resourceSpans": [{"resource": {"attributes": otlp_attrs({"service.name": GATEWAY})},
                                  "scopeSpans": [{"spans": [span]}]}]}  # fmt: skip
    (loaded,) = load_spans([write_jsonl(tmp_path / "b64.jsonl", [request])])
    assert (loaded.trace_id, loaded.span_id, loaded.status) == (TRACE_A, "00000000000000ff", "ERROR")


def test_overlap_share_counts_time_both_models_were_busy() -> None:
    from specd.tools.traces import Span

    def span(name: str, start_ms: int, end_ms: int) -> Span:
        return Span("t", f"{name}{start_ms}", None, name, "svc", start_ms * 10**6, end_ms * 10**6)

    # drafter busy 0-10 and 20-30, verifier 5-25: overlap 5-10 and 20-25 = 10 of 30 ms.
    spans = [span("drafter.draft", 0, 10), span("drafter.draft", 20, 30), span("verifier.verify", 5, 25)]
    overlap = summarise(spans)["overlap"]
    assert overlap["wall_ms"] == 30
    assert overlap["overlap_share"] == pytest.approx(10 / 30)
    assert overlap["drafter_busy_share"] == pytest.approx(20 / 30)
    assert overlap["verifier_busy_share"] == pytest.approx(20 / 30)
    sequential = [span("drafter.draft", 0, 10), span("verifier.verify", 10, 20)]
    assert summarise(sequential)["overlap"]["overlap_share"] == 0


def test_a_round_adds_up_and_counts_the_drafter_beside_the_verify() -> None:
    # A draft-ahead round whose drafter prefilled a chunk beside the verify, longer than the
    # verifier's forward, then opened a joining sequence: 2 + 9 + 1.5 + 0.5 = 13 ms.
    times = RoundTimes(
        round_ns=13 * MS,
        draft_ns=2 * MS,
        verify_ns=9 * MS,
        join_ns=int(1.5 * MS),
        drafter_ns=int(1.5 * MS),
        verifier_ns=4 * MS,
        drafter_forward_ns=1 * MS,
        verifier_forward_ns=3 * MS,
        overlap_ns=8 * MS,
        overlap_forward_ns=7 * MS,
    )
    attrs = times.attributes(batch_size=1)
    parts = ("specd.draft_ms", "specd.verify_ms", "specd.join_ms", "specd.outside_ms")
    assert sum(attrs[k] for k in parts) == pytest.approx(attrs["specd.round_ms"]) and attrs["specd.outside_ms"] == 0.5
    # The verify waited for the drafter's 7 ms beside it, not the verifier's 3.
    assert attrs["specd.forwards_ms"] == pytest.approx(8.0)
    b = Builder()
    request = b.add(TRACE_A, "specd.request", GATEWAY, 0, 20)
    b.add(TRACE_A, "specd.round", GATEWAY, 1, 13, parent=request, **{k[6:]: v for k, v in attrs.items()}, round_id=9)
    rounds = summarise(load_spans_from(b.spans))["rounds"]
    # Outside the forwards on its path (8 ms) and its join (1.5 ms): 3.5 of 13 ms.
    assert rounds["outside_models_share"] == pytest.approx(3.5 / 13)
    assert rounds["phases"]["outside_ms"]["p50_ms"] == pytest.approx(0.5)


def load_spans_from(records: list[dict[str, Any]]) -> list[Any]:
    return parse_text("\n".join(json.dumps(r) for r in records))
