"""The arithmetic behind `specd bench`'s figures."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics, RoundTimes
from specd.tools.bench import (
    add_bounds,
    add_deltas,
    block_order,
    block_speedups,
    compare_outputs,
    mode_extra,
    parse_args,
    split_blocks,
)
from specd.tools.benchreport import format_table
from specd.tools.benchstats import (
    RequestResult,
    acceptance,
    drafted_again,
    histogram_mean,
    round_costs,
    serial_schedule,
    serial_wall_s,
    speedup_bound,
    summarize,
)
from specd.tools.traces import percentile


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert math.isnan(percentile([], 50))


def test_acceptance_from_counter_deltas():
    before = {"specd_spec_decode_num_drafts_total": 2.0}
    after = {
        "specd_spec_decode_num_drafts_total": 12.0,
        "specd_spec_decode_num_draft_tokens_total": 40.0,
        "specd_spec_decode_num_accepted_tokens_total": 30.0,
        "specd_spec_decode_num_accepted_tokens_per_pos_total|position=0": 9.0,
        "specd_spec_decode_num_accepted_tokens_per_pos_total|position=1": 8.0,
    }
    result = acceptance(before, after)
    assert result["acceptance_rate"] == pytest.approx(0.75)
    assert result["mean_acceptance_length"] == pytest.approx(4.0)
    assert result["per_position_acceptance"] == [pytest.approx(0.9), pytest.approx(0.8)]
    assert result["drafts"] == 10
    assert acceptance({}, {}) == {}


def test_histogram_mean_between_scrapes():
    before = {"h_sum|phase=verify": 1.0, "h_count|phase=verify": 2.0}
    after = {"h_sum|phase=verify": 4.0, "h_count|phase=verify": 8.0}
    assert histogram_mean(before, after, "h", "|phase=verify") == pytest.approx(0.5)
    assert math.isnan(histogram_mean(before, before, "h", "|phase=verify"))


def test_summarize_throughput_and_latency():
    results = [
        RequestResult(ttft_s=0.1, e2e_s=1.1, completion_tokens=11, chunk_gaps_s=[0.1] * 10),
        RequestResult(ttft_s=0.3, e2e_s=2.3, completion_tokens=21, chunk_gaps_s=[0.2] * 10),
    ]
    s = summarize(results, wall_s=2.5)
    assert s["output_tokens"] == 32
    assert s["output_tokens_per_s"] == pytest.approx(32 / 2.5)
    assert s["output_tokens_per_s_per_user"] == pytest.approx((11 / 1.1 + 21 / 2.3) / 2)
    assert s["tpot_ms_p50"] == pytest.approx(100.0)  # both requests: 0.1 s per token after the first
    assert s["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["itl_ms_p95"] == pytest.approx(200.0)
    assert s["e2e_ms_p99"] == pytest.approx(1000 * (1.1 + 0.99 * 1.2))


def test_serial_schedule_queues_closed_loop_clients():
    solo = [RequestResult(0.1, 1.0, 10), RequestResult(0.2, 2.0, 10), RequestResult(0.1, 1.0, 10)]
    one = serial_schedule(solo, 1)  # one client: no waiting at all
    assert [r.e2e_s for r in one] == [1.0, 2.0, 1.0]
    two = serial_schedule(solo, 2)
    # Request 1 waits for request 0 (1 s); request 2 is sent when request 0 ends (t=1) and starts at t=3.
    assert [r.ttft_s for r in two] == pytest.approx([0.1, 1.2, 2.1])
    assert [r.e2e_s for r in two] == pytest.approx([1.0, 3.0, 3.0])
    assert serial_wall_s(solo) == 4.0


def test_speedup_bound_from_model_costs():
    bound = speedup_bound(alpha=0.8, k=4, draft_step_ms=2.0, verify_ms=44.0, target_step_ms=40.0)
    assert bound["c"] == pytest.approx(0.05)
    assert bound["verify_ratio"] == pytest.approx(1.1)
    assert bound["bound"] == pytest.approx(3.3616 / (4 * 0.05 + 1.1))
    assert speedup_bound(0.8, 0, 1, 1, 1) == {}


@pytest.mark.parametrize("mode", ["fixed", "sequential"])
def test_add_bounds_uses_single_stream_costs(mode):
    target = {"mode": "target", "concurrency": 1, "output_tokens_per_s": 25.0, "round_verifier_forward_ms": 40.0}
    fixed = {
        "mode": mode,
        "concurrency": 1,
        "output_tokens_per_s": 50.0,
        "acceptance_rate": 0.8,
        "drafts": 10.0,
        "draft_tokens": 40.0,
        "rounds": 12.0,  # two requests' first rounds are target-only
        # Means over all 12 rounds: 10 verifies of 5 tokens at 44 ms and 2 target steps at 40 ms.
        "round_verifier_forward_ms": (10 * 44.0 + 2 * 40.0) / 12,
        "round_drafter_forward_ms": 40 * 2.0 / 12,  # 40 draft steps of 2 ms
    }
    hf = {"mode": "hf", "concurrency": 1, "output_tokens_per_s": 40.0}
    rows = [target, fixed, hf]
    add_bounds(rows, k=4)
    assert fixed["speedup_vs_target"] == pytest.approx(2.0)
    assert fixed["speedup_vs_hf"] == pytest.approx(1.25)
    assert fixed["bound_c"] == pytest.approx(0.05)
    assert fixed["bound_verify_ratio"] == pytest.approx(1.1)
    assert fixed["efficiency_vs_bound"] == pytest.approx(2.0 / (3.3616 / 1.3))
    assert "x" in format_table(rows)


def test_add_bounds_leaves_overlapped_pipelines_unbounded():
    target = {"mode": "target", "concurrency": 1, "output_tokens_per_s": 25.0, "round_verifier_forward_ms": 40.0}
    common = {"concurrency": 1, "output_tokens_per_s": 30.0, "acceptance_rate": 0.8, "drafts": 10.0}
    costs = {"draft_tokens": 40.0, "rounds": 12.0, "round_verifier_forward_ms": 44.0, "round_drafter_forward_ms": 7.0}
    rows = [target, *({"mode": mode, **common, **costs} for mode in ("ahead", "cohort", "auto"))]
    add_bounds(rows, k=4)
    assert all("efficiency_vs_bound" not in row and "speedup_vs_target" in row for row in rows[1:])


def test_rows_of_another_server_take_its_own_target_and_the_same_mode_on_the_base():
    def row(mode: str, rate: float, blocks: list[float]) -> dict:
        walls = [{"output_tokens": 10, "wall_s": 10 / b} for b in blocks]
        return {"mode": mode, "concurrency": 8, "output_tokens_per_s": rate, "blocks": walls}

    rows = [
        row("target", 10.0, [10.0, 10.0]),
        row("auto", 20.0, [20.0, 20.0]),
        row("target@b", 12.0, [12.0, 12.0]),
        row("auto@b", 18.0, [16.0, 20.0]),
        row("fixed@c", 15.0, [15.0, 15.0]),  # no target@c, no fixed on the base
    ]
    add_bounds(rows, k=4)
    by = {r["mode"]: r for r in rows}
    assert by["auto@b"]["speedup_vs_target"] == pytest.approx(18.0 / 12.0)
    assert by["auto@b"]["vs_base"] == pytest.approx(0.9)
    assert by["auto@b"]["vs_base_min"] == pytest.approx(0.8) and by["auto@b"]["vs_base_max"] == pytest.approx(1.0)
    assert by["fixed@c"]["speedup_vs_target"] == pytest.approx(1.5) and "vs_base" not in by["fixed@c"]
    assert "vs_base" not in by["auto"] and "0.90x" in format_table(rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "auto@b"], "no --server named 'b'"),
        (["--server", "b", "--modes", "auto"], "NAME=URL"),
        (["--server", "b=http://x", "--modes", "hf@b"], "HTTP modes only"),
        (["--server", "b=http://x", "--modes", "nope@b"], "unknown mode"),
    ],
)
def test_bad_server_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_server_url_may_carry_an_openai_base_url_s_v1():
    args = parse_args(["--base-url", "http://a:8000/v1/", "--server", "b=http://b:8100/v1", "--modes", "auto,auto@b"])
    assert args.servers == {"": "http://a:8000", "b": "http://b:8100"}
    assert parse_args(["--base-url", "http://a:8000/"]).servers == {"": "http://a:8000"}


def test_modes_map_to_the_request_extension():
    assert mode_extra("target", 4) == {"num_speculative_tokens": 0}
    assert mode_extra("fixed", 4) == {"num_speculative_tokens": 4}
    assert mode_extra("auto", 4) == {"num_speculative_tokens": "auto"}
    assert mode_extra("server", 4) == {}
    assert mode_extra("ahead", 3) == {"num_speculative_tokens": 3, "pipeline": "ahead"}
    assert mode_extra("auto-pipeline", 3) == {"num_speculative_tokens": "auto", "pipeline": "auto"}
    tree = {"num_speculative_tokens": 3, "pipeline": "sequential", "speculative_siblings": 2}
    assert mode_extra("tree", 3, 2) == tree
    fanout = {"num_speculative_tokens": 3, "pipeline": "ahead", "speculative_branches": 1}
    assert mode_extra("fanout", 3, branches=1) == fanout
    assert mode_extra("fanout", 4)["speculative_branches"] == 2


def test_compare_outputs_counts_differences_from_target():
    def texts(*t):
        return [RequestResult(0, 1, 1, [], x) for x in t]

    outputs = {("target", 1): texts("a", "b"), ("fixed", 1): texts("a", "b"), ("hf", 1): texts("a", "c")}
    assert compare_outputs(outputs) == {"fixed@1": 0, "hf@1": 1, "target@1": 0}


def test_round_costs_split_a_round_and_its_share_outside_the_models():
    after = {"specd_rounds_total": 10.0}
    phases = (("round", 2.0), ("draft", 1.0), ("verify", 0.9), ("overhead", 0.1), ("drafter_forward", 0.95))
    for phase, total_s in (*phases, ("forwards", 1.8), ("join", 0.0)):
        after[f"specd_round_latency_seconds_sum|phase={phase}"] = total_s
        after[f"specd_round_latency_seconds_count|phase={phase}"] = 10.0
    after["specd_round_latency_seconds_sum|phase=verifier_forward"] = 0.85
    after["specd_round_latency_seconds_count|phase=verifier_forward"] = 10.0
    after["specd_pipeline_rounds_total|pipeline=ahead"] = 7.0
    after["specd_pipeline_rounds_total|pipeline=sequential"] = 3.0
    costs = round_costs({"specd_pipeline_rounds_total|pipeline=ahead": 2.0}, after)
    assert (costs["rounds_ahead"], costs["rounds_sequential"]) == (5, 3)
    assert costs["round_draft_ms"] == pytest.approx(100.0)
    assert costs["round_outside_models"] == pytest.approx(1 - 180 / 200)
    assert costs["rounds"] == 10


def test_round_costs_add_up_from_the_gateways_metrics():
    # Two rounds through the gateway's own metrics: a sequential one and a draft-ahead one whose
    # drafter's prefill beside the verify outlasted the verifier's forward, then joined a sequence.
    metrics = GatewayMetrics(4)
    ms = 1_000_000
    metrics.observe_round([], 1, RoundTimes(10 * ms, 4 * ms, 5 * ms, 3 * ms, 4 * ms, 2 * ms, 3 * ms))
    ahead = RoundTimes(13 * ms, 2 * ms, 9 * ms, ms, 4 * ms, ms, 3 * ms, 8 * ms, 1_500_000, 0, 7 * ms)
    metrics.observe_round([], 1, ahead)
    after = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            after[sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()))] = sample.value
    costs = round_costs({}, after)
    parts = ("round_draft_ms", "round_verify_ms", "round_join_ms", "round_outside_ms")
    assert costs["round_round_ms"] == pytest.approx(11.5)
    assert sum(costs[k] for k in parts) == pytest.approx(costs["round_round_ms"])
    # Not draft + verify + overhead, which counts the time outside the services twice.
    assert costs["round_draft_ms"] + costs["round_verify_ms"] + costs["round_overhead_ms"] > 11.5
    # Forwards on the path: 2 + 3 = 5 ms, then 1 + max(3, 7) = 8 ms; the join's 1.5 ms apart.
    assert costs["round_forwards_ms"] == pytest.approx(6.5)
    assert costs["round_outside_forwards_ms"] == pytest.approx(11.5 - 6.5 - 0.75)
    assert costs["round_outside_models"] == pytest.approx(4.25 / 11.5)


def test_blocks_split_the_prompts_in_whole_waves():
    assert split_blocks(10, 1, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert split_blocks(16, 8, 4) == [range(0, 8), range(8, 16)]
    assert split_blocks(10, 8, 4) == [range(0, 10)]  # fewer prompts than two waves: one block
    assert split_blocks(10, 1, 1) == [range(0, 10)]
    for n, c, b in ((64, 32, 4), (7, 2, 3), (100, 1, 6)):
        blocks = split_blocks(n, c, b)
        assert [i for block in blocks for i in block] == list(range(n))
        assert min(len(block) for block in blocks) >= min(n, c)


def _drifting_run(modes, costs, blocks, drift):
    """Each mode's measured throughput on a machine whose speed falls by `drift` per second."""
    clock = 0.0
    measured = {m: [0.0, 0.0] for m in modes}  # tokens, wall
    for b in range(blocks):
        for mode in block_order(modes, b):
            work = costs[mode]  # seconds for 100 tokens on the undrifted machine
            # Time to do `work` while slowing linearly: integrate 1 + drift * t.
            wall = work * (1 + drift * (clock + work / 2))
            clock += wall
            measured[mode][0] += 100
            measured[mode][1] += wall
    return {m: t / w for m, (t, w) in measured.items()}


