"""`specd verifier`: load the target model and serve VerifierService."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

import torch

from specd import models
from specd.fingerprint import TokenizerFingerprint
from specd.kvcache import BatchedCausalLM
from specd.proto.speculative.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.serving import EngineRunner, fingerprint_pb, serve, setup_logging
from verifier_service.config import VerifierConfig
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import VerifierServicer

log = logging.getLogger(__name__)


def build_engine(config: VerifierConfig) -> tuple[VerifierEngine, common_pb2.ModelInfo]:
    device = models.parse_device(config.device)
    dtype = models.parse_dtype(config.dtype)
    if config.threads:
        torch.set_num_threads(config.threads)
    model = models.load_model(config.model, device, dtype)
    tokenizer = models.load_tokenizer(config.model)
    fingerprint = TokenizerFingerprint.of(tokenizer)
    lm = BatchedCausalLM(model, device, dtype)
    lm.warm_up(min(config.max_draft_tokens, 8) + 1)
    engine = VerifierEngine(lm, fingerprint, config.max_sequences, config.max_context, config.max_draft_tokens)
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
    config = VerifierConfig.from_args(argv)
    setup_logging(config.log_level)
    log.info("loading target %s on %s (%s)", config.model, config.device, config.dtype)
    runner = EngineRunner("verifier")
    try:
        engine, info = runner.call(build_engine, config)
    except (models.ModelLoadError, ValueError) as exc:
        log.error("cannot start the verifier: %s", exc)
        sys.exit(2)
    servicer = VerifierServicer(engine, info, runner)

    def register(server):
        verifier_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name]

    asyncio.run(serve("verifier", config.host, config.port, config.max_message_bytes, register))


if __name__ == "__main__":
    main()
