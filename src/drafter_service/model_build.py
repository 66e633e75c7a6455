"""The model drafter's start (`specd drafter --drafter model`): its weights loaded (quantized where
asked), its products chosen, warmed up and its one-token steps timed. Imported only for a model
drafter: the model-free ones start without torch."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from drafter_service.config import DrafterConfig
from drafter_service.engine import ModelDrafter
from specd.engine import calibration, checkpoints, cuda_graphs, fused_llama, gemv, models, synthetic, timing
from specd.engine.grammar import grammar_compiler
from specd.engine.kvcache import BatchedCausalLM, Row
from specd.engine.quant import calibrate_wide_rows, quantize_copy, set_wide_rows, weights_are_int4
from specd.heap import trim_heap
from specd.proto.speculative.v1 import common_pb2
from specd.rpc.serving import fingerprint_pb

log = logging.getLogger(__name__)

# Batch sizes whose one-token step a model drafter times at start-up (those it has room for).
STEP_TIMING_SIZES = (1, 2, 4, 8, 16, 32)
# The longest block a draft step's row feeds through a CUDA graph: later steps feed one token, the
# first one or two (more only after rounds that drafted nothing, which run eagerly).
DRAFT_GRAPH_BLOCK = 4


def build_model_engine(config: DrafterConfig) -> tuple[ModelDrafter, common_pb2.ModelInfo]:
    """The model drafter of `config`, loaded, its products chosen and its steps timed."""
    loaded, quantization = _load_weights(config)
    lm = BatchedCausalLM(loaded.model, loaded.device, loaded.dtype)
    # The engine bounds the KV cache first; the warm-up then makes it at that size.
    engine = ModelDrafter(
        lm,
        loaded.fingerprint,
        config.max_sequences,
        config.max_context,
        config.max_draft_tokens,
        config.max_support,
        grammar_compiler(loaded.tokenizer, lm.vocab_size, loaded.fingerprint.end_token_ids),
        config.branch_slots,
    )
    step_timings = _measure(lm, engine, config, quantization)
    if engine.feature_size:
        log.info(
            "the drafter is a feature head: it reads the target's hidden states (%d wide) beside each token",
            engine.feature_size,
        )
    info = common_pb2.ModelInfo(
        model_id=config.model,
        tokenizer=fingerprint_pb(loaded.fingerprint),
        max_context=engine.max_context,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        model_vocab_size=lm.vocab_size,
        hidden_size=lm.hidden_size,
        max_sequences=config.max_sequences,
        max_draft_tokens=config.max_draft_tokens,
        step_timings=[common_pb2.StepTiming(sequences=n, forward_ns=ns) for n, ns in step_timings],
        weights=loaded.weights,
    )
    return engine, info


def _measure(
    lm: BatchedCausalLM, engine: ModelDrafter, config: DrafterConfig, quantization: str
) -> list[tuple[int, int]]:
    """The start-up timings: the products' kernels, the warm-up, CUDA graphs; the one-token step's
    cost by batch size, returned."""
    on_cpu = lm.device.type == "cpu"
    key = calibration.model_key(lm, config.model, config.load_format) if on_cpu else {}
    if config.activations != "float32" and quantization != "none":
        raise ValueError(
            f"--activations {config.activations} applies to a drafter whose exact weight blocks the CPU kernel "
            f"reads (--quantize none, or auto on a 4-bit model), not to an {quantization} copy"
        )
    if quantization != "none" and config.int8_wide_rows == -1:
        _calibrate_wide_rows(lm, {**key, "quantization": quantization}, config.recalibrate)
    elif quantization != "none":
        set_wide_rows(lm.model, config.int8_wide_rows)
    else:
        # Where the float32 products of a CPU forward are faster through the kernel (from the exact
        # 4-bit blocks of a Q4_1 model, say), they run there, as the verifier's do.
        calibration.calibrate_products(
            lm, config.model, config.load_format, timing.CALIBRATION_ROWS, config.recalibrate, config.activations
        )
    lm.warm_up(2)
    # Before the steps are timed: the gateway prices drafting by the graphed step where it runs.
    # A round's rows: every sequence's, and a fan-out branch's in each branch slot.
    rows = config.max_sequences + engine.table.branch_slots
    cuda_graphs.enable(lm, config.cuda_graphs, DRAFT_GRAPH_BLOCK, "drafter", rows)
    # What a step costs for batches the gateway has not drafted for yet: on a CPU it grows with the
    # batch far more than a line through a few small batches says.
    sizes = [n for n in STEP_TIMING_SIZES if n <= config.max_sequences]
    if on_cpu:
        # The steps follow from the products chosen: the same choices on the same key, the same costs.
        key = {**key, "quantization": quantization, "products": _products(lm), "sizes": sizes}
        if config.activations != "float32":
            key["activations"] = config.activations
        timed, _ = calibration.cached("steps", key, lambda: lm.time_steps(sizes), config.recalibrate)
        step_timings = [(int(n), int(ns)) for n, ns in timed]
    else:
        step_timings = lm.time_steps(sizes)
    log.info("one-token step: %s", ", ".join(f"{n} sequences {ns / 1e6:.1f} ms" for n, ns in step_timings))
    return step_timings


def _products(lm: BatchedCausalLM) -> dict[str, Any]:
    """What the products chosen at this start are, for the steps' key: the steps cost what they run."""
    head = lm.head_product
    return {"head_kernel_rows": head.kernel_max_rows, "head_transposed": sorted(head.transposed_rows)}


