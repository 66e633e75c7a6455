"""Time the embedded float32 target's one-token step, verifies of 5 and 9 positions (k = 4 and 8)
and a batched step of 8 sequences as the verifier builds them ("native": each decoder layer in one C call, its products
through the gemv kernel reading the weights' exact Q4_1 / Q8_0 blocks, in 16-lane AVX-512 form
where the CPU has it), the same blocks against int8-quantized activations ("native-int8": gemv_int8.c,
AVX-512 VNNI; not the float32 product, so its greedy tokens may differ, and how many agree is
printed), the same in the int8 products' AVX2 form ("native-int8-avx2": the same bits, so the same
tokens), the same with the 8-lane AVX2 products ("native-avx2"), with the same
products but torch's calls between them ("blocks"), with the kernel on the float32 weights
("kernel"), and with torch's products only ("torch", as before the kernel: the head's plain or
transposed product by the same calibration), and compare the greedy tokens of them all on a few
chat prompts. Prints each configuration's verify/step ratios (verify(5) / step, verify(9) / step):
what a verify costs in one-token steps, which caps what any drafter can gain.

The configurations alternate in short blocks within one process, so a neighbour's load on a
shared machine falls on all alike. Run pinned to one core, or on two:

    taskset -c 1 python scripts/bench_target_step.py --out /tmp/step.json
    python scripts/bench_target_step.py --threads 2 --out /tmp/step-2.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specd.engine import checkpoints, fused_llama, gemv, models
from specd.engine.cpus import cpu_model
from specd.engine.head_product import HeadProduct
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.native_layer import NativeLayers
from specd.engine.timing import CALIBRATION_ROWS
from verifier_service.server import verify_rows

CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
    "Give me a haiku about the sea.",
]
CONTEXT = 100
CONFIGS = ("native", "native-int8", "native-int8-avx2", "native-avx2", "blocks", "kernel", "torch")
# Sequences in the batched step (one token each), as at 8 clients.
BATCH = 8


def weight_bytes(model: Any) -> int:
    """Bytes of every decoder linear and the head: what a step reads (embedding rows aside)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(t.numel() * t.element_size() for m in linears for t in m.parameters())


def greedy(lm: BatchedCausalLM, ids: list[int], new: int) -> list[int]:
    out: list[int] = []
    logits = lm.forward([Row(0, 0, ids, len(ids) - 1)])[0]
    for position in range(len(ids), len(ids) + new):
        out.append(int(logits[-1].argmax()))
        logits = lm.forward([Row(0, position, [out[-1]], 0)])[0]
    lm.cache.release(0)
    return out


