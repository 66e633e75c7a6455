"""A float32 product of a few rows against a linear layer's weight, for CPU decode steps.

A one-token step (and a verify of a few positions) multiplies a handful of activation rows by
every weight of the model once: its time is the time to read the weights. On one core torch's
float32 product for so few rows reads memory well below what the core can stream, so this module
compiles a small AVX2/FMA kernel (`gemv.c`, shipped beside it) with the system's C compiler at
first use, caches the library per user under the source's hash, and calls it through ctypes
(which releases the GIL for the call).

Each output is summed in the same order whatever the number of rows, so a row's result is
bitwise the same alone or in a batch (`gemv.c` says how).

A float32 weight loaded from a GGUF's Q4_1 or Q8_0 tensor holds only the values those 4- and 8-bit
blocks give. `as_blocks` finds such a weight's blocks, checks that they rebuild every float32
weight bit for bit, and the kernel then reads the blocks instead: the same products, bitwise, from
an eighth or about a quarter of the bytes a step streams. Where the kernel is used is a rule
(`RowKernel.choose`): every forward up to a bound, wherever it can be built; where it cannot (no
compiler, no AVX2/FMA, not Linux on x86-64), torch's product runs as before.

With `activations="int8"` (`--activations int8`) the products read from blocks quantize each activation
row to 8 bits per block of 32 and sum in integers (`gemv_int8.c`: AVX-512 VNNI where the CPU has it,
else an AVX2 form with the same bits): no longer the float32 product (the activations are rounded),
but still bitwise the same for a row alone or in a batch. It is asked for, never chosen: where it
cannot run, `require_int8` refuses.
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
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from specd.engine import ACTIVATION_CHOICES, block_cache

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.c")
# Built into the same library: one decoder layer in one call (specd.engine.native_layer).
LAYER_SOURCE = Path(__file__).with_name("layer.c")
# Built into the same library: the int8-activation products.
INT8_SOURCE = Path(__file__).with_name("gemv_int8.c")
# Tried in order; `CC` from the environment first where set.
COMPILERS = ("cc", "gcc")
# No contraction of a multiply and an add into one fused step: the blocks' weights must be rebuilt
# with the float32 roundings that made the float32 copy.
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")
# The CPU features the flags above let the compiler use.
NEEDED_FEATURES = frozenset({"avx2", "fma"})


BLOCK = 32
# Bump when `Blocks`' q or scales change their layout: blocks kept by `specd.engine.block_cache` are then found again.
BLOCKS_LAYOUT = 1
# Rows of a weight examined at once by `as_blocks` (bounds its temporaries).
CHUNK_ROWS = 4096


@dataclass(frozen=True)
class Blocks:
    """A float32 weight [N, K] held exactly as blocks of 32 inputs, in `gemv.c`'s layouts: kind "q4"
    (Q4_1: 16 bytes and a (d, m) float pair per block) or "q8" (Q8_0: 32 signed bytes and d)."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()


