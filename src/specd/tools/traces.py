"""`specd traces`: summarise span files per service, per round phase and per acceptance position.

Reads specd's own ``--trace-file`` JSON lines (one span per line) and OpenTelemetry
OTLP JSON (a collector file exporter's one ``ExportTraceServiceRequest`` per line, or
one pretty-printed document), auto-detected per line, and reports:

* per service and span name: count and p50/p95/p99 duration;
* round phases from the gateway's ``specd.round`` spans, and the share of round time
  spent outside the two models' forward passes on the round's path (the drafter's beside the
  verify counted) and outside its joins;
* overlap: the share of wall time the drafter and the verifier were busy at once;
* acceptance: rate, mean acceptance length and per-position acceptance;
* requests: TTFT/TPOT percentiles and finish reasons;
* the slowest rounds with the trace ids of the requests batched into them.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REQUEST_SPAN = "specd.request"
ROUND_SPAN = "specd.round"
DRAFT_SPAN = "drafter.draft"
VERIFY_SPAN = "verifier.verify"
PHASES = (
    "round_ms",
    "draft_ms",
    "verify_ms",
    "drafter_ms",
    "verifier_ms",
    "drafter_forward_ms",
    "verifier_forward_ms",
    "overhead_ms",
    "join_ms",
    "outside_ms",
    "overlap_forward_ms",
    "forwards_ms",
)
SPAN_QUANTILES = (50, 95, 99)
REQUEST_QUANTILES = (50, 95)
OTLP_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
# Other signals a shared collector file exporter may write into the same file: no spans in them.
OTLP_OTHER_SIGNALS = ("resourceMetrics", "resourceLogs", "resourceProfiles")


class TraceFormatError(ValueError):
    """A trace file line (or document) that is neither a specd span nor OTLP JSON."""


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: list[dict[str, Any]] = field(default_factory=list)
    status: str = "UNSET"

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


# ---------------------------------------------------------------- loading


def _parent(value: Any) -> str | None:
    return str(value) if value else None


def _specd_span(obj: dict[str, Any]) -> Span:
    return Span(
        trace_id=str(obj["trace_id"]),
        span_id=str(obj["span_id"]),
        parent_span_id=_parent(obj.get("parent_span_id")),
        name=str(obj["name"]),
        service=str(obj.get("service") or "unknown"),
        start_ns=int(obj["start_ns"]),
        end_ns=int(obj["end_ns"]),
        attributes=dict(obj.get("attributes") or {}),
        links=[
            {
                "trace_id": str(link["trace_id"]),
                "span_id": str(link["span_id"]),
                "attributes": dict(link.get("attributes") or {}),
            }
            for link in obj.get("links") or []
        ],
        status=str(obj.get("status") or "UNSET"),
    )


def _otlp_id(value: Any, nbytes: int) -> str:
    """OTLP JSON ids are hex per the spec; plain protobuf JSON writes them as base64."""
    text = str(value or "")
    if not text:
        return ""
    if len(text) == 2 * nbytes and all(c in "0123456789abcdefABCDEF" for c in text):
        return text.lower()
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return text
    return raw.hex() if len(raw) == nbytes else text


def _otlp_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return str(value["stringValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        flag = value["boolValue"]
        return flag.lower() == "true" if isinstance(flag, str) else bool(flag)
    if "arrayValue" in value:
        return [_otlp_value(v) for v in (value["arrayValue"] or {}).get("values") or []]
    if "kvlistValue" in value:
        return _otlp_attrs((value["kvlistValue"] or {}).get("values"))
    if "bytesValue" in value:
        return str(value["bytesValue"])
    return None


def _otlp_attrs(attrs: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {str(kv["key"]): _otlp_value(kv.get("value") or {}) for kv in attrs or []}


def _otlp_status(status: dict[str, Any] | None) -> str:
    code = (status or {}).get("code", 0)
    if isinstance(code, str) and not code.isdigit():
        return code.removeprefix("STATUS_CODE_")  # protojson writes enum names
    return OTLP_STATUS.get(int(code), "UNSET")


def _otlp_span(span: dict[str, Any], service: str) -> Span:
    return Span(
        trace_id=_otlp_id(span["traceId"], 16),
        span_id=_otlp_id(span["spanId"], 8),
        parent_span_id=_otlp_id(span.get("parentSpanId"), 8) or None,
        name=str(span["name"]),
        service=service,
        start_ns=int(span["startTimeUnixNano"]),
        end_ns=int(span["endTimeUnixNano"]),
        attributes=_otlp_attrs(span.get("attributes")),
        links=[
            {
                "trace_id": _otlp_id(link["traceId"], 16),
                "span_id": _otlp_id(link["spanId"], 8),
                "attributes": _otlp_attrs(link.get("attributes")),
            }
            for link in span.get("links") or []
        ],
        status=_otlp_status(span.get("status")),
    )


def _otlp_spans(request: dict[str, Any]) -> Iterator[Span]:
    for resource_spans in request.get("resourceSpans") or []:
        resource = _otlp_attrs((resource_spans.get("resource") or {}).get("attributes"))
        service = str(resource.get("service.name") or "unknown")
        scopes = resource_spans.get("scopeSpans") or resource_spans.get("instrumentationLibrarySpans") or []
        for scope in scopes:
            for span in scope.get("spans") or []:
                yield _otlp_span(span, service)


def _spans_from_record(obj: Any) -> list[Span]:
    if isinstance(obj, list):
        return [span for item in obj for span in _spans_from_record(item)]
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "resourceSpans" in obj:
        return list(_otlp_spans(obj))
    if "trace_id" in obj and "span_id" in obj:
        return [_specd_span(obj)]
    if any(key in obj for key in OTLP_OTHER_SIGNALS):
        return []
    raise ValueError("neither a specd span (trace_id, span_id, ...) nor an OTLP request (resourceSpans)")


def _describe(exc: Exception) -> str:
    if isinstance(exc, KeyError):
        return f"missing field {exc.args[0]!r}"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc.msg}, column {exc.colno})"
    return f"malformed span ({exc})"


def _parse_record(obj: Any, where: str) -> list[Span]:
    try:
        return _spans_from_record(obj)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceFormatError(f"{where}: {_describe(exc)}") from exc


def _parse_lines(text: str, name: str) -> list[Span]:
    spans: list[Span] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{name}:{lineno}: {_describe(exc)}") from exc
        spans.extend(_parse_record(obj, f"{name}:{lineno}"))
    return spans


def _is_document(text: str) -> bool:
    """A pretty-printed document opens an object or array on its first line; a JSON line closes it."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first.endswith(("{", "["))


def parse_text(text: str, name: str = "<input>") -> list[Span]:
    """Spans from one file's text: JSON lines, or a single (pretty-printed) JSON document."""
    if not text.strip():
        return []
    if not _is_document(text):
        return _parse_lines(text, name)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{name}:{exc.lineno}: {_describe(exc)}") from exc
    return _parse_record(document, f"{name} (document)")


def _read(path: str | Path) -> tuple[str, str]:
    if str(path) == "-":
        return sys.stdin.read(), "<stdin>"
    return Path(path).read_text(encoding="utf-8"), str(path)


def load_spans(paths: Iterable[str | Path]) -> list[Span]:
    """All spans of all files, in file order; a span seen twice (same trace and span id) is kept once."""
    spans: list[Span] = []
    seen: set[tuple[str, str]] = set()
    for path in paths:
        text, name = _read(path)
        for span in parse_text(text, name):
            key = (span.trace_id, span.span_id)
            if key not in seen:
                seen.add(key)
                spans.append(span)
    return spans


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _quantiles(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    return {f"p{q}": (percentile(values, q) if values else None) for q in qs}


def _number(span: Span, key: str) -> float | None:
    value = span.attributes.get(f"specd.{key}")
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def _int(span: Span, key: str) -> int:
    value = _number(span, key)
    return int(value) if value is not None else 0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _span_table(spans: Sequence[Span]) -> list[dict[str, Any]]:
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    for span in spans:
        durations[(span.service, span.name)].append(span.duration_ms)
    return [
        {"service": service, "name": name, "count": len(values), **_ms_quantiles(values, SPAN_QUANTILES)}
        for (service, name), values in sorted(durations.items())
    ]


def _ms_quantiles(values: Sequence[float], qs: Sequence[int]) -> dict[str, float | None]:
    return {f"{key}_ms": value for key, value in _quantiles(values, qs).items()}


def _round_key(span: Span) -> Any:
    round_id = span.attributes.get("specd.round_id")
    return span.span_id if round_id is None else round_id


def _group_rounds(round_spans: Sequence[Span]) -> dict[Any, list[Span]]:
    groups: dict[Any, list[Span]] = {}
    for span in round_spans:
        groups.setdefault(_round_key(span), []).append(span)
    return groups


def _rounds(round_spans: Sequence[Span], groups: dict[Any, list[Span]]) -> dict[str, Any]:
    phases = {}
    for phase in PHASES:
        values = [v for v in (_number(s, phase) for s in round_spans) if v is not None]
        phases[phase] = _ms_quantiles(values, SPAN_QUANTILES)
    firsts = [group[0] for group in groups.values()]
    round_total = sum(_number(s, "round_ms") or 0.0 for s in firsts)
    share = _ratio(sum(_in_models(s) for s in firsts), round_total)
    return {
        "count": len(groups),
        "span_count": len(round_spans),
        "phases": phases,
        "outside_models_share": None if share is None else 1.0 - share,
    }


def _in_models(span: Span) -> float:
    """A round's time in the models' forwards on its path, and in its joins (the drafter's Opens,
    which report no forward time of their own): gateway.metrics.RoundTimes.forwards_ns where the
    span has it, else (older gateways) the two exchanges' forwards."""
    forwards = _number(span, "forwards_ms")
    if forwards is None:
        forwards = (_number(span, "drafter_forward_ms") or 0.0) + (_number(span, "verifier_forward_ms") or 0.0)
    return forwards + (_number(span, "join_ms") or 0.0)


def _acceptance(round_spans: Sequence[Span]) -> dict[str, Any]:
    pairs = [(_int(s, "k"), _int(s, "accepted")) for s in round_spans]
    drafted = [(k, acc) for k, acc in pairs if k > 0]
    total_k = sum(k for k, _ in drafted)
    total_accepted = sum(acc for _, acc in drafted)
    positions = []
    for i in range(max((k for k, _ in drafted), default=0)):
        offered = sum(1 for k, _ in drafted if k > i)
        accepted = sum(1 for _, acc in drafted if acc > i)
        positions.append({"position": i, "drafted": offered, "accepted": accepted, "rate": _ratio(accepted, offered)})
    mean_length = None if not drafted else 1.0 + total_accepted / len(drafted)
    return {
        "speculative_spans": len(drafted),
        "target_only_spans": len(pairs) - len(drafted),
        "draft_tokens": total_k,
        "accepted_tokens": total_accepted,
        "rate": _ratio(total_accepted, total_k),
        "mean_acceptance_length": mean_length,
        "per_position": positions,
    }


def _requests(request_spans: Sequence[Span]) -> dict[str, Any]:
    def values(key: str) -> list[float]:
        return [v for v in (_number(s, key) for s in request_spans) if v is not None]

    reasons = Counter(str(s.attributes.get("specd.finish_reason") or "unknown") for s in request_spans)
    return {
        "count": len(request_spans),
        "ttft_ms": _quantiles(values("ttft_ms"), REQUEST_QUANTILES),
        "tpot_ms": _quantiles(values("tpot_ms"), REQUEST_QUANTILES),
        "finish_reasons": dict(sorted(reasons.items(), key=lambda item: (-item[1], item[0]))),
    }


def _slowest(groups: dict[Any, list[Span]], n: int) -> list[dict[str, Any]]:
    def round_ms(group: list[Span]) -> float:
        return _number(group[0], "round_ms") or 0.0

    ordered = sorted(groups.items(), key=lambda item: -round_ms(item[1]))[: max(n, 0)]
    rows = []
    for key, group in ordered:
        first = group[0]
        batch = _number(first, "batch_size")
        rows.append(
            {
                "round_id": first.attributes.get("specd.round_id", key),
                "trace_ids": list(dict.fromkeys(s.trace_id for s in group)),
                "batch_size": int(batch) if batch is not None else len(group),
                **{phase: _number(first, phase) for phase in PHASES},
            }
        )
    return rows


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _overlap(spans: Sequence[Span]) -> dict[str, Any]:
    """How much of the wall time the drafter and the verifier worked at the same time.

    Busy means inside a drafter.draft or verifier.verify span (the services' own clocks:
    compare only spans from one host, or hosts with synchronised clocks).
    """
    drafter = _union((s.start_ns, s.end_ns) for s in spans if s.name == DRAFT_SPAN)
    verifier = _union((s.start_ns, s.end_ns) for s in spans if s.name == VERIFY_SPAN)
    if not drafter or not verifier:
        return {"wall_ms": None, "overlap_share": None, "drafter_busy_share": None, "verifier_busy_share": None}
    wall = max(drafter[-1][1], verifier[-1][1]) - min(drafter[0][0], verifier[0][0])

    def busy(merged: list[tuple[int, int]]) -> int:
        return sum(end - start for start, end in merged)

    return {
        "wall_ms": wall / 1e6,
        "overlap_share": _ratio(_intersection_ns(drafter, verifier), wall),
        "drafter_busy_share": _ratio(busy(drafter), wall),
        "verifier_busy_share": _ratio(busy(verifier), wall),
    }


def summarise(spans: Sequence[Span], slowest: int = 5) -> dict[str, Any]:
    """Every figure `specd traces` reports, as plain JSON-serialisable data."""
    round_spans = [s for s in spans if s.name == ROUND_SPAN]
    groups = _group_rounds(round_spans)
    return {
        "spans": _span_table(spans),
        "rounds": _rounds(round_spans, groups),
        "overlap": _overlap(spans),
        "acceptance": _acceptance(round_spans),
        "requests": _requests([s for s in spans if s.name == REQUEST_SPAN]),
        "slowest_rounds": _slowest(groups, slowest),
    }


# ---------------------------------------------------------------- rendering


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Aligned columns, indented two spaces; `align` has one "l" or "r" per column."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align, strict=True)]
        return "  ".join(parts).rstrip()

    return ["  " + line(headers), *("  " + line(row) for row in rows)]


def _render_spans(summary: dict[str, Any]) -> list[str]:
    rows = summary["spans"]
    out = [f"Spans: {sum(r['count'] for r in rows)}"]
    if not rows:
        return [*out, "  (no spans)"]
    cells = [[r["service"], r["name"], str(r["count"]), *(_fmt(r[f"p{q}_ms"]) for q in SPAN_QUANTILES)] for r in rows]
    return out + _table(["service", "span", "count", "p50 ms", "p95 ms", "p99 ms"], cells, "llrrrr")


def _render_rounds(summary: dict[str, Any]) -> list[str]:
    rounds = summary["rounds"]
    out = [f"Rounds: {rounds['count']} ({rounds['span_count']} specd.round spans)"]
    if not rounds["span_count"]:
        return [*out, "  (no specd.round spans)"]
    cells = [[phase, *(_fmt(q) for q in rounds["phases"][phase].values())] for phase in PHASES]
    out += _table(["phase", "p50 ms", "p95 ms", "p99 ms"], cells, "lrrr")
    overlap = summary["overlap"]
    return [
        *out,
        f"  share of round time outside the two models: {_pct(rounds['outside_models_share'])}",
        f"  wall time both models were busy (overlap): {_pct(overlap['overlap_share'])}"
        f" (drafter busy {_pct(overlap['drafter_busy_share'])}, verifier busy {_pct(overlap['verifier_busy_share'])})",
    ]


def _render_acceptance(summary: dict[str, Any]) -> list[str]:
    acc = summary["acceptance"]
    out = [f"Acceptance: {acc['speculative_spans']} speculative, {acc['target_only_spans']} target-only round spans"]
    if not acc["speculative_spans"]:
        return [*out, "  (no drafted tokens)"]
    out.append(f"  acceptance rate: {_pct(acc['rate'])} ({acc['accepted_tokens']}/{acc['draft_tokens']} draft tokens)")
    out.append(f"  mean acceptance length: {_fmt(acc['mean_acceptance_length'])} tokens per sequence-round")
    cells = [[str(p["position"]), str(p["drafted"]), str(p["accepted"]), _pct(p["rate"])] for p in acc["per_position"]]
    return out + _table(["position", "drafted", "accepted", "rate"], cells, "rrrr")


def _render_requests(summary: dict[str, Any]) -> list[str]:
    req = summary["requests"]
    out = [f"Requests: {req['count']}"]
    if not req["count"]:
        return [*out, "  (no specd.request spans)"]
    cells = [[metric, *(_fmt(v) for v in req[f"{metric}_ms"].values())] for metric in ("ttft", "tpot")]
    out += _table(["metric", "p50 ms", "p95 ms"], cells, "lrr")
    reasons = ", ".join(f"{reason}={count}" for reason, count in req["finish_reasons"].items())
    return [*out, f"  finish reasons: {reasons}"]


def _render_slowest(summary: dict[str, Any]) -> list[str]:
    rows = summary["slowest_rounds"]
    out = [f"Slowest rounds: {len(rows)}"]
    if not rows:
        return [*out, "  (no rounds)"]
    headers = ["round_id", "batch", *PHASES, "trace ids"]
    cells = [
        [str(r["round_id"]), str(r["batch_size"]), *(_fmt(r[p]) for p in PHASES), ",".join(r["trace_ids"])]
        for r in rows
    ]
    return out + _table(headers, cells, "r" * (len(headers) - 1) + "l")


def render_text(summary: dict[str, Any]) -> str:
    sections = [_render_spans, _render_rounds, _render_acceptance, _render_requests, _render_slowest]
    return "\n\n".join("\n".join(render(summary)) for render in sections) + "\n"


# ---------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specd traces",
        description="Summarise specd --trace-file JSON lines or OTLP JSON: per service, round phase and acceptance.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="trace files ('-' reads stdin)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.add_argument("--slowest", type=int, default=5, metavar="N", help="how many of the slowest rounds to list")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        spans = load_spans(args.files)
    except TraceFormatError as exc:
        print(f"specd traces: {exc}", file=sys.stderr)
        sys.exit(2)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"specd traces: cannot read trace file: {exc}", file=sys.stderr)
        sys.exit(2)
    summary = summarise(spans, slowest=args.slowest)
    if args.format == "json":
        print(json.dumps(summary, indent=2))
    else:
        print(render_text(summary), end="")


if __name__ == "__main__":
    main()
