"""`specd up --placement`: which cores and threads each service gets, and the measurement behind auto."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specd import cli, placement
from specd.engine.cpus import cpu_model
from specd.placement import (
    choose_cpu_placement,
    cpu_list,
    measured_steps,
    split_placement,
    time_target_step,
)


def test_cpu_list_writes_ranges() -> None:
    assert cpu_list([5, 0, 1, 2]) == "0-2,5"
    assert cpu_list([3]) == "3"
    assert cpu_list([0, 2, 4]) == "0,2,4"


def test_split_gives_the_verifier_the_first_half() -> None:
    assert split_placement([0, 1]) == placement.CpuPlacement(True, "0", "1", 1, 1)
    assert split_placement(range(5)) == placement.CpuPlacement(True, "0-2", "3-4", 3, 2)
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        split_placement([0])


def test_auto_splits_only_where_half_the_cores_cost_the_target_little() -> None:
    memory_bound = choose_cpu_placement(0.057, 0.058, [0, 1])  # the AMD EPYC of the issue
    assert memory_bound.split and memory_bound.verifier_cpus == "0" and "1.02x" in memory_bound.reason
    assert not choose_cpu_placement(0.032, 0.053, [0, 1]).split  # this Xeon: 1.65x
    assert choose_cpu_placement(1.0, placement.SPLIT_IF_SLOWDOWN_AT_MOST, [0, 1]).split


def test_the_measurement_is_cached_per_machine_and_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    timed: list[tuple[str, list[int]]] = []

    def fake(model: str, dtype: str, cpus: Any, timeout_s: float = 0.0) -> float:
        timed.append((model, list(cpus)))
        return 0.01 * len(list(cpus))

    monkeypatch.setattr(placement, "time_target_step", fake)
    assert measured_steps("m", "float32", [0, 1, 2, 3], tmp_path) == (0.04, 0.02, False)
    assert timed == [("m", [0, 1, 2, 3]), ("m", [0, 1])]
    assert measured_steps("m", "float32", [3, 2, 1, 0], tmp_path) == (0.04, 0.02, True)
    assert measured_steps("other", "float32", [0, 1, 2, 3], tmp_path)[2] is False  # another model: measured
    assert len(timed) == 4
    for saved in tmp_path.glob("placement-*.json"):
        saved.write_text("not json")
    assert measured_steps("m", "float32", [0, 1, 2, 3], tmp_path)[2] is False
    assert measured_steps("m", "float32", [0, 1, 2, 3], None)[2] is False  # no cache: always measured


def test_the_step_is_timed_in_a_child_process(model_dirs: dict[str, Path]) -> None:
    seconds = time_target_step(str(model_dirs["target"]), "float32", [0])
    assert 0 < seconds < 5


def resolve(argv: list[str], monkeypatch: pytest.MonkeyPatch, steps: tuple[float, float] = (0.03, 0.05)) -> Any:
    measured: list[Any] = []
    monkeypatch.setattr(placement, "measured_steps", lambda *a: measured.append(a) or (*steps, False))
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    args = cli._up_parser().parse_args(argv)
    return cli.resolve_placement(args, "model"), measured


def test_resolve_placement(monkeypatch: pytest.MonkeyPatch) -> None:
    shared, measured = resolve([], monkeypatch)
    assert not shared.split and measured and "1.67x" in shared.reason
    split, _ = resolve([], monkeypatch, steps=(0.05, 0.052))
    assert split == placement.CpuPlacement(True, "0", "1", 1, 1, split.reason)
    asked, measured = resolve(["--placement", "split"], monkeypatch)
    assert asked.split and not measured
    for argv in (["--placement", "shared"], ["--verifier-cpus", "0"], ["--drafter-device", "cuda"]):
        given, measured = resolve(argv, monkeypatch)
        assert not given.split and not measured, argv
    for argv in (
        ["--placement", "split", "--drafter-threads", "2"],
        ["--placement", "split", "--verifier-device", "cuda"],
    ):
        with pytest.raises(ValueError, match="--placement split"):
            resolve(argv, monkeypatch)


@pytest.mark.parametrize(
    ("argv", "split", "want"),
    [
        ([], True, ("0", "1", 1, 1, "auto")),
        ([], False, ("", "", 0, 0, "sequential")),
        (["--pipeline", "cohort"], True, ("0", "1", 1, 1, "cohort")),
        (["--verifier-cpus", "0", "--pipeline", "ahead"], False, ("0", "", 0, 0, "ahead")),
    ],
)
def test_a_placement_sets_the_services_cores_and_the_pipeline(argv: list[str], split: bool, want: tuple) -> None:
    args = cli._up_parser().parse_args(argv)
    cli.apply_placement(args, split_placement([0, 1]) if split else placement.CpuPlacement(False))
    assert (args.verifier_cpus, args.drafter_cpus, args.verifier_threads, args.drafter_threads, args.pipeline) == want


@pytest.mark.parametrize(
    ("argv", "split", "drafter", "want"),
    [
        ([], True, "model", True),  # cores of their own
        ([], False, "model", False),  # two models on the same cores: one at a time
        ([], False, "ngram", True),  # prompt lookup computes next to nothing
        (["--drafter-device", "cuda"], False, "model", True),
        (["--verifier-cpus", "0", "--drafter-cpus", "1"], False, "model", True),  # cores named: as given
        (["--pipeline", "ahead"], False, "model", True),  # a pipeline that is overlap, asked for
        (["--drafter-overlap", "on"], False, "model", True),
        (["--drafter-overlap", "off"], True, "model", False),
    ],
)
def test_the_drafter_overlaps_the_verifier_unless_they_share_cores(
    argv: list[str], split: bool, drafter: str, want: bool
) -> None:
    args = cli._up_parser().parse_args(argv)
    explicit = bool(args.drafter_cpus or args.verifier_cpus)
    chosen = split_placement([0, 1]) if split else placement.CpuPlacement(False)
    cli.apply_placement(args, chosen)
    assert cli.drafter_overlap(args, chosen, drafter, explicit) is want


def test_cpu_model_names_the_cpu_beyond_its_family(tmp_path):
    info = tmp_path / "cpuinfo"
    block = "processor\t: {}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
    block += "stepping\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n\n"
    info.write_text(block.format(0) + block.format(1).replace("avx2", "avx512f"))
    # The first processor's block; the widest vector extension it has.
    assert cpu_model(cpuinfo=str(info)) == "AMD EPYC (family 25 model 1 stepping 1, avx2)"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t: amx_tile avx512f avx2\n")
    assert cpu_model(cpuinfo=str(info)) == "Some CPU (amx)"
    info.write_text("processor\t: 0\n")
    assert cpu_model("fallback", cpuinfo=str(info)) == "fallback"
    assert cpu_model("fallback", cpuinfo=str(tmp_path / "missing")) == "fallback"


def test_up_forwards_the_token_tree_and_fan_out_flags_to_the_gateway() -> None:
    args = cli._up_parser().parse_args(["--speculative-siblings", "1", "--speculative-branches", "2"])
    cli.apply_placement(args, placement.CpuPlacement(False))
    command = cli._gateway_command(args, "model", False, [], [])
    flags = dict(zip(command[1::2], command[2::2], strict=False))
    assert (flags["--speculative-siblings"], flags["--speculative-branches"]) == ("1", "2")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ([], "specd up: drafter suffix: on the CPU the model drafter would be the target itself"),
        (["--drafter", "int4"], "specd up: drafter int4: as asked (--drafter)"),
    ],
)
def test_the_start_says_which_drafter_and_why(
    argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(placement, "measured_steps", lambda *a: (0.03, 0.05, False))
    monkeypatch.setattr(cli, "refuse_taken_ports", lambda *a: None)
    args = cli._up_parser().parse_args(argv)
    plan = cli._up_plan(cli._up_parser(), args)
    assert said in capsys.readouterr().err
    # A model-free drafter shares the cores: it costs no model step to overlap.
    assert plan.drafter != "suffix" or not plan.placement.split
