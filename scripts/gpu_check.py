#!/usr/bin/env python3
"""specd's GPU check: one JSON of what a GPU makes of specd, in about ten minutes.

    python3 scripts/gpu_check.py [--out DIR] [--device cuda|cpu] [--budget-s 540] [--sections ...]

Writes docs/bench/gpu-<gpu>-<date>.json (and a copy in --out, default $OUT) after every section,
so a check cut short still leaves what it measured. Sections, most valuable first, each within
its own time budget and each failure recorded in the JSON rather than ending the check:

- `device`: the GPU, torch, and the device's copy bandwidth (bytes read + written per second).
- `step_ms` / `verify_ms`: a one-token step of dummy-weight (`--load-format dummy`) bfloat16
  models of the SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B shapes at batch 1, 8 and 32, eager
  and through CUDA graphs (specd.engine.cuda_graphs), beside the bandwidth floor (the bytes of the
  weights a step reads / the copy bandwidth); a verify of 1..9 positions against the step; and
  an eager prefill of 16, 44 and 128 tokens, and the same padded to captured prefill buckets
  (`prefill_graphed_ms`), with the first call of a length new to the process each way
  (`prefill_first_ms`).
- `cuda_tests`: the unit tests with SPECD_TEST_DEVICE=cuda (the GPU-specific ones first), then
  the integration tests with both services on the GPU, in what time is left for them.
- `synthetic_pair`: `specd up` with a synthetic Llama-3.1-8B-shaped target and Llama-3.2-1B-shaped
  drafter at agreements 0.8, 0.6 and 0.95, benched at 1, 8 and 32 clients in target, sequential,
  ahead and auto, with and without MPS; a two-GPU projection from step_ms (scripts/gpu_pair.py).
- `services`: `specd up` with both services on the GPU (dummy 135M weights, the drafter the same
  weights), `specd bench` at 1 and 8 clients: `round_overhead_ms` (a round outside the models'
  forwards on its path, the drafter's beside the verify counted) and `shared_gpu` (draft-ahead's
  verify exchange against its forward, without and with CUDA MPS); each stack's trace summarised
  per span (`spans_ms`).
- `compile`: the 135M shape's one-token step with its body compiled by torch.compile (inductor),
  captured as the services capture theirs, beside the plain capture (last: a compile cannot be
  cut short).

Where a `.whl` directory (scripts/gpu_wheels.sh) lies beside src/, its wheels are installed into
/tmp/site first (no network needed) and put on the path of this process and its children.
`--device cpu` is a dry run of the same code on tiny shapes (the CPU unit tests run it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
SITE = Path("/tmp/site")
TOKENIZER = SRC / "specd" / "data" / "smollm2-135m-drafter"

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
}
# The published configs' shapes (their config.json files, abridged): weights never travel here.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
}
# The CPU dry run's stand-in: the same code on a model that steps in milliseconds.
TINY = {
    **SHAPES["smollm2-135m"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


# -- the report ------------------------------------------------------------


class Report:
    """The JSON, written whole after every section (and copied to `copies`)."""

    def __init__(self, path: Path, copies: list[Path], data: dict[str, Any]) -> None:
        self.path, self.copies, self.data = path, copies, data

    def write(self, final: bool = False) -> None:
        """Into `copies` after every section; into `path` (docs/bench) only when the check ends,
        so the unit tests this check runs, which render docs/bench, never see a report in progress."""
        text = json.dumps(self.data, indent=1, default=str) + "\n"
        if final:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.path)
        for directory in self.copies:
            with contextlib.suppress(OSError):
                directory.mkdir(parents=True, exist_ok=True)
                (directory / self.path.name).write_text(text)

    def section(self, name: str, budget_s: float, fn: Callable[[float], Any]) -> None:
        """Run `fn(deadline)` into data[name]; its error (with traceback) is recorded instead."""
        start = time.monotonic()
        print(f"gpu_check: {name} (budget {budget_s:.0f} s)", file=sys.stderr, flush=True)
        try:
            self.data[name] = fn(start + budget_s)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.data[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        self.data.setdefault("wall_s", {})[name] = round(time.monotonic() - start, 1)
        self.write()


# -- wheels ----------------------------------------------------------------


def install_wheels(root: Path = ROOT, site: Path = SITE) -> str:
    """Install the wheels of `root`/.whl into `site` once (no index, no dependencies; unpacked
    where pip is missing or refuses) and put it first on this process's path and its children's;
    what was done, for the JSON."""
    wheels = sorted((root / ".whl").glob("*.whl"))
    env_path = [str(SRC)]
    how = "no .whl directory: the image's packages"
    if wheels:
        marker = site / ".specd-wheels"
        names = "\n".join(w.name for w in wheels)
        how = f"{len(wheels)} wheels in {site}, installed before"
        if not (marker.is_file() and marker.read_text() == names):
            how = f"{len(wheels)} wheels in {site}, " + _install(wheels, site)
            marker.write_text(names)
        sys.path.insert(0, str(site))
        env_path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([*env_path, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return how


def _install(wheels: list[Path], site: Path) -> str:
    site.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target"]
    done = subprocess.run([*cmd, str(site), *map(str, wheels)], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return "installed by pip"
    import zipfile

    # A wheel is a zip of what lands in site-packages (and its .dist-info, which plugins' entry points need).
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    return f"unpacked (pip: {(done.stderr or done.stdout).strip()[-300:]})"


# -- device ----------------------------------------------------------------


def device_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
            mps_control=shutil.which("nvidia-cuda-mps-control"),
            nvidia_smi=_nvidia_smi(),
        )
    else:
        info["name"] = "cpu"
    info["copy_gbps"] = copy_bandwidth(device)
    return info


def _nvidia_smi() -> str:
    query = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,compute_mode"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not run: {exc}"
    return (done.stdout or done.stderr).strip()


def copy_bandwidth(device: str, nbytes: int = 2**30, repeats: int = 10) -> float:
    """GB/s a device-to-device copy moves, counting the bytes read and those written: the rate
    a step that reads its weights once could at best read them at."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        nbytes = 2**26
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = min(wall_s(lambda: dst.copy_(src), dev, repeats))
    return round(2 * nbytes / seconds / 1e9, 1)


