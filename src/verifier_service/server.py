"""`specd verifier`: load the target model and serve VerifierService."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import grpc

from specd.engine import calibration, cuda_graphs, fused_llama, models, synthetic
from specd.engine.grammar import grammar_compiler
from specd.engine.kvcache import BatchedCausalLM
from specd.proto.speculative.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from specd.rpc.leases import Leases
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.serving import EngineRunner, fingerprint_pb, run_service
from specd.rpc.tracing import Tracing
from verifier_service.config import VerifierConfig
from verifier_service.engine import VerifierEngine
from verifier_service.servicer import VerifierServicer


def verify_rows(max_sequences: int, max_draft_tokens: int) -> int:
    """The most tokens one verify forward feeds: every open sequence's drafts and the position after them."""
    return max_sequences * (max_draft_tokens + 1)


def build_engine(config: VerifierConfig) -> tuple[VerifierEngine, common_pb2.ModelInfo]:
    made = synthetic.SyntheticSpec(config.synthetic_seed)
    loaded = models.load_for_serving(
        config.model, config.device, config.dtype, config.threads, config.cpus, config.load_format, made
    )
    loaded = dataclasses.replace(loaded, model=fused_llama.choose(loaded.model, config.decoder, "verifier"))
    lm = BatchedCausalLM(loaded.model, loaded.device, loaded.dtype)
    # The engine bounds the KV cache first; the warm-up then makes it at that size.
    engine = VerifierEngine(
        lm,
        loaded.fingerprint,
        config.max_sequences,
        config.max_context,
        config.max_draft_tokens,
        grammar_compiler(loaded.tokenizer, lm.vocab_size, loaded.fingerprint.end_token_ids),
    )
    # Every verify and step forward takes the same products (the kernel's where it applies): a
    # position's logits then carry the same bits in a verify of any size as in its one-token step.
    rows = verify_rows(config.max_sequences, config.max_draft_tokens)
    activations = calibration.calibrate_products(
        lm, config.model, config.load_format, rows, config.recalibrate, config.activations
    )
    lm.warm_up(min(config.max_draft_tokens, 8) + 1)
    # A verify feeds up to k + 1 tokens a row; longer blocks run eagerly.
    cuda_graphs.enable(lm, config.cuda_graphs, min(config.max_draft_tokens, 8) + 1, "verifier", config.max_sequences)
    info = common_pb2.ModelInfo(
        model_id=config.model,
        tokenizer=fingerprint_pb(loaded.fingerprint),
        max_context=engine.max_context,
        device=str(loaded.device),
        dtype=config.dtype,
        model_vocab_size=lm.vocab_size,
        hidden_size=lm.hidden_size,
        max_sequences=config.max_sequences,
        max_draft_tokens=config.max_draft_tokens,
        weights=loaded.weights,
        activations=activations if activations != "float32" else "",
    )
    return engine, info


def register(
    server: grpc.aio.Server,
    engine: VerifierEngine,
    info: common_pb2.ModelInfo,
    runner: EngineRunner,
    tracing: Tracing,
    metrics: ServiceMetrics,
    leases: Leases,
) -> list[str]:
    verifier_pb2_grpc.add_VerifierServiceServicer_to_server(
        VerifierServicer(engine, info, runner, tracing, metrics, leases), server
    )
    return [verifier_pb2.DESCRIPTOR.services_by_name["VerifierService"].full_name]


def main(argv: Sequence[str] | None = None) -> None:
    run_service("verifier", VerifierConfig.from_args(argv), build_engine, register)


if __name__ == "__main__":
    main()