def block_ms(fn: Callable[[], object], runs: int) -> float:
    """Median ms of `runs` calls."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--runs", type=int, default=8, help="steps per block")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads, and the kernel's")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    args = parser.parse_args()
    # The calibrations log what they measured and chose.
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(args.threads)
    tok = checkpoints.load_tokenizer("embedded")
    model = fused_llama.choose(models.load_model("embedded", torch.device("cpu"), torch.float32), "auto", "verifier")
    lm = BatchedCausalLM(model, torch.device("cpu"), torch.float32)
    lm.reserve(BATCH, 512)
    start = time.perf_counter()
    lm.calibrate_products(verify_rows(BATCH, 8))
    calibration_s = time.perf_counter() - start
    linears: gemv.RowKernel = model.base_model.linears
    # The head as it was before the kernel: plain or transposed, chosen by the same calibration.
    torch_head = HeadProduct(lm.head_product.head)
    real_load = gemv.load
    gemv.load = lambda: None  # type: ignore[assignment]
    try:
        torch_head.calibrate(CALIBRATION_ROWS)
    finally:
        gemv.load = real_load
    every = {
        "native": (lm.head_product, linears.max_rows),
        "native-int8": (lm.head_product, linears.max_rows),
        "native-int8-avx2": (lm.head_product, linears.max_rows),
        "native-avx2": (lm.head_product, linears.max_rows),
        "blocks": (lm.head_product, linears.max_rows),
        "kernel": (lm.head_product, linears.max_rows),
        "torch": (torch_head, 0),
    }
    unknown = set(args.configs.split(",")) - set(every)
    if unknown:
        parser.error(f"--configs: no configuration {', '.join(sorted(unknown))}")
    configs = {name: every[name] for name in args.configs.split(",")}
    products = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    held = {m: m.__dict__.get(gemv.BLOCKS_ATTRIBUTE) for m in products}
    head_blocks = lm.head_product.blocks
    native = model.base_model.native

    kernel = gemv.load()
    assert kernel is not None, "no gemv kernel on this machine"
    if any(name.startswith("native-int8") for name in configs) and not kernel.int8_supported():
        parser.error("--configs native-int8: this CPU runs no int8 products (neither AVX-512 VNNI nor AVX2)")
    if "native-int8" in configs and not kernel.set_int8_vnni(True):
        parser.error("--configs native-int8: this CPU has no AVX-512 VNNI (native-int8-avx2 runs without it)")
    gemv.attach_packed(products)
    native_int8 = NativeLayers.build(model.base_model, kernel, int8=True)
    head_packed = gemv.pack_int8(head_blocks) if head_blocks is not None else None
    from_blocks = ("native", "native-int8", "native-int8-avx2", "native-avx2", "blocks")

    def use(name: str) -> None:
        lm.head_product, linears.max_rows = configs[name]
        for m in products:
            m.__dict__[gemv.BLOCKS_ATTRIBUTE] = held[m] if name in from_blocks else None
        lm.head_product.blocks = head_blocks if name in from_blocks else None
        int8 = name.startswith("native-int8")
        linears.int8, lm.head_product.packed = int8, head_packed if int8 else None
        model.base_model.native = native_int8 if int8 else native if name.startswith("native") else None
        kernel.set_wide(name != "native-avx2")
        kernel.set_int8_vnni(name != "native-int8-avx2")

    lm.warm_up(9)
    filler = tok.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 30), add_special_tokens=False)
    context = filler[:CONTEXT]
    for slot in range(BATCH):
        lm.forward([Row(slot, 0, context, len(context) - 1)])
    batch = [Row(slot, CONTEXT, [context[slot]], 0) for slot in range(BATCH)]
    samples: dict[str, dict[str, list[float]]] = {
        name: {"step": [], "verify5": [], "verify9": [], f"batch{BATCH}": []} for name in configs
    }
    for block in range(args.blocks):
        for name in configs if block % 2 == 0 else reversed(list(configs)):
            use(name)
            samples[name]["step"].append(block_ms(lambda: lm.forward([Row(0, CONTEXT, [context[7]], 0)]), args.runs))
            samples[name]["verify5"].append(
                block_ms(lambda: lm.forward([Row(0, CONTEXT, context[10:15], 0)]), args.runs)
            )
            samples[name]["verify9"].append(
                block_ms(lambda: lm.forward([Row(0, CONTEXT, context[10:19], 0)]), args.runs)
            )
            samples[name][f"batch{BATCH}"].append(block_ms(lambda: lm.forward(batch), args.runs))
    for slot in range(BATCH):
        lm.cache.release(slot)
    nbytes = weight_bytes(model)
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for c in CHATS
    ]
    result: dict[str, Any] = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "calibration_s": calibration_s,
        "weight_MB": nbytes / 1e6,
        "kernel_max_rows_linears": linears.max_rows,
        "kernel_max_rows_head": lm.head_product.kernel_max_rows,
    }
    for name in configs:
        use(name)
        for what, blocks in samples[name].items():
            median, best = statistics.median(blocks), min(blocks)
            result[f"{name}_{what}_ms"] = {"median": median, "best": best, "blocks": blocks}
            result[f"{name}_{what}_GBps"] = {"median": nbytes / median / 1e6, "best": nbytes / best / 1e6}
        # Per block, a verify against the step timed beside it; the median of those ratios.
        for verify in ("verify5", "verify9"):
            ratios = [v / s for v, s in zip(samples[name][verify], samples[name]["step"], strict=True)]
            result[f"{name}_{verify}_per_step"] = statistics.median(ratios)
        result[f"{name}_greedy"] = [greedy(lm, ids, args.new) for ids in prompts]
    float32 = [name for name in configs if not name.startswith("native-int8")]
    result["greedy_same"] = [
        len({tuple(result[f"{name}_greedy"][i]) for name in float32}) == 1 for i in range(len(CHATS))
    ]
    if "native-int8" in configs and "native" in configs:
        # Per prompt: the leading tokens int8 shares with float32, and the positions where they agree.
        pairs = zip(result["native-int8_greedy"], result["native_greedy"], strict=True)
        result["int8_greedy_vs_float32"] = [
            {
                "prefix": next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)),
                "same": sum(map(int.__eq__, x, y)),
            }
            for x, y in pairs
        ]
    if "native-int8" in configs and "native-int8-avx2" in configs:
        # The two forms give the same bits, so the same tokens.
        forms = zip(result["native-int8_greedy"], result["native-int8-avx2_greedy"], strict=True)
        result["int8_greedy_forms_same"] = [x == y for x, y in forms]
    result["blocks_MB"] = sum(b.nbytes for b in held.values() if b is not None) / 1e6 + (
        head_blocks.nbytes / 1e6 if head_blocks is not None else 0
    )
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    shown = ("greedy_same", "int8_greedy_vs_float32", "int8_greedy_forms_same")
    print(json.dumps({k: v for k, v in result.items() if "greedy" not in k or k in shown}, indent=1))
    for name in configs:
        print(
            f"{name}: verify(5)/step {result[f'{name}_verify5_per_step']:.2f}, "
            f"verify(9)/step {result[f'{name}_verify9_per_step']:.2f} "
            f"(step {result[f'{name}_step_ms']['median']:.1f} ms, medians of {args.blocks} blocks; {result['cpu']})"
        )


if __name__ == "__main__":
    main()