def _q4_chunk(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q4_1 blocks for groups [n, blocks, 32] that rebuild them exactly, else None. The smallest
    weight of a block is its m (q = 0) and d is a float16 value, as llama.cpp stores them."""
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    d = ((high - low) / 15).half().float()
    if not torch.isfinite(d).all():
        return None
    safe = torch.where(d > 0, d, torch.ones_like(d))[..., None]
    q = torch.where(d[..., None] > 0, torch.round((groups - low[..., None]) / safe), 0).clamp(0, 15)
    if not torch.equal((d[..., None] * q + low[..., None]).view(torch.int32), groups.view(torch.int32)):
        return None
    q = q.to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(groups.shape[0], -1), torch.stack([d, low], dim=-1)


def _q8_chunk(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Q8_0 blocks for groups [n, blocks, 32] that rebuild them exactly, else None: d is a float16
    value with the block's largest magnitude at q = ±127."""
    d = (groups.abs().amax(dim=-1) / 127).half().float()
    if not torch.isfinite(d).all():
        return None
    safe = torch.where(d > 0, d, torch.ones_like(d))[..., None]
    q = torch.where(d[..., None] > 0, torch.round(groups / safe), 0).clamp(-127, 127)
    if not torch.equal((d[..., None] * q).view(torch.int32), groups.view(torch.int32)):
        return None
    return q.to(torch.int8).view(torch.uint8).reshape(groups.shape[0], -1), d


def as_blocks(weight: torch.Tensor) -> Blocks | None:
    """The weight's Q4_1 or Q8_0 blocks where they rebuild every float32 weight bit for bit
    (a model loaded from such a GGUF); None for any other weight. Found once per machine
    (`specd.engine.block_cache`)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.device.type != "cpu":
        return None
    return block_cache.kept(weight, _find_blocks, Blocks, BLOCKS_LAYOUT)


def _find_blocks(weight: torch.Tensor) -> Blocks | None:
    n, k = weight.shape
    for kind, chunk_fn in (("q4", _q4_chunk), ("q8", _q8_chunk)):
        parts = []
        with torch.no_grad():
            for start in range(0, n, CHUNK_ROWS):
                groups = weight[start : start + CHUNK_ROWS].detach().reshape(-1, k // BLOCK, BLOCK)
                part = chunk_fn(groups)
                if part is None:
                    break
                parts.append(part)
            else:
                q = torch.cat([p[0] for p in parts]).contiguous()
                return Blocks(kind, q, torch.cat([p[1] for p in parts]).contiguous())
    return None


# Outputs side by side in `Packed`'s layout (gemv_int8.c's GROUP).
GROUP = 16


@dataclass(frozen=True)
class Packed:
    """A weight's `Blocks` repacked for `gemv_int8.c`: the outputs in groups of 16 (the last padded
    with zeros), and per group and block, input group i (inputs 4i..4i+3) of the 16 rows in 64 bytes,
    4 per row. q4: 4 chunks of 64 bytes, inputs 4i.. in the low nibbles and 16 + 4i.. in the high,
    then d and m for the 16 rows (scales [groups, blocks, 2, 16]); q8: 8 chunks of q + 128 as
    unsigned bytes, then d (scales [groups, blocks, 16])."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor


def pack_int8(blocks: Blocks) -> Packed:
    """`blocks` in gemv_int8.c's layout (`Packed`)."""
    n = blocks.q.shape[0]
    pad = -n % GROUP
    with torch.no_grad():
        if blocks.kind == "q4":
            packed = blocks.q.reshape(n, -1, 16)
            q = torch.cat([packed & 15, packed >> 4], dim=-1)
            q = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(-1, GROUP, q.shape[1], 2, 4, 4)
            # [groups, blocks, i, row, j, half]: a byte holds input 4i + j (low) and 16 + 4i + j (high).
            q = q.permute(0, 2, 4, 1, 5, 3)
            q = q[..., 0] | (q[..., 1] << 4)
            scales = F.pad(blocks.scales, (0, 0, 0, 0, 0, pad)).reshape(-1, GROUP, q.shape[1], 2).permute(0, 2, 3, 1)
        else:
            q = (blocks.q.view(torch.int8).reshape(n, -1, 32).to(torch.int16) + 128).to(torch.uint8)
            q = F.pad(q, (0, 0, 0, 0, 0, pad)).reshape(-1, GROUP, q.shape[1], 8, 4).permute(0, 2, 3, 1, 4)
            scales = F.pad(blocks.scales.reshape(n, -1), (0, 0, 0, pad)).reshape(-1, GROUP, q.shape[1]).permute(0, 2, 1)
    return Packed(blocks.kind, q.contiguous().reshape(q.shape[0], -1), scales.contiguous())


