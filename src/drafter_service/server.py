"""`specd drafter`: load the draft model (or a model-free proposer) and serve DrafterService.

A model-free drafter's start imports no torch: the model drafter's modules are imported only for it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from drafter_service.config import DrafterConfig
from drafter_service.ngram_engine import NgramDrafter
from drafter_service.servicer import DrafterServicer
from drafter_service.suffix_engine import SuffixDrafter
from specd.engine import suffix
from specd.engine.cpus import pin
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, run_service
from specd.rpc.tracing import Tracing

if TYPE_CHECKING:
    from drafter_service.engine import ModelDrafter

# The model-free proposers only copy ids they have seen, so any id the verifier accepts is fine.
NGRAM_VOCAB_LIMIT = 2**31 - 1

log = logging.getLogger(__name__)


def build_engine(config: DrafterConfig) -> tuple[ModelDrafter | NgramDrafter | SuffixDrafter, common_pb2.ModelInfo]:
    if config.drafter in ("ngram", "suffix"):
        return _model_free_engine(config)
    from drafter_service.model_build import build_model_engine

    return build_model_engine(config)


def _model_free_engine(config: DrafterConfig) -> tuple[NgramDrafter | SuffixDrafter, common_pb2.ModelInfo]:
    """Prompt lookup or the suffix drafter: no model, no device, a vocabulary bound only by the
    token ids' range."""
    pin(config.cpus)
    engine: NgramDrafter | SuffixDrafter
    if config.drafter == "ngram":
        engine = NgramDrafter(
            NGRAM_VOCAB_LIMIT,
            config.max_sequences,
            config.max_context,
            config.max_draft_tokens,
            config.ngram_min,
            config.ngram_max,
        )
    else:
        engine = SuffixDrafter(
            NGRAM_VOCAB_LIMIT,
            config.max_sequences,
            config.max_context,
            config.max_draft_tokens,
            config.suffix_depth,
            config.suffix_responses,
            config.suffix_tenants,
            suffix.Limits(config.suffix_factor, config.suffix_min_prob),
        )
    info = common_pb2.ModelInfo(
        model_id=config.drafter,
        max_context=config.max_context,
        device="cpu",
        max_sequences=config.max_sequences,
        max_draft_tokens=config.max_draft_tokens,
    )
    return engine, info


def register(
    server: grpc.aio.Server,
    engine: ModelDrafter | NgramDrafter | SuffixDrafter,
    info: common_pb2.ModelInfo,
    runner: EngineRunner,
    tracing: Tracing,
    metrics: ServiceMetrics,
    leases: Leases,
) -> list[str]:
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(
        DrafterServicer(engine, info, runner, tracing, metrics, leases), server
    )
    return [drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name]


def main(argv: Sequence[str] | None = None) -> None:
    run_service("drafter", DrafterConfig.from_args(argv), build_engine, register)


if __name__ == "__main__":
    main()