def wall_s(fn: Callable[[], Any], device: Any, repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of `fn` (after one untimed), each waited for on a GPU."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def first_ms(fn: Callable[[], Any], device: Any) -> float:
    """Wall ms of one call of `fn`, waited for on a GPU: a first call's cost where nothing ran it before."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return round((time.perf_counter() - start) * 1e3, 3)


def median_ms(fn: Callable[[], Any], device: Any, repeats: int) -> float:
    times = sorted(wall_s(fn, device, repeats))
    return round(times[len(times) // 2] * 1e3, 3)


# -- step and verify -------------------------------------------------------


def weight_bytes(model: Any) -> int:
    """Bytes a step reads: every weight once (an untied input embedding only gathers rows)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def time_shape(
    name: str, config: dict[str, Any], device: str, batches: list[int], positions: int, deadline: float, repeats: int
) -> dict[str, Any]:
    """One shape's steps and verifies, eager then graphed (uncaptured static on the CPU)."""
    import torch

    from specd.engine import cuda_graphs, fused_llama, models
    from specd.engine.kvcache import BatchedCausalLM, Row

    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # the dry run's tiny shape: threads would only spin against each other
    dtype = torch.bfloat16
    context = 128
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        start = time.monotonic()
        model = fused_llama.fuse(models.load_dummy(tmp, dev, dtype))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        load_s = time.monotonic() - start
    out: dict[str, Any] = {"shape": name, "dtype": "bfloat16", "load_s": round(load_s, 2)}
    out["timing"] = f"median of {repeats} calls after one untimed, each waited for; context {context} tokens"
    out["weight_bytes"] = weight_bytes(model)
    out["params"] = sum(p.numel() for p in model.parameters())
    lm = BatchedCausalLM(model, dev, dtype, max_slots=max(batches), max_positions=positions)
    prefill_buckets = cuda_graphs.prefill_lengths(9)
    static = cuda_graphs.StaticForward(
        lm, max(batches), 9, capture=dev.type == "cuda", batches=batches, prefill=prefill_buckets
    )
    for slot in range(max(batches)):
        lm.forward([Row(slot, 0, [(7 * slot + j) % 1000 for j in range(context)], context - 1)])
    keys = next(k for k in static.keys if k >= context + 9)
    lengths = [n for n in range(1, 10)]

    def step(b: int, n: int = 1) -> Callable[[], Any]:
        return lambda: lm.forward([Row(s, context, [5] * n, 0) for s in range(b)])

    def draft(b: int) -> Callable[[], Any]:
        # The drafter's greedy step: fed the previous step's tokens on the device, argmax there.
        ids = torch.full((b,), 5, dtype=torch.long, device=dev)
        return lambda: lm.forward_argmax([Row(s, context, [0], 0) for s in range(b)], ids)

    def prefill(n: int) -> Callable[[], Any]:
        # A new request's prompt: one row from position 0, eager at any length (no graph holds it).
        return lambda: lm.forward([Row(0, 0, [(7 * j) % 1000 for j in range(n)], n - 1)])

    def measure(label: str) -> None:
        for b in batches:
            if time.monotonic() > deadline:
                out.setdefault("cut_short", []).append(f"{label} batch {b}")
                continue
            out.setdefault("step_ms", {}).setdefault(str(b), {})[label] = median_ms(step(b), dev, repeats)
            out.setdefault("draft_step_ms", {}).setdefault(str(b), {})[label] = median_ms(draft(b), dev, repeats)
        for n in lengths:
            if time.monotonic() > deadline:
                out.setdefault("cut_short", []).append(f"{label} verify {n}")
                continue
            out.setdefault("verify_ms", {}).setdefault(str(n), {})[label] = median_ms(step(1, n), dev, repeats)

    for n in PREFILL_LENGTHS:
        if time.monotonic() < deadline:
            # The first call of a length one past it, a shape new to the process (the context's
            # prefill above ran 128).
            out.setdefault("prefill_first_ms", {}).setdefault("eager", {})[str(n + 1)] = first_ms(prefill(n + 1), dev)
            out.setdefault("prefill_ms", {})[str(n)] = median_ms(prefill(n), dev, repeats)
    measure("eager")
    try:
        graphed(lm, static, out, keys, lengths, batches, step)
    except Exception as exc:  # the eager figures stand without the graphed ones
        out["graphed_error"] = f"{type(exc).__name__}: {exc}"
        out["graphed_traceback"] = traceback.format_exc()[-3000:]
        return out
    measure("graphed")
    # Chunks padded to the captured prefill buckets: lengths one short of those timed eagerly, new
    # to the process but not to the graphs.
    for n in PREFILL_LENGTHS:
        if time.monotonic() < deadline:
            out.setdefault("prefill_first_ms", {}).setdefault("graphed", {})[str(n - 1)] = first_ms(prefill(n - 1), dev)
            out.setdefault("prefill_graphed_ms", {})[str(n)] = median_ms(prefill(n), dev, repeats)
    out["prefill_buckets"] = prefill_buckets
    return out


def graphed(
    lm: Any, static: Any, out: dict[str, Any], keys: int, lengths: list[int], batches: list[int], step: Any
) -> None:
    """Capture the buckets the timings use, and check a graphed verify against the eager one."""
    import torch

    from specd.engine import cuda_graphs

    reference = [t.clone() for t in step(max(batches), 2)()]
    lm.static = static
    start = time.monotonic()
    prefills = [static.bucket(1, n, n) for m in PREFILL_LENGTHS for n in (m - 1, m)]
    static.capture_all(
        [cuda_graphs.Bucket(b, 1, keys) for b in batches]
        + [cuda_graphs.Bucket(1, n, keys) for n in lengths if n > 1]
        + [cuda_graphs.Bucket(max(batches), 2, keys)]
        + sorted({b for b in prefills if b is not None})
    )
    out["capture_s"] = round(time.monotonic() - start, 2)
    out["capture_mib"] = round(static.capture_bytes / 2**20, 1)
    got = step(max(batches), 2)()
    out["graphed_vs_eager"] = {
        "max_abs_logit_diff": max(float((g - r).abs().max()) for g, r in zip(got, reference, strict=True)),
        "same_argmax": all(bool(torch.equal(g.argmax(-1), r.argmax(-1))) for g, r in zip(got, reference, strict=True)),
    }
    # The services' start-up check: rows of other starts and block lengths, a padded row, and
    # positions the graph itself must write (the comparison above rewrites what eager wrote).
    diff = cuda_graphs.self_check(lm, static)
    out["graphed_vs_eager"]["self_check"] = "passed" if diff is None else f"failed: logits {diff:.4g} apart"
    lm.static = static


def free_device_memory(device: str) -> None:
    """Hand the last shape's memory (weights, cache, graph pool) back before the next one loads."""
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def steps_section(device: str, dry: bool, deadline: float, shapes: list[str]) -> dict[str, Any]:
    gbps = float(REPORT.data.get("device", {}).get("copy_gbps") or 0) if REPORT else 0.0
    results: dict[str, Any] = {}
    chosen = {"tiny": TINY} if dry else {name: SHAPES[name] for name in shapes}
    for i, (name, config) in enumerate(chosen.items()):
        left = deadline - time.monotonic()
        if left <= 5:
            results[name] = {"skipped": "no time left"}
            continue
        # Each shape gets its share of what is left; the last the rest.
        share = time.monotonic() + left / (len(chosen) - i)
        try:
            shape = time_shape(name, config, device, [1, 2] if dry else [1, 8, 32], 512, share, 2 if dry else 20)
        except Exception as exc:
            shape = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        if gbps and "weight_bytes" in shape:
            shape["floor_ms"] = round(shape["weight_bytes"] / (gbps * 1e9) * 1e3, 4)
        results[name] = shape
        if REPORT:
            REPORT.data["step_ms"] = results
            REPORT.write()
    return results


def compile_section(device: str, dry: bool, deadline: float) -> dict[str, Any]:
    """The one-token step of the 135M shape at batch 1 through torch.compile's fused kernels,
    captured as the services capture their plain forward, beside that plain capture: whether
    compiling is worth its start-up time (the services capture without it)."""
    import torch

    from specd.engine import cuda_graphs, fused_llama, models
    from specd.engine.kvcache import BatchedCausalLM, Row

    dev = torch.device(device)
    dtype = torch.bfloat16
    context, repeats = 128, 2 if dry else 20
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY if dry else SHAPES["smollm2-135m"]))
        model = fused_llama.fuse(models.load_dummy(tmp, dev, dtype))
    lm = BatchedCausalLM(model, dev, dtype, max_slots=1, max_positions=512)
    capture = dev.type == "cuda"
    plain = cuda_graphs.StaticForward(lm, 1, 1, capture=capture, batches=[1])
    fused = cuda_graphs.StaticForward(lm, 1, 1, capture=capture, batches=[1])
    lm.forward([Row(0, 0, [(7 * j) % 1000 for j in range(context)], context - 1)])
    bucket = cuda_graphs.Bucket(1, 1, next(k for k in plain.keys if k > context))
    rows = [Row(0, context, [5], 0)]
    out: dict[str, Any] = {"shape": "tiny" if dry else "smollm2-135m", "batch": 1, "mode": "default (inductor)"}
    # The compiled body is what the fused forward's capture records instead of the plain one.
    # The packed inputs' views stay eager: inductor cannot lower the ancestor words' bool view on CUDA.
    fused._views = torch.compiler.disable(fused._views)  # type: ignore[method-assign]
    fused._body = torch.compile(fused._body, dynamic=False)  # type: ignore[method-assign]
    start = time.monotonic()
    plain._fill(bucket, rows, None)
    with torch.inference_mode():
        want = plain._body(bucket).clone()
        fused._fill(bucket, rows, None)
        got = fused._body(bucket).clone()
    out["compile_s"] = round(time.monotonic() - start, 1)
    out["max_abs_hidden_diff"] = float((got.float() - want.float()).abs().max())
    if time.monotonic() > deadline:
        return {**out, "cut_short": "compiled, not timed"}
    if capture:
        plain.capture_all([bucket])
        fused.capture_all([bucket])
    for label, static in (("plain", plain), ("compiled", fused)):
        out[f"{label}_graphed_ms" if capture else f"{label}_ms"] = median_ms(lambda s=static: s.run(rows), dev, repeats)
    return out