class Gemv:
    """The loaded kernel: `linear` is F.linear for the tensors `accepts`."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        self._fn = library.specd_gemv
        self._blocks = {"q4": library.specd_gemv_q4, "q8": library.specd_gemv_q8}
        self._int8 = {"q4": library.specd_gemv_q4i8, "q8": library.specd_gemv_q8i8}
        for fn in (self._fn, *self._blocks.values(), *self._int8.values()):
            fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        for fn in (*self._blocks.values(), *self._int8.values()):
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        self._int8_supported = library.specd_int8_supported
        self._int8_supported.restype = ctypes.c_int
        self._int8_vnni = library.specd_set_int8_vnni
        self._int8_vnni.argtypes = [ctypes.c_int]
        self._int8_vnni.restype = ctypes.c_int
        self._threads = library.specd_set_threads
        self._threads.argtypes = [ctypes.c_int]
        self._threads.restype = ctypes.c_int
        self._wide = library.specd_set_wide
        self._wide.argtypes = [ctypes.c_int]
        self._wide.restype = ctypes.c_int

    def set_threads(self, n: int) -> int:
        """Split each product's weight rows among `n` threads from now on (the results do not depend
        on it); returns the number in use. The services pass torch's thread count, which their
        placement set."""
        return int(self._threads(n))

    def set_wide(self, on: bool) -> bool:
        """Use the 16-lane (AVX-512F) block products from now on where `on` and the CPU has them
        (the default); returns whether they are used. The outputs are bitwise the same either way."""
        return bool(self._wide(int(on)))

    def int8_supported(self) -> bool:
        """Whether this CPU runs the int8-activation products: with AVX-512F, BW, VL and VNNI, or in
        their AVX2 form (AVX2 and FMA)."""
        return bool(self._int8_supported())

    def set_int8_vnni(self, on: bool) -> bool:
        """Sum the int8-activation products with AVX-512 VNNI from now on where `on` and the CPU has
        it (the default), else in their AVX2 form; returns whether VNNI is used (False where `on`
        asked for it and the CPU lacks it). The outputs are bitwise the same either way."""
        return bool(self._int8_vnni(int(on)))

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

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        blocks: Blocks | None = None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """x [..., K] · weight [N, K]ᵀ (+ bias): [..., N], read from `blocks` (`as_blocks(weight)`)
        where given: the same outputs, bitwise; from `packed` (`pack_int8(blocks)`) where given, against
        x quantized to 8 bits (`gemv_int8.c`, in the form `set_int8_vnni` chose; the caller checked
        `int8_supported`). The caller checked
        `accepts`."""
        n, k = weight.shape
        flat = x.reshape(-1, k).contiguous()
        out = torch.empty(flat.shape[0], n, dtype=torch.float32)
        if packed is not None:
            status = self._int8[packed.kind](
                flat.data_ptr(), packed.q.data_ptr(), packed.scales.data_ptr(), out.data_ptr(), flat.shape[0], n, k
            )
        elif blocks is not None:
            status = self._blocks[blocks.kind](
                flat.data_ptr(), blocks.q.data_ptr(), blocks.scales.data_ptr(), out.data_ptr(), flat.shape[0], n, k
            )
        else:
            status = self._fn(flat.data_ptr(), weight.data_ptr(), out.data_ptr(), flat.shape[0], n, k)
        if status != 0:
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
    sources = [SOURCE, LAYER_SOURCE, INT8_SOURCE]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"gemv-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: two services starting at once each get a whole file.
    fd, partial = tempfile.mkstemp(prefix="gemv-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, *map(str, sources), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
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


# The attribute of an nn.Linear holding its weight's `Blocks` (set by `RowKernel.choose`; a plain
# attribute, so a copy of the model keeps it and its state dict does not).
BLOCKS_ATTRIBUTE = "gemv_blocks"
# The same layer's `Packed` blocks, made where int8 activations are chosen.
PACKED_ATTRIBUTE = "gemv_packed"


class RowKernel:
    """The linear products of one model: through the kernel for every forward of 1..`max_rows` tokens
    where `choose` found that it applies, torch's otherwise, and for any layer but a float32
    nn.Linear. A layer whose weight has exact blocks (`as_blocks`) is read from them.

    The choice is a rule, never a timing: a row's outputs are bitwise its own only while every
    forward it can share takes the same product (the kernel's do not depend on the rows beside
    them; torch's do), so the kernel takes every token count up to the bound or none."""

    def __init__(self) -> None:
        self.kernel: Gemv | None = None
        self.max_rows = 0
        # The layers with blocks multiply int8-quantized activations (`choose`'s activations="int8").
        self.int8 = False

    def takes(self, rows: int) -> bool:
        """Whether a forward of `rows` tokens runs its products on the kernel."""
        return self.kernel is not None and 1 <= rows <= self.max_rows

    def __call__(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel
        if (
            kernel is not None
            and self.takes(x.numel() // x.shape[-1])
            and type(linear) is nn.Linear
            and kernel.accepts(x, linear.weight)
        ):
            packed = linear.__dict__.get(PACKED_ATTRIBUTE) if self.int8 else None
            return kernel.linear(x, linear.weight, linear.bias, linear.__dict__.get(BLOCKS_ATTRIBUTE), packed)
        return linear.forward(x)

    def choose(self, linears: Sequence[nn.Module], max_rows: int, activations: str = "float32") -> int:
        """Take the kernel for forwards of 1..`max_rows` tokens where it loads (Linux on x86-64 with
        AVX2 and FMA, and a C compiler) and every one of `linears` is a float32 nn.Linear on the
        CPU; returns the bound taken (0: torch's products throughout). With `activations` "int8" the
        layers with exact blocks multiply int8-quantized activations; raises ValueError where that
        cannot be had (`require_int8`, or no layer with blocks)."""
        check_activations(activations)
        plain = [m for m in linears if type(m) is nn.Linear and m.weight.dtype == torch.float32]
        usable = bool(plain) and len(plain) == len(linears) and all(m.weight.device.type == "cpu" for m in plain)
        kernel = load() if usable and max_rows > 0 else None
        if activations == "int8":
            require_int8(kernel, "the model's linears")
        self.kernel, self.max_rows, self.int8 = kernel, max_rows if kernel is not None else 0, False
        if kernel is None:
            return 0
        kernel.set_threads(torch.get_num_threads())
        held = attach_blocks(plain)
        if activations == "int8":
            attach_packed(plain)
        if activations == "int8" and held == 0:
            raise ValueError(
                "--activations int8 multiplies exact 4- or 8-bit weight blocks (a Q4_1 or Q8_0 GGUF's): "
                "none of this model's linears has them; use --activations float32"
            )
        self.int8 = activations == "int8"
        log.info(
            "float32 linears: the gemv kernel (%d threads) for forwards of 1 to %d tokens, %d of %d layers read "
            "from exact 4- or 8-bit blocks against %s activations",
            torch.get_num_threads(),
            max_rows,
            held,
            len(plain),
            activations,
        )
        return max_rows


def check_activations(activations: str) -> None:
    if activations not in ACTIVATION_CHOICES:
        raise ValueError(f"--activations takes {', '.join(ACTIVATION_CHOICES)}, not {activations!r}")


def require_int8(kernel: Gemv | None, what: str) -> Gemv:
    """`kernel` where it runs the int8-activation products; else a ValueError saying why (asked for,
    the mode is never dropped for the float32 one without a word)."""
    if kernel is None:
        raise ValueError(
            f"--activations int8 runs on the CPU kernel, which {what} cannot take here (a float32 model on "
            "the CPU, Linux on x86-64 with a C compiler; the log says what was missing); use --activations float32"
        )
    if not kernel.int8_supported():
        raise ValueError(
            "--activations int8 needs AVX-512 VNNI (avx512f, avx512bw, avx512vl and avx512_vnni) or AVX2 and "
            "FMA, which this CPU lacks; use --activations float32"
        )
    return kernel


def attach_packed(linears: Sequence[nn.Linear]) -> None:
    """Give each layer with `Blocks` their `pack_int8` form, once."""
    for m in linears:
        blocks = m.__dict__.get(BLOCKS_ATTRIBUTE)
        if blocks is not None and PACKED_ATTRIBUTE not in m.__dict__:
            m.__dict__[PACKED_ATTRIBUTE] = pack_int8(blocks)


def attach_blocks(linears: Sequence[nn.Linear]) -> int:
    """Give each layer whose weight has exact blocks (`as_blocks`) its `Blocks`, once; how many have them."""
    todo = [m for m in linears if BLOCKS_ATTRIBUTE not in m.__dict__]
    for m, blocks in zip(todo, block_cache.on_threads(as_blocks, [m.weight for m in todo]), strict=True):
        m.__dict__[BLOCKS_ATTRIBUTE] = blocks
    return sum(m.__dict__[BLOCKS_ATTRIBUTE] is not None for m in linears)
