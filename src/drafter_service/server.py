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
from specd.rpc import backend_auth
from specd.rpc.delivery import DeliveryStream
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, channel_options, run_service
from specd.rpc.tls import channel_credentials, server_name_option
from specd.rpc.tracing import Tracing

if TYPE_CHECKING:
    from drafter_service.engine import ModelDrafter

# The model-free proposers only copy ids they have seen, so any id the verifier accepts is fine.
NGRAM_VOCAB_LIMIT = 2**31 - 1

log = logging.getLogger(__name__)

# A delivery is one write on a stream already open: past this the verifier has stopped reading.
DELIVERY_TIMEOUT_S = 5.0


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
    delivery: DeliveryStream | None = None,
) -> list[str]:
    drafter_pb2_grpc.add_DrafterServiceServicer_to_server(
        DrafterServicer(engine, info, runner, tracing, metrics, leases, delivery), server
    )
    return [drafter_pb2.DESCRIPTOR.services_by_name["DrafterService"].full_name]


def delivery_stream(config: DrafterConfig) -> DeliveryStream | None:
    """The one-hop exchange's stream to the verifier (--deliver-to), with the backend links' token and TLS."""
    if not config.deliver_to:
        return None
    tokens = backend_auth.load_tokens(config.backend_token, config.backend_token_file)
    credentials = channel_credentials(config.deliver_tls_ca, config.deliver_tls_cert, config.deliver_tls_key)
    options = channel_options(config.max_message_bytes)
    if credentials is None:
        channel = grpc.aio.insecure_channel(config.deliver_to, options=options)
    else:
        options += server_name_option(config.deliver_tls_server_name)
        channel = grpc.aio.secure_channel(config.deliver_to, credentials, options=options)
    return DeliveryStream(channel, backend_auth.token_metadata(tokens[0] if tokens else ""), DELIVERY_TIMEOUT_S)


def main(argv: Sequence[str] | None = None) -> None:
    config = DrafterConfig.from_args(argv)

    def register_delivering(
        server: grpc.aio.Server,
        engine: ModelDrafter | NgramDrafter | SuffixDrafter,
        info: common_pb2.ModelInfo,
        runner: EngineRunner,
        tracing: Tracing,
        metrics: ServiceMetrics,
        leases: Leases,
    ) -> list[str]:
        # Made here, in the service's event loop, which the channel belongs to.
        delivery = delivery_stream(config)
        return register(server, engine, info, runner, tracing, metrics, leases, delivery)

    run_service("drafter", config, build_engine, register_delivering)


if __name__ == "__main__":
    main()