def verify_summary(steps: dict[str, Any]) -> dict[str, Any]:
    """Per shape, each verify of n positions (batch 1) as a multiple of the one-token step."""
    out: dict[str, Any] = {}
    for name, shape in steps.items():
        verify = shape.get("verify_ms") if isinstance(shape, dict) else None
        if not verify:
            continue
        per: dict[str, Any] = {}
        for label in ("eager", "graphed"):
            one = verify.get("1", {}).get(label)
            if one:
                per[label] = {n: round(v[label] / one, 3) for n, v in verify.items() if label in v}
        out[name] = {"ms": verify, "x_step": per}
    return out


# -- graph probe -----------------------------------------------------------

PROBE_VARIANTS: dict[str, dict[str, Any]] = {
    # test_cuda_graphs' failing case on the H100: 3 rows in a bucket of 4, other starts, keys 300.
    "as_the_test": {},
    "uncaptured": {"capture": False},
    "keys_512": {"positions": 600},
    "same_starts": {"starts": [7, 7, 7]},
    "full_bucket": {"slots": [4, 0, 2, 1], "starts": [7, 3, 12, 5]},
    "one_token_rows": {"counts": [1, 1, 1]},
    "bfloat16": {"dtype": "bfloat16"},
    # Attention by the math backend alone (no memory-efficient or cuDNN kernel).
    "math_attention": {"backend": "MATH"},
    "math_attention_uncaptured": {"backend": "MATH", "capture": False},
    # Keys as the H100 run had them (300, where the cache now rounds its positions up to 320).
    "unaligned_keys": {"alignment": 1},
}


