"""Handing freed C-heap memory back to the system, for every service (no torch here)."""

from __future__ import annotations

import sys
from typing import Any

_LIBC: Any = None


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim; elsewhere nothing).

    The prefill of a long prompt leaves freed activations in the heap, and a large request body
    its parse and its tokens, which glibc keeps for the next allocation; this returns them.
    """
    global _LIBC
    if _LIBC is None:
        _LIBC = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL("libc.so.6")
                _LIBC = libc if hasattr(libc, "malloc_trim") else False
            except OSError:
                pass
    if _LIBC:
        _LIBC.malloc_trim(0)