def test_interleaved_blocks_cancel_a_steady_drift():
    costs = {"target": 10.0, "auto": 10.0 / 1.5, "ahead": 10.0 / 1.3}
    drift = 0.004  # the machine 10% slower after 25 s
    one = _drifting_run(list(costs), costs, 1, drift)
    four = _drifting_run(list(costs), costs, 4, drift)
    truth = {"auto": 1.5, "ahead": 1.3}
    for mode, ratio in truth.items():
        # Mode after mode, the later modes pay for the slowdown; serpentine blocks nearly cancel it.
        assert abs(one[mode] / one["target"] - ratio) > 0.03
        assert four[mode] / four["target"] == pytest.approx(ratio, rel=0.01)
    # Without reversing odd blocks the drift would come back: check the order is what cancels it.
    assert block_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert block_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_block_speedups_pair_each_block_with_target_only():
    target = {"blocks": [{"output_tokens": 100, "wall_s": 10.0}, {"output_tokens": 100, "wall_s": 12.0}]}
    auto = {"blocks": [{"output_tokens": 100, "wall_s": 5.0}, {"output_tokens": 100, "wall_s": 8.0}]}
    out = block_speedups(auto, target)
    assert out["speedup_vs_target_blocks"] == [pytest.approx(2.0), pytest.approx(1.5)]
    assert out["speedup_vs_target_min"] == pytest.approx(1.5)
    assert out["speedup_vs_target_range"] == "1.50-2.00x"
    assert block_speedups({"blocks": auto["blocks"][:1]}, {"blocks": target["blocks"][:1]}) == {}
    assert block_speedups({"blocks": [{"output_tokens": 0, "wall_s": 1.0}] * 2}, target) == {}