def probe_once(device: str, backend: str = "", **variant: Any) -> float:
    """The largest |graphed - eager| logit over three rounds of the tiny test model's rows, with
    attention through `backend` alone where one is named (torch.nn.attention.SDPBackend)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from specd.engine import slot_cache

    alignment = variant.pop("alignment", slot_cache.KEY_ALIGNMENT)
    before, slot_cache.KEY_ALIGNMENT = slot_cache.KEY_ALIGNMENT, alignment
    try:
        with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
            return _probe_rounds(device, **variant)
    finally:
        slot_cache.KEY_ALIGNMENT = before


def _probe_rounds(
    device: str, capture: bool = True, positions: int = 300, dtype: str = "float32", **rows: Any
) -> float:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specd.engine import cuda_graphs, fused_llama
    from specd.engine.kvcache import BatchedCausalLM, Row

    dev, dt = torch.device(device), getattr(torch, dtype)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    fused = fused_llama.fuse(LlamaForCausalLM(config).eval()).to(device=dev, dtype=dt)
    eager = BatchedCausalLM(fused, dev, dt, max_slots=6, max_positions=positions)
    static = BatchedCausalLM(copy.deepcopy(fused), dev, dt, max_slots=6, max_positions=positions)
    static.static = cuda_graphs.StaticForward(static, 64, 5, capture=capture and dev.type == "cuda")
    slots, starts = rows.get("slots", [4, 0, 2]), list(rows.get("starts", [7, 3, 12]))
    counts = rows.get("counts")
    for slot, n in zip(slots, starts, strict=True):
        for lm in (eager, static):
            lm.forward([Row(slot, 0, [(3 * slot + j) % 96 for j in range(n)], n - 1)])
    worst = 0.0
    for step in range(3):
        fed = counts or [1 + (step + i) % 3 for i in range(len(slots))]
        batch = [
            Row(s, n, [(step + s + j) % 96 for j in range(c)], 0) for s, n, c in zip(slots, starts, fed, strict=True)
        ]
        for w, g in zip(eager.forward(batch), static.forward(batch), strict=True):
            worst = max(worst, float((g.float() - w.float()).abs().max()))
        starts = [n + c for n, c in zip(starts, fed, strict=True)]
    return worst


def sdpa_gap(device: str, keys: int, queries: int = 1) -> float:
    """|memory-efficient - math| attention, float32, on the fused forward's layout: queries grouped
    per key/value head and an additive mask made for one query per row, broadcast over heads."""
    import torch
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(4, 2, 2 * queries, 16, device=device, generator=gen)
    k = torch.randn(4, 2, keys, 16, device=device, generator=gen)
    v = torch.randn(4, 2, keys, 16, device=device, generator=gen)
    starts = torch.tensor([3, 12, 7, 0], device=device)
    visible = starts[:, None, None] + torch.arange(queries, device=device)[None, :, None]
    hidden = torch.arange(keys, device=device)[None, None, :] > visible
    mask = torch.zeros(4, queries, keys, device=device).masked_fill_(hidden, torch.finfo(torch.float32).min)
    mask = mask[:, None]  # [batch, 1, queries, keys]: one query broadcasts over the grouped heads
    if queries > 1:
        mask = mask.repeat(1, 1, 2, 1)  # as _group_mask: one row per grouped query
    outs = []
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(backend):
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return float((outs[0] - outs[1]).abs().max())


def probe_section(device: str, deadline: float) -> dict[str, Any]:
    """Which setting makes the graphed path leave the eager one (each variant changes one thing);
    and the attention kernel alone against the math one at the key counts involved."""
    out: dict[str, Any] = {}
    if device.startswith("cuda"):
        for keys in (13, 137, 300, 320):
            for queries in (1, 3):
                try:
                    out[f"sdpa_efficient_vs_math_keys_{keys}_queries_{queries}"] = round(
                        sdpa_gap(device, keys, queries), 6
                    )
                except Exception as exc:
                    out[f"sdpa_efficient_vs_math_keys_{keys}_queries_{queries}"] = f"{type(exc).__name__}: {exc}"
    for name, variant in PROBE_VARIANTS.items():
        if time.monotonic() > deadline:
            out[name] = "no time left"
            continue
        try:
            out[name] = round(probe_once(device, **variant), 6)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


# -- tests -----------------------------------------------------------------

_OUTCOME = re.compile(r"^(\S+::\S+?)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
_OUTCOME_AFTER = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] )?(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\s+(\S+::\S+)")


def parse_pytest(text: str) -> dict[str, Any]:
    """Counts and failing tests from `pytest -v` output, complete or cut short."""
    outcomes: dict[str, str] = {}
    for line in text.splitlines():
        m = _OUTCOME.match(line)
        if m:
            outcomes[m.group(1)] = m.group(2)
            continue
        m = _OUTCOME_AFTER.match(line)
        if m:
            outcomes.setdefault(m.group(2), m.group(1))
    counts = {kind.lower(): 0 for kind in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")}
    for outcome in outcomes.values():
        counts[outcome.lower()] += 1
    counts["failing"] = sorted(t for t, o in outcomes.items() if o in ("FAILED", "ERROR"))
    counts["collection_errors"] = sorted(set(re.findall(r"^ERROR collecting (\S+)", text, re.M)))
    # What pytest chose to run ("collected N items / M deselected"); None where it never said (killed first).
    collected = re.search(r"^collected (\d+) items?(?: / (\d+) deselected)?", text, re.M)
    workers = re.search(r"^\d+ workers? \[(\d+) items?\]", text, re.M)  # xdist: after deselection
    if workers:
        counts["selected"] = int(workers.group(1))
    else:
        counts["selected"] = int(collected.group(1)) - int(collected.group(2) or 0) if collected else None
    return counts


Run = tuple[list[str], dict[str, str]]  # pytest's arguments, and variables set for it


def run_pytests(runs: dict[str, Run], env: dict[str, str], timeout_s: float, logs: Path) -> dict[str, Any]:
    """pytest runs at once, each in its own process group, all killed at `timeout_s`; each run's
    outcomes so far (a run cut short still counts what it finished)."""
    start = time.monotonic()
    procs = {}
    for name, (args, extra) in runs.items():
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider", *args]
        f = (logs / f"{name}.log").open("w")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs[name] = (proc, f, cmd)
    out: dict[str, Any] = {}
    for name, (proc, f, cmd) in procs.items():
        try:
            proc.wait(timeout=max(1.0, start + timeout_s - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
        f.close()
        text = (logs / f"{name}.log").read_text(errors="replace")
        result = parse_pytest(text)
        result.update(command=" ".join(cmd[1:]), wall_s=round(time.monotonic() - start, 1), timed_out=timed_out)
        result["exit_code"] = proc.returncode
        if result["failing"] or result["collection_errors"]:
            result["tail"] = failure_text(text)
        out[name] = result
    return out


def failure_text(text: str, limit: int = 6000) -> str:
    """A run's tracebacks (pytest's FAILURES / ERRORS sections on), else its last lines: what
    failed and why, for the JSON, when the log itself cannot come back."""
    at = min((i for i in (text.find("= ERRORS ="), text.find("= FAILURES =")) if i >= 0), default=-1)
    if at < 0:
        return text[-limit:]
    return text[text.rfind("\n", 0, at) + 1 :][:limit]


# The unit tests that exercise what only a GPU shows, first.
GPU_FIRST = [
    "tests/unit/test_grammar.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_gpu_sync.py",
    "tests/unit/test_device_clock.py",
    "tests/unit/test_refused_token.py",
    "tests/unit/test_engines.py",
    "tests/unit/test_kvcache.py",
    "tests/unit/test_fused_llama.py",
    "tests/unit/test_dummy_load.py",
]
# Prompt lengths whose eager prefill step_ms times beside the step.
PREFILL_LENGTHS = (16, 44, 128)
# The other unit files, and the integration files, run in this many pytest processes at once
# each (a GPU host has the cores).
UNIT_GROUPS = 6
INTEGRATION_GROUPS = 6


def file_groups(skip: list[str], groups: int = UNIT_GROUPS, folder: str = "unit") -> list[list[str]]:
    """The test files of tests/`folder` not in `skip`, dealt largest first into `groups` lists of similar size."""
    files = sorted(
        (p for p in (ROOT / "tests" / folder).glob("test_*.py") if str(p.relative_to(ROOT)) not in skip),
        key=lambda p: -p.stat().st_size,
    )
    out: list[list[str]] = [[] for _ in range(groups)]
    sizes = [0] * groups
    for p in files:
        i = sizes.index(min(sizes))
        out[i].append(str(p.relative_to(ROOT)))
        sizes[i] += p.stat().st_size
    return [g for g in out if g]


# Tests of what a GPU host does not carry or change: they run in the CPU suite.
NOT_ON_DEVICE = {
    "tests/unit/test_deploy.py": "deploy linters and schemas (check-jsonschema, hadolint) are not carried",
    "tests/unit/test_gguf_special_tokens.py": "the embedded GGUF (98 MB) cannot travel",
    "tests/unit/test_gateway_imports.py": "which modules the host's own transformers imports, not the device",
    "tests/unit/test_benchmarks_doc.py": "documents, rendered on the CPU",
    "tests/unit/test_config_docs.py": "documents, rendered on the CPU",
    "tests/integration/test_bad_input.py": "schemathesis is not carried",
    "tests/integration/test_clients.py": "the client SDKs it drives (openai-agents, langchain-openai) are not carried",
    "tests/integration/test_real_model.py": "the embedded GGUF cannot travel",
}


def tests_section(device: str, dry: bool, deadline: float, logs: Path) -> dict[str, Any]:
    env = dict(os.environ, SPECD_TEST_DEVICE=device, SPECD_TEST_TOKENIZER=str(TOKENIZER))
    first = [f for f in GPU_FIRST if (ROOT / f).is_file()]
    if dry:
        runs: dict[str, Run] = {"unit_first": (["tests/unit/test_cuda_graphs.py", "-k", "buckets"], {})}
        return with_total(run_pytests(runs, env, deadline - time.monotonic(), logs))
    common = ["--timeout", "120", "-m", "not slow", *(a for f in NOT_ON_DEVICE for a in ("--ignore", f))]
    # The GPU-specific files first, in at most 40% of the budget; then every other unit file and
    # the integration tests (both services on the device) at once, in what is left.
    left = deadline - time.monotonic()
    out = run_pytests({"unit_first": ([*common, *first], {})}, env, left * 0.4, logs)
    if REPORT:
        REPORT.data["cuda_tests"] = out
        REPORT.write()
    runs = {f"unit_{i}": ([*common, *group], {}) for i, group in enumerate(file_groups([*first, *NOT_ON_DEVICE]))}
    # Each integration test starts its own processes on free ports: files in parallel groups.
    both = {"SPECD_VERIFIER_DEVICE": device, "SPECD_DRAFTER_DEVICE": device}
    for i, group in enumerate(file_groups(list(NOT_ON_DEVICE), INTEGRATION_GROUPS, "integration")):
        runs[f"integration_{i}"] = ([*common, *group], both)
    out.update(run_pytests(runs, env, deadline - time.monotonic() - 3, logs))
    out = with_total(out)
    out["not_run"] = NOT_ON_DEVICE
    return out


def with_total(runs: dict[str, Any]) -> dict[str, Any]:
    """`runs` with their `total`: each outcome summed, the tests selected but never finished
    (`not_run`: runs cut short or killed), and the runs whose selection pytest never reported."""
    totals = {k: 0 for k in ("passed", "failed", "skipped", "error", "xfail", "xpass")}
    failing: list[str] = []
    cut: list[str] = []
    not_run, unknown = 0, []
    for name, part in runs.items():
        for k in totals:
            totals[k] += part.get(k, 0)
        failing += part.get("failing", [])
        if part.get("timed_out"):
            cut.append(name)
        if part.get("selected") is None:
            unknown.append(name)
        else:
            not_run += max(0, part["selected"] - sum(part.get(k, 0) for k in totals))
    total = {**totals, "not_run": not_run, "failing": failing, "cut_short": cut, "selection_unknown": unknown}
    return {**runs, "total": total}


# -- services --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def services_section(device: str, dry: bool, deadline: float, logs: Path) -> dict[str, Any]:
    """`specd up` on the device with dummy weights, benched at 1 and 8 clients: sequential rounds
    for the overhead, token trees (two siblings beside each chain) for what the verify's width costs
    there, draft-ahead for the shared GPU, without MPS and (where it can be had) with, and fan-out
    draft-ahead (two branches) for what the drafter's extra rows cost there."""
    from specd import mps

    model_dir = logs / "model-135m"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY if dry else SHAPES["smollm2-135m"]))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (TOKENIZER / f).is_file():
            shutil.copy(TOKENIZER / f, model_dir / f)
    out: dict[str, Any] = {}
    variants = [("no_mps", False)] + ([] if dry or device == "cpu" else [("mps", True)])
    for label, with_mps in variants:
        left = deadline - time.monotonic()
        if left < 30:
            out[label] = {"skipped": "no time left"}
            continue
        share = time.monotonic() + left / (len(variants) - len(out))
        daemon = None
        try:
            if with_mps:
                daemon = mps.start_daemon()
                if daemon is None:
                    found = shutil.which(mps.CONTROL)
                    why = f"{mps.CONTROL} -d did not start a daemon" if found else f"no {mps.CONTROL} on PATH"
                    out[label] = {"skipped": why}
                    continue
            elif device != "cpu" and mps.running():
                out[label] = {"skipped": "an MPS daemon already runs on this host"}
                continue
            # With MPS, specd up finds the daemon this check started (and leaves it to the check).
            shared = "auto" if with_mps else "off"
            out[label] = bench_stack(device, model_dir, dry, share, logs / label, shared)
        except Exception as exc:
            out[label] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        finally:
            if daemon is not None:
                mps.stop_daemon(daemon)
        if REPORT:
            REPORT.data["services"] = out
            REPORT.data.update(service_summary(out))
            REPORT.write()
    return out