def _calibrate_wide_rows(lm: BatchedCausalLM, key: dict[str, Any], recalibrate: bool) -> None:
    """The quantized drafter's widest int8 input, timed once per key (`specd.engine.calibration`)."""
    chosen, kept = calibration.cached(
        "wide-rows", key, lambda: calibrate_wide_rows(lm.model, lambda rows: _prefill_once(lm, rows)), recalibrate
    )
    if kept:
        set_wide_rows(lm.model, int(chosen))


def _load_weights(config: DrafterConfig) -> tuple[models.LoadedModel, str]:
    """The draft model as it will run, and its quantization: int8, int4 or none."""
    quantization = config.quantization
    if config.quantize == "auto" and checkpoints.is_distilled(checkpoints.materialize(config.model)):
        quantization = "none"  # a distilled drafter is already small; quantizing would cost agreement
    if quantization != "none" and models.parse_device(config.device).type != "cpu":
        raise ValueError(f"--quantize {quantization} uses a CPU kernel; use --quantize none on GPUs")
    # A quantized copy is made from float32 weights: rounded to bfloat16 first, 4-bit weights
    # would no longer be 4-bit, and the int4 copy of a Q4_1 target would lose its exactness.
    load_dtype = "float32" if quantization != "none" else activation_dtype(config.dtype, config.device, "none")
    made = synthetic.SyntheticSpec(config.synthetic_seed, config.synthetic_agreement)
    loaded = models.load_for_serving(
        config.model, config.device, load_dtype, config.threads, config.cpus, config.load_format, made
    )
    loaded = dataclasses.replace(loaded, model=fused_llama.choose(loaded.model, config.decoder, "drafter"))
    if quantization == "auto-cpu" and reads_blocks(config.dtype, loaded.model):
        quantization = "none"
        log.info(
            "the drafter reads its weights' exact 4-bit blocks through the CPU kernel, against %s activations",
            config.activations,
        )
    if quantization == "none" and config.int8_wide_rows != -1:
        raise ValueError("int8_wide_rows applies to a quantized drafter; this drafter is not quantized")
    if quantization == "none":
        return loaded, quantization
    kind = "auto" if quantization == "auto-cpu" else quantization
    quantization = quantize_copy(loaded.model, kind, keep_wide=config.int8_wide_rows != 0)
    log.info("the drafter is an %s weight-only copy", quantization)
    dtype = models.parse_dtype(activation_dtype(config.dtype, config.device, quantization))
    loaded.model.to(dtype)
    # The float32 layers just replaced (and the fused forward's concatenated copies) were freed
    # into the C heap, which would otherwise keep them resident for the life of the service.
    trim_heap()
    return dataclasses.replace(loaded, dtype=dtype), quantization


def activation_dtype(dtype: str, device: str, quantization: str) -> str:
    """`--dtype`, with auto resolved: float32 for an unquantized model on the CPU (the float32
    kernel's products, a distilled drafter's agreement), else bfloat16."""
    if dtype != "auto":
        return dtype
    on_cpu = torch.device(device).type == "cpu"
    return "float32" if on_cpu and quantization == "none" else "bfloat16"


def reads_blocks(dtype: str, model: torch.nn.Module) -> bool:
    """Whether `--quantize auto` should leave a float32 CPU model unquantized: its weights are
    4-bit already (a Q4_1 GGUF's), so the float32 kernel reads the same blocks an int4 copy would,
    in one native call per layer and with the target's own float32 arithmetic."""
    return dtype in ("auto", "float32") and gemv.load() is not None and weights_are_int4(model)


def _prefill_once(lm: BatchedCausalLM, rows: int) -> None:
    """One forward over `rows` tokens in slot 0, released after (start-up only: no sequence is open)."""
    lm.forward([Row(0, 0, [0] * rows, rows - 1)])
    lm.cache.release(0)
