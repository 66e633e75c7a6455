"""The target's hidden states on the wire: little-endian bfloat16, row-major [n, width]."""

from __future__ import annotations

import numpy as np
import torch


def encode(rows: torch.Tensor) -> bytes:
    """[n, width] hidden states as the bytes VerifyResult.hidden_states and DraftTask.hidden_states carry."""
    bits = rows.detach().to(torch.bfloat16).cpu().contiguous().view(torch.int16).numpy()
    return bits.astype("<i2", copy=False).tobytes()


def decode(data: bytes, width: int) -> torch.Tensor:
    """The [n, width] bfloat16 tensor of `data`; ValueError if it is not whole rows of that width."""
    if width <= 0:
        raise ValueError("hidden states sent, but no width is known to read them")
    if len(data) % (2 * width):
        raise ValueError(f"{len(data)} bytes of hidden states are not whole rows of {width} bfloat16 values")
    bits = np.frombuffer(data, dtype="<i2").astype(np.int16, copy=False)
    return torch.from_numpy(bits.copy()).view(torch.bfloat16).view(-1, width)


def rows(data: bytes, width: int) -> int:
    return len(data) // (2 * width) if width > 0 else 0