def service_summary(services: dict[str, Any]) -> dict[str, Any]:
    """The issue's two figures from the stacks: `round_overhead_ms` (a sequential round's time
    outside the two forwards, per clients, from the stack without MPS) and `shared_gpu`
    (draft-ahead's verify exchange beside the verifier's forward, per clients, without and with MPS)."""
    overhead: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    for variant, runs in services.items():
        if not isinstance(runs, dict):
            continue
        for key, r in runs.items():
            if not isinstance(r, dict) or "@" not in key:
                continue
            mode, clients = key.split("@")
            if mode == "sequential" and variant == "no_mps" and "outside_forwards_ms" in r:
                overhead[clients] = r["outside_forwards_ms"]
            if mode == "ahead":
                shared.setdefault(variant, {})[clients] = {
                    "verify_exchange_ms": r.get("round_verify_ms"),
                    "verifier_forward_ms": r.get("round_verifier_forward_ms"),
                    "x_forward": r.get("verify_exchange_x_forward"),
                }
    return {"round_overhead_ms": overhead, "shared_gpu": shared}


def bench_stack(
    device: str, model_dir: Path, dry: bool, deadline: float, logs: Path, shared: str = "off"
) -> dict[str, Any]:
    logs.mkdir(parents=True, exist_ok=True)
    http, grpc_port, dport, vport, dm, vm = (free_port() for _ in range(6))
    up = [
        sys.executable, "-m", "specd.cli", "up",
        "--target-model", str(model_dir), "--drafter", "model", "--draft-model", str(model_dir),
        "--drafter-device", device, "--verifier-device", device,
        "--verifier-dtype", "bfloat16", "--drafter-dtype", "bfloat16", "--quantize", "none",
        "--load-format", "dummy", "--pipeline", "auto", "--shared-gpu", shared,
        "--http-port", str(http), "--grpc-port", str(grpc_port),
        "--drafter-port", str(dport), "--verifier-port", str(vport),
        "--drafter-metrics-port", str(dm), "--verifier-metrics-port", str(vm),
        "--max-context", "1024", "--startup-timeout", str(max(90, int(deadline - time.monotonic()))),
        "--trace-file", str(logs / "trace.jsonl"),
    ]  # fmt: skip
    env = dict(os.environ)
    start = time.monotonic()
    with (logs / "up.log").open("w") as f:
        proc = subprocess.Popen(up, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{http}"
        wait_healthy(base, proc, deadline, logs / "up.log")
        out: dict[str, Any] = {"startup_s": round(time.monotonic() - start, 1)}
        bench = [
            sys.executable, "-m", "specd.cli", "bench", "--base-url", base, "-k", "4",
            "--max-tokens", "16" if dry else "48", "--num-prompts", "2" if dry else "8",
            "--concurrency", "1" if dry else "1,8", "--modes", "target,sequential,tree,ahead,fanout",
            "--workload", "chat",
            "--output-dir", str(logs), "--name", "bench",
            "--service-metrics", f"drafter=http://127.0.0.1:{dm}/metrics,verifier=http://127.0.0.1:{vm}/metrics",
        ]  # fmt: skip
        left = deadline - time.monotonic()
        done = subprocess.run(
            bench, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(10.0, left), check=False
        )
        text = done.stdout + done.stderr
        (logs / "bench.log").write_text(text)
        # Written before its plots, which need matplotlib (not on every GPU image).
        written = logs / "bench-bench.json"
        if not written.is_file():
            return {**out, "error": f"specd bench exited {done.returncode} without its JSON", "tail": text[-3000:]}
        out["bench_exit_code"] = done.returncode
        out.update(round_figures(json.loads(written.read_text())))
        out["service_log"] = notable_lines((logs / "up.log").read_text(errors="replace"))
    finally:
        stop_group(proc)
    # After the stop: each service writes the spans it still holds as it shuts down.
    out["spans_ms"] = span_summary(logs / "trace.jsonl")
    return out


def span_summary(path: Path) -> dict[str, Any]:
    """Per service and span name in a `--trace-file` (OTLP JSON lines): count, p50, p95, max and
    total ms. Where a round's time goes, and its stalls, without bringing the trace back. Spans
    that say whether they ran in captured graphs (the drafter's prefill chunks) are counted again
    under their name + " graphed" or " eager": a chunk of a shape new to the process is slow."""
    durations: dict[str, list[float]] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for resource in json.loads(line)["resourceSpans"]:
                    attrs = {a["key"]: a["value"] for a in resource.get("resource", {}).get("attributes", [])}
                    service = attrs.get("service.name", {}).get("stringValue", "?")
                    for scope in resource.get("scopeSpans", []):
                        for span in scope.get("spans", []):
                            ms = (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e6
                            durations.setdefault(f"{service} {span['name']}", []).append(ms)
                            if (graphed := _graphed(span)) is not None:
                                kind = "graphed" if graphed else "eager"
                                durations.setdefault(f"{service} {span['name']} {kind}", []).append(ms)
    out: dict[str, Any] = {}
    for name, values in sorted(durations.items()):
        values.sort()
        n = len(values)
        out[name] = {
            "count": n,
            "p50": round(values[n // 2], 3),
            "p95": round(values[min(n - 1, int(n * 0.95))], 3),
            "max": round(values[-1], 3),
            "total": round(sum(values), 1),
        }
    return out


def _graphed(span: dict[str, Any]) -> bool | None:
    """A span's `specd.prefill_graphed` attribute, None where it has none."""
    for attribute in span.get("attributes", []):
        if attribute.get("key") == "specd.prefill_graphed":
            return bool(attribute.get("value", {}).get("boolValue"))
    return None


NOTABLE = ("CUDA graphs", "runs eagerly", "one-token step", "MPS", "specd up:", "Error", "WARNING")


def notable_lines(text: str, limit: int = 40) -> list[str]:
    """The lines of a stack's log worth keeping: graph captures, step timings, MPS, warnings, errors."""
    return [line[-400:] for line in text.splitlines() if any(k in line for k in NOTABLE)][:limit]


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to `specd up`'s process group (it stops its children), SIGKILL after 20 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(base: str, proc: subprocess.Popen[bytes], deadline: float, log: Path | None = None) -> None:
    """Until `base` answers /health; a stack that exits first raises with its log's tail."""
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"specd up exited {proc.returncode} before it was healthy{_tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"specd up was not healthy in its time budget{_tail(log)}")


def _tail(log: Path | None, limit: int = 3000) -> str:
    if log is None or not log.is_file():
        return ""
    return ":\n" + log.read_text(errors="replace")[-limit:]


def round_figures(report: dict[str, Any]) -> dict[str, Any]:
    """From a `specd bench` report: per mode and clients, a round's time and its parts (draft +
    verify + join + outside = round), its time outside the models' forwards on its path (the
    drafter's beside the verify counted; see specd.tools.benchstats.round_costs), and the verify
    exchange beside the verifier's forward."""
    out: dict[str, Any] = {}
    for r in report.get("results", []):
        key = f"{r.get('mode')}@{r.get('concurrency')}"
        names = ("round_draft_ms", "round_verify_ms", "round_join_ms", "round_outside_ms", "round_overhead_ms")
        forwards = ("round_drafter_forward_ms", "round_verifier_forward_ms", "round_drafter_beside_forward_ms")
        entry: dict[str, Any] = {"tok_s": r.get("output_tokens_per_s"), **{k: r.get(k) for k in (*names, *forwards)}}
        if _is_number(r.get("speedup_vs_target")):
            entry["x_target"] = round(r["speedup_vs_target"], 3)
        # Reports from before the gateway timed the round whole have no round_round_ms: no round then.
        for figure, source in (("round_ms", "round_round_ms"), ("outside_forwards_ms", "round_outside_forwards_ms")):
            if _is_number(r.get(source)):
                entry[figure] = round(r[source], 3)
        if _is_number(r.get("round_verify_ms")) and r.get("round_verifier_forward_ms"):
            entry["verify_exchange_x_forward"] = round(r["round_verify_ms"] / r["round_verifier_forward_ms"], 3)
        out[key] = entry
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def pair_section(device: str, dry: bool, deadline: float, logs: Path) -> dict[str, Any]:
    """The synthetic 8B + 1B pair (scripts/gpu_pair.py), benched under `specd up`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_pair

    return gpu_pair.section(sys.modules[__name__], device, dry, deadline, logs)


# -- main ------------------------------------------------------------------

REPORT: Report | None = None
SECTIONS = ("device", "graph_probe", "step_ms", "verify_ms", "cuda_tests", "synthetic_pair", "services", "compile")


def gpu_slug(name: str) -> str:
    m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", name.upper())
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu").lower()


def main(argv: list[str] | None = None) -> int:
    global REPORT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for the dry run on tiny shapes")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="also copy the JSON here (default $OUT)")
    p.add_argument("--bench-dir", default=str(ROOT / "docs" / "bench"), help="where the JSON goes")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole check's time, wheels and start-up aside")
    p.add_argument("--sections", default=",".join(SECTIONS), help="which sections, comma-separated")
    p.add_argument("--shapes", default=",".join(SHAPES), help="model shapes for step_ms")
    args = p.parse_args(argv)
    start = time.monotonic()
    dry = args.device == "cpu"
    try:
        # The dry run uses the environment it runs in; the wheels are CPython 3.12 ones for a GPU host.
        wheels = "the dry run: the running environment" if dry else install_wheels()
    except Exception as exc:  # the image's own packages may do
        wheels = f"not installed: {type(exc).__name__}: {exc}"
    # The checkout's own code, whether or not specd is installed here (a GPU host has it only as files).
    sys.path.insert(0, str(SRC))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    import torch

    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --device cpu for the dry run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0) if not dry else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    path = Path(args.bench_dir) / f"gpu-{gpu_slug(name)}-{date}.json"
    data: dict[str, Any] = {
        "what": "scripts/gpu_check.py: dummy-weight bfloat16 steps eager and graphed, unit/integration tests on "
        "the device, a specd up stack on it",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wheels": wheels,
        "dry_run": dry,
    }
    REPORT = Report(path, [Path(args.out)] if args.out else [], data)
    chosen = set(args.sections.split(","))
    logs = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    # Shares of the whole budget, most valuable first; what a section leaves goes to the next.
    plan: list[tuple[str, float, Callable[[float], Any]]] = [
        ("device", 0.03, lambda d: device_info(args.device)),
        ("graph_probe", 0.05, lambda d: probe_section(args.device, d)),
        ("step_ms", 0.10, lambda d: steps_section(args.device, dry, d, args.shapes.split(","))),
        ("verify_ms", 0.0, lambda d: verify_summary(REPORT.data.get("step_ms", {}) if REPORT else {})),
        ("cuda_tests", 0.40, lambda d: tests_section(args.device, dry, d, logs)),
        ("synthetic_pair", 0.35, lambda d: pair_section(args.device, dry, d, logs)),
        ("services", 0.05, lambda d: services_section(args.device, dry, d, logs)),
        # Last: a compile cannot be cut short, and what it says is worth least if it overruns.
        ("compile", 0.05, lambda d: compile_section(args.device, dry, d)),
    ]
    plan = [step for step in plan if step[0] in chosen]
    for i, (section, share, fn) in enumerate(plan):
        # Its share of the time left, against the shares of the sections still to run: what an
        # earlier section did not use goes to the later ones.
        left = start + args.budget_s - time.monotonic()
        rest = sum(s for _, s, _ in plan[i:]) or 1.0
        REPORT.section(section, max(left * share / rest, 1.0), fn)
    REPORT.data["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    REPORT.data["logs"] = str(logs)
    if args.out:
        with contextlib.suppress(OSError):
            shutil.copytree(logs, Path(args.out) / "logs", dirs_exist_ok=True, ignore=shutil.ignore_patterns("model-*"))
    REPORT.write(final=True)
    print(f"gpu_check: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
