"""Start-up timings paid once per machine, model and build (specd.engine.calibration)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import tinymodels
import torch

from specd.engine import calibration, gemv
from specd.engine.head_product import HeadProduct
from specd.engine.kvcache import BatchedCausalLM, Row


def test_a_second_service_on_the_same_cores_times_only_after_the_first(tmp_path: Path) -> None:
    events: list[str] = []
    entered = threading.Event()

    def second() -> None:
        with calibration.cores_alone([1, 2], tmp_path):
            events.append("second times")
        entered.set()

    with calibration.cores_alone([0, 1], tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.3)  # core 1 is the first one's while it times
        events.append("first done")
    thread.join(5)
    assert events == ["first done", "second times"]


def test_services_on_cores_of_their_own_time_at_once(tmp_path: Path) -> None:
    entered = threading.Event()

    def second() -> None:
        with calibration.cores_alone([1], tmp_path):
            entered.set()

    with calibration.cores_alone([0], tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        assert entered.wait(5)
    thread.join(5)


def test_a_lock_that_cannot_be_made_does_not_stop_the_timing(tmp_path: Path) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("")
    start = time.perf_counter()
    with calibration.cores_alone([0], blocker / "locks"):  # its folder would be a file
        pass
    assert time.perf_counter() - start < 1


def test_a_timing_is_kept_per_key_and_measured_again_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[int] = []

    def measure() -> dict[str, int]:
        measured.append(1)
        return {"rows": len(measured)}

    key = {"cpu": "x", "model": "m"}
    assert calibration.cached("products", key, measure, directory=tmp_path) == ({"rows": 1}, False)
    assert calibration.cached("products", key, measure, directory=tmp_path) == ({"rows": 1}, True)
    assert calibration.cached("products", {**key, "model": "n"}, measure, directory=tmp_path) == ({"rows": 2}, False)
    time.sleep(0.01)
    monkeypatch.setattr(calibration, "_STARTED", time.time())  # a process started after those were kept
    assert calibration.cached("products", key, measure, recalibrate=True, directory=tmp_path) == ({"rows": 3}, False)
    # Written since this process started: a second service told to recalibrate reads the first one's.
    assert calibration.cached("products", key, measure, recalibrate=True, directory=tmp_path) == ({"rows": 3}, True)
    for path in tmp_path.glob("products-*.json"):
        path.write_text("not json")
    assert calibration.cached("products", key, measure, directory=tmp_path) == ({"rows": 4}, False)
    assert calibration.forget(tmp_path) == 2
    assert calibration.cached("products", key, measure, directory=tmp_path) == ({"rows": 5}, False)


def test_two_services_timing_one_key_at_once_time_it_once(tmp_path: Path) -> None:
    measured: list[str] = []
    results: list[tuple[Any, bool]] = []

    def measure() -> str:
        measured.append("timed")
        time.sleep(0.2)
        return "choice"

    def start() -> None:
        results.append(calibration.cached("steps", {"k": 1}, measure, directory=tmp_path))

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert measured == ["timed"]
    assert sorted(kept for _, kept in results) == [False, True]


def test_the_weights_key_follows_their_content(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"a" * (3 << 20))
    first = calibration.model_identity(str(model))
    (model / "model.safetensors").write_bytes(b"a" * (3 << 20))  # rewritten, the same bytes
    assert calibration.model_identity(str(model)) == first
    (model / "model.safetensors").write_bytes(b"a" * ((3 << 20) - 1) + b"b")
    assert calibration.model_identity(str(model)) != first
    assert calibration.model_identity(str(model), "dummy") != first


def test_a_kept_head_choice_is_applied_without_timing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot take the LM head, its torch products are timed once per key; a later
    start applies what was kept and computes what the first one did."""
    monkeypatch.setattr(calibration, "calibration_dir", lambda: tmp_path)
    monkeypatch.setattr(gemv, "load", lambda: None)  # no kernel: the head's products are timed
    timed: list[int] = []

    def lm() -> BatchedCausalLM:
        model = tinymodels.build_model(3, 120, 1, 2, layers=2)
        return BatchedCausalLM(model, torch.device("cpu"), torch.float32, max_slots=4, max_positions=64)

    first, second = lm(), lm()
    original = HeadProduct._time

    def counted(self: HeadProduct, max_rows: int, repeats: int) -> frozenset[int]:
        timed.append(max_rows)
        return original(self, max_rows, repeats) | {2, 3}  # whatever the timing said, rows 2 and 3 transposed

    monkeypatch.setattr(HeadProduct, "_time", counted)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    calibration.calibrate_products(first, str(tmp_path / "m"), "dummy", 6)
    calibration.calibrate_products(second, str(tmp_path / "m"), "dummy", 6)
    assert timed == [6]
    assert second.head_product.transposed_rows == first.head_product.transposed_rows >= {2, 3}
    rows = [Row(0, 0, [1, 2, 3], 2), Row(1, 0, [6, 7], 1)]
    with torch.inference_mode():
        assert all(map(torch.equal, first.forward(rows), second.forward(rows)))
