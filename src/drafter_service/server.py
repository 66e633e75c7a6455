"""`specd drafter`: load the draft model (or the n-gram proposer) and serve DrafterService."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import torch

from drafter_service.config import DrafterConfig
from drafter_service.engine import ModelDrafter, NgramDrafter
from drafter_service.servicer import DrafterServicer
from specd import models
from specd.fingerprint import TokenizerFingerprint
from specd.kvcache import BatchedCausalLM
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.quant import quantize_int8
from specd.serving import EngineRunner, fingerprint_pb, serve, setup_logging

log = logging.getLogger(__name__)

# The n-gram proposer only copies ids it has seen, so any id the verifier accepts is fine.
NGRAM_VOCAB_LIMIT = 2**31 - 1


def build_engine(config: DrafterConfig) -> tuple[ModelDrafter | NgramDrafter, common_pb2.ModelInfo]:
    if config.drafter == "ngram":
        engine: ModelDrafter | NgramDrafter = NgramDrafter(
            NGRAM_VOCAB_LIMIT,
            config.max_sequences,
            config.max_context,
            config.max_draft_tokens,
            config.ngram_min,
            config.ngram_max,
        )
        info = common_pb2.ModelInfo(
            model_id="ngram",
            max_context=config.max_context,
            device="cpu",
            max_sequences=config.max_sequences,
            max_draft_tokens=config.max_draft_tokens,
        )
        return engine, info
    device = models.parse_device(config.device)
    dtype = models.parse_dtype(config.dtype)
    if config.threads:
        torch.set_num_threads(config.threads)
    model = models.load_model(config.model, device, dtype)
    if config.quantization == "int8":
        if device.type != "cpu":
            raise ValueError("--quantize int8 uses a CPU kernel; use --quantize none on GPUs")
        quantize_int8(model)
    fingerprint = TokenizerFingerprint.of(models.load_tokenizer(config.model))
    lm = BatchedCausalLM(model, device, dtype)
    lm.warm_up(2)
    engine = ModelDrafter(
        lm, fingerprint, config.max_sequences, config.max_context, config.max_draft_tokens, config.max_support
    )
    info = common_pb2.ModelInfo(
        model_id=config.model,
        tokenizer=fingerprint_pb(fingerprint),
        max_context=engine.max_context,
        device=str(device),
        dtype=config.dtype,
        model_vocab_size=lm.vocab_size,
        max_sequences=config.max_sequences,
        max_draft_tokens=config.max_draft_tokens,
    )
    return engine, info


def main(argv: Sequence[str] | None = None) -> None:
    config = DrafterConfig.from_args(argv)
    setup_logging(config.log_level)
    log.info("loading %s drafter %s on %s", config.drafter, config.model, config.device)
    runner = EngineRunner("drafter")
    try:
        engine, info = runner.call(build_engine, config)
    except (models.ModelLoadError, ValueError) as exc:
        log.error("cannot start the drafter: %s", exc)
        sys.exit(2)
    servicer = DrafterServicer(engine, info, runner)

    def register(server):
        drafter_pb2_grpc.add_DrafterServiceServicer_to_server(servicer, server)
        return [drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name]

    asyncio.run(serve("drafter", config.host, config.port, config.max_message_bytes, register))


if __name__ == "__main__":
    main()
