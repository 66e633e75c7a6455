"""A float32 product of a few rows against a linear layer's weight, for CPU decode steps.

A one-token step (and a verify of a few positions) multiplies a handful of activation rows by
every weight of the model once: its time is the time to read the weights. On one core torch's
float32 product for so few rows reads memory well below what the core can stream, so this module
compiles a small AVX2/FMA kernel (`gemv.c`, shipped beside it) with the system's C compiler at
first use, caches the library per user under the source's hash, and calls it through ctypes
(which releases the GIL for the call).

Each output is summed in the same order whatever the number of rows, so a row's result is
bitwise the same alone or in a batch (`gemv.c` says how). Whether the kernel is used at all, and
for which row counts, is measured per model (`RowKernel.calibrate`): where it is not faster, or
cannot be built (no compiler, no AVX2/FMA, not Linux on x86-64), torch's product runs as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from specd.engine.timing import best_times, choose_rows

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
# Tried in order; `CC` from the environment first where set.
COMPILERS = ("cc", "gcc")
FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC")
# The CPU features the flags above let the compiler use.
NEEDED_FEATURES = frozenset({"avx2", "fma"})


class Gemv:
    """The loaded kernel: `linear` is F.linear for the tensors `accepts`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.specd_gemv
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        self._fn.restype = ctypes.c_int

    def __deepcopy__(self, memo: dict[int, object]) -> Gemv:
        # A loaded library is process-wide state: a copied model shares it (ctypes pointers do not copy).
        return self

    @staticmethod
    def accepts(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Float32 CPU tensors, a contiguous 2-D weight whose inputs match x's last dimension, and
        nothing autograd would need to see."""
        return (
            x.dtype == weight.dtype == torch.float32
            and x.device.type == weight.device.type == "cpu"
            and weight.dim() == 2
            and weight.is_contiguous()
            and x.dim() >= 1
            and x.shape[-1] == weight.shape[1]
            and x.numel() > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] · weight [N, K]ᵀ (+ bias): [..., N]. The caller checked `accepts`."""
        n, k = weight.shape
        flat = x.reshape(-1, k).contiguous()
        out = torch.empty(flat.shape[0], n, dtype=torch.float32)
        if self._fn(flat.data_ptr(), weight.data_ptr(), out.data_ptr(), flat.shape[0], n, k) != 0:
            raise RuntimeError(f"the gemv kernel refused shapes {tuple(flat.shape)} x {tuple(weight.shape)}")
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], n)


def _cpu_features() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _unsupported() -> str | None:
    """Why this machine cannot run the kernel, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is built for Linux on x86-64, not {platform.system()} on {platform.machine()}"
    missing = NEEDED_FEATURES - _cpu_features()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    return None


def _compiler() -> str | None:
    names = [os.environ["CC"]] if os.environ.get("CC") else []
    for name in [*names, *COMPILERS]:
        found = shutil.which(name)
        if found:
            return found
    return None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specd"


def _build(compiler: str) -> Path:
    """The library for this source and these flags, compiled once per user (raises on failure)."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: two services starting at once each get a whole file.
    fd, partial = tempfile.mkstemp(prefix="gemv-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True, text=True, timeout=120
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def load() -> Gemv | None:
    """The kernel, built and loaded at first call; None (logged once) where it cannot be."""
    reason = _unsupported()
    compiler = _compiler() if reason is None else None
    if reason is None and compiler is None:
        reason = f"no C compiler ({', '.join(COMPILERS)}) is on PATH"
    if reason is None and compiler is not None:
        try:
            return Gemv(ctypes.CDLL(str(_build(compiler))))
        except subprocess.CalledProcessError as e:
            reason = f"{compiler} failed: {e.stderr.strip()[-500:]}"
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            reason = f"it could not be built or loaded ({e})"
    log.info("float32 products stay torch's: the gemv kernel is unavailable (%s)", reason)
    return None


class RowKernel:
    """The linear products of one model, through the kernel for the row counts (tokens in a forward)
    where `calibrate` measured it faster; torch's otherwise, and for any layer but a float32 nn.Linear."""

    def __init__(self) -> None:
        self.kernel: Gemv | None = None
        self.kernel_rows: frozenset[int] = frozenset()

    def __call__(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if (
            kernel is not None
            and x.numel() // x.shape[-1] in self.kernel_rows
            and type(linear) is nn.Linear
            and kernel.accepts(x, linear.weight)
        ):
            return kernel.linear(x, linear.weight, linear.bias)
        return linear.forward(x)

    def calibrate(self, linears: Sequence[nn.Module], max_rows: int, repeats: int = 3) -> frozenset[int]:
        """Time `linears` one after another (a forward's products, so the weights stream from memory
        as in a step) through torch and through the kernel for 1..max_rows rows, and keep the kernel
        for the row counts `choose_rows` picks; returns them."""
        plain = [m for m in linears if type(m) is nn.Linear and m.weight.dtype == torch.float32]
        kernel = load() if plain and max_rows > 0 and all(m.weight.device.type == "cpu" for m in plain) else None
        self.kernel, self.kernel_rows = kernel, frozenset()
        if kernel is None:
            return self.kernel_rows
        timings: dict[int, tuple[float, float]] = {}
        with torch.inference_mode():
            for rows in range(1, max_rows + 1):
                inputs = [torch.randn(rows, m.in_features) for m in plain]

                def run_torch(inputs: list[torch.Tensor] = inputs) -> None:
                    for m, x in zip(plain, inputs, strict=True):
                        F.linear(x, m.weight, m.bias)

                def run_kernel(inputs: list[torch.Tensor] = inputs, gemv: Gemv = kernel) -> None:
                    for m, x in zip(plain, inputs, strict=True):
                        gemv.linear(x, m.weight, m.bias)

                torch_s, kernel_s = best_times([run_torch, run_kernel], repeats)
                timings[rows] = (torch_s, kernel_s)
        self.kernel_rows = choose_rows(timings)
        log.info(
            "float32 linears: the gemv kernel for %s (torch / kernel ms by rows: %s)",
            f"rows {sorted(self.kernel_rows)}" if self.kernel_rows else "no row count",
            ", ".join(f"{rows}: {a * 1e3:.1f} / {b * 1e3:.1f}" for rows, (a, b) in sorted(timings.items())),
        )
        return self.kernel_rows
