"""torch's thread count on the CPU around the work beside the gemv kernel's own threads: a
forward whose products the kernel runs, and a round's small follow-up work on its logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_torch_thread(device: torch.device) -> Iterator[None]:
    """Run torch's work in the block on the calling thread alone where `device` is the CPU. For a
    round's small operations on the logits (softmax, top-k over the vocabulary) after a CPU forward:
    spread over torch's threads, they leave its idle workers spinning into the next forward, whose
    products then share the cores with them. Elsewhere (a GPU) the block runs as it is."""
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def around_forward(body: object, device: torch.device, tokens: int) -> contextlib.AbstractContextManager[None]:
    """`one_torch_thread` for a forward of `tokens` tokens whose products run on the gemv kernel's
    own threads (`body.kernel_takes`, specd.engine.fused_llama): torch then does only the small
    work between the products, and its workers, spinning idle after it, would take the cores from
    the kernel's threads in the middle of each product."""
    takes = getattr(body, "kernel_takes", None)
    return one_torch_thread(device) if takes is not None and takes(tokens) else contextlib.nullcontext()