def test_block_deltas_add_up_to_one_scrape_pair():
    total: dict[str, float] = {}
    add_deltas(total, {"specd_rounds_total": 5.0}, {"specd_rounds_total": 9.0})
    add_deltas(total, {"specd_rounds_total": 20.0}, {"specd_rounds_total": 26.0, "new": 1.0})
    assert total == {"specd_rounds_total": 10.0, "new": 1.0}
    assert round_costs({}, total)["rounds"] == 10.0


@pytest.mark.parametrize(
    ("modes", "levels", "repeated"),
    [
        (["target", "auto"], [1], []),
        (["target", "auto", "hf", "hf-target"], [1], []),
        (["auto", "auto@other"], [1], []),  # two servers, each drafting the prompts once
        (["target", "auto", "fixed"], [1], [["auto@1", "fixed@1"]]),
        (["target", "auto"], [1, 8], [["auto@1", "auto@8"]]),
        (["fixed@other", "tree@other", "auto"], [4], [["fixed@other@4", "tree@other@4"]]),
    ],
)
def test_runs_that_draft_the_same_prompts_twice_on_one_server_are_named(modes, levels, repeated):
    # The sitting of 2026-11-28 ran auto and fixed on the same prompts of one stack: the suffix
    # drafter drafted whichever ran second from the other's answers (a rewrite block 1.37x against
    # 1.09x for the same mode run first).
    warnings = drafted_again(modes, levels)
    assert len(warnings) == len(repeated)
    for warning, runs in zip(warnings, repeated, strict=True):
        assert warning.startswith(", ".join(runs) + " send ")
