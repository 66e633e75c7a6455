"""A round's forward time: the wall time on the CPU, the device's own on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from specd.engine.device_clock import DeviceClock


def test_on_the_cpu_a_forward_takes_the_wall_time_between_start_and_stop():
    clock = DeviceClock(torch.device("cpu"))
    time.sleep(0.02)
    clock.stop()
    time.sleep(0.05)  # what follows the stop (the verdicts) is not the forward's
    assert clock.elapsed_ns() == clock.stop_ns - clock.start_ns
    assert 20e6 <= clock.elapsed_ns() < 60e6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_a_forward_takes_the_time_of_its_queued_work_not_of_its_launch():
    clock = DeviceClock(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # queued work the host does not wait for: about 0.1 s of GPU cycles
    clock.stop()
    launch_ns = clock.stop_ns - clock.start_ns
    assert clock.elapsed_ns() > max(20e6, 10 * launch_ns)
