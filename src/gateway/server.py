"""`specd gateway`: connect to the backends, check tokenizers, serve HTTP and gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.api import chat_templates, http_limits, reflection_v1, tool_parsers
from gateway.api.body_screen import BodyScreen
from gateway.api.grpc_api import GatewayServicer
from gateway.api.limits import RateLimiter
from gateway.api.openai_api import OpenAIApi
from gateway.api.prompts import vocabulary_facts
from gateway.backends import BackendError, check_compatible
from gateway.config import GatewayConfig
from gateway.pool import drafter_pool, verifier_pool
from gateway.pool_metrics import PoolCollector
from gateway.round.decide import WIDE_PIPELINES
from gateway.round.direct import one_hop
from gateway.round.scheduler import Scheduler
from specd.engine import checkpoints
from specd.engine.end_tokens import end_token_ids
from specd.engine.fingerprint import TokenizerFingerprint
from specd.ports import SERVER_OPTIONS, PortUnavailable, check_free
from specd.proto.speculative.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from specd.rpc import backend_auth, tls
from specd.rpc.grpc_decode import DecodeErrorInterceptor
from specd.rpc.serving import channel_options, exit_at_once, setup_logging
from specd.rpc.tracing import Tracing

log = logging.getLogger(__name__)


async def run(config: GatewayConfig) -> None:
    tokenizer = checkpoints.load_tokenizer(config.tokenizer)
    if config.chat_template:
        chat_templates.load(tokenizer, config.chat_template)
    if config.tool_call_parser:
        tool_parsers.check_tokenizer(config.tool_call_parser, tokenizer)
    model_name = config.served_model_name or checkpoints.display_name(config.tokenizer)
    # Credentials first: a bad certificate path is a startup error, before any wait.
    backend_tls = tls.channel_credentials(config.backend_tls_ca, config.backend_tls_cert, config.backend_tls_key)
    api_tls = tls.server_credentials(config.tls_cert, config.tls_key)
    api_keys = tls.ApiKeys(config.api_key)
    tokens = backend_auth.load_tokens(config.backend_token, config.backend_token_file)
    # Before waiting for the backends: a port another process holds is a start-up error.
    check_free({"HTTP": (config.host, config.http_port), "gRPC": (config.host, config.grpc_port)})
    verifier, drafter = _backend_pools(config, backend_tls, tokens[0] if tokens else "")
    # What needs only the tokenizer is done before the backends answer (the verifier loads its model meanwhile).
    # Every end id of the model stops a sequence; the backends' sets must be the same (the fingerprint holds it).
    eos = end_token_ids(config.tokenizer, tokenizer)
    log.info("sequences end at token ids %s", list(eos))
    fingerprint = TokenizerFingerprint.of(tokenizer, eos)
    vocabulary_facts(tokenizer)
    backends: list[Any] = [verifier] + ([drafter] if drafter else [])
    for backend in backends:
        log.info("waiting for the %s at %s", backend.name, backend.address)
        await backend.wait_ready(config.connect_timeout_s)
        await backend.load_info()
    check_compatible(fingerprint, verifier, drafter)
    tracing = Tracing("specd-gateway", config.otlp_endpoint, config.trace_file)
    scheduler = _start_scheduler(config, tokenizer, verifier, drafter, eos, tracing)
    api = _openai_api(config, scheduler, tokenizer, model_name, _health_status(scheduler, verifier, drafter))
    api.keyed = api_keys.enabled  # clients are their keys, else their addresses
    api.weights = made_weights(verifier, drafter)
    api.activations = verifier.info.activations
    if api.weights:
        log.warning("the backends' weights are made, not loaded: %s; the text is meaningless", api.weights)
    grpc_server = None
    if config.grpc_port:
        grpc_server = await _start_grpc(config, scheduler, tokenizer, model_name, api_keys, api_tls)
    # The route's own bound on a prompt's bytes, so the worker refuses what the route would.
    screen = BodyScreen(text_limit=api.prompts.text_limit)
    screen.start()
    server = _http_server(config, api, api_keys, screen)
    _drain_on_signals(config, scheduler, server, grpc_server)
    log.info(
        "gateway ready: model %r, k=%d, HTTP %s://%s:%d/v1, gRPC %s%s%s",
        model_name,
        scheduler.k_limit,  # what it drafts at most: the flag within what the services take
        "https" if api_tls else "http",
        config.host,
        config.http_port,
        f"{config.host}:{config.grpc_port}" if grpc_server else "off",
        " (TLS)" if grpc_server and api_tls else "",
        ", API key required" if api_keys.enabled else "",
    )
    try:
        await server.serve()
    finally:
        await scheduler.stop()
        if grpc_server is not None:
            await grpc_server.stop(2)
        for backend in backends:
            await backend.close()
        tracing.shutdown()
        screen.close()


def made_weights(verifier: Any, drafter: Any) -> str:
    """How the backends' weights were made where they are not a checkpoint's (ModelInfo.weights), for
    /v1/models and the log; "" where both serve their model's own."""
    made = [(role, pool.info.weights) for role, pool in (("target", verifier), ("drafter", drafter)) if pool]
    return "; ".join(f"{role} {weights}" for role, weights in made if weights)


def _backend_pools(config: GatewayConfig, backend_tls: Any, token: str) -> tuple[Any, Any]:
    """The verifier pool and, when speculation is on, the drafter pool (not yet connected)."""
    channel = (config.backend_timeout_s, config.max_message_bytes, backend_tls, config.backend_tls_server_name, token)
    intervals = {
        "health_interval_s": config.backend_health_interval_s,
        "resolve_interval_s": config.backend_resolve_interval_s,
    }
    # This instance's lease owner id: its sequences on the backends are its own, never a
    # predecessor's, and are freed there if it dies (see specd.rpc.leases).
    lease_owner = uuid.uuid4().hex
    log.info("gateway instance %s", lease_owner)
    # Pools stand where single clients stood: one replica is a pool of one.
    verifier = verifier_pool(config.verifier, *channel, lease_owner=lease_owner, **intervals)
    drafter = (
        drafter_pool(config.drafter, config.drafter_timeout_s, *channel[1:], lease_owner=lease_owner, **intervals)
        if config.drafter and config.num_speculative_tokens > 0
        else None
    )
    return verifier, drafter


def idle_widths(config: GatewayConfig, k_limit: int) -> list[str]:
    """The width flags this gateway takes but can never use, each as a line for its log."""
    flags = [
        ("--speculative-siblings", config.speculative_siblings),
        ("--speculative-branches", config.speculative_branches),
    ]
    if k_limit <= 0:
        return [
            f"{flag} {n} is never used: this gateway drafts nothing (no drafter, or -k 0)" for flag, n in flags if n
        ]
    if config.speculative_branches and config.pipeline not in WIDE_PIPELINES:
        return [
            f"--speculative-branches {config.speculative_branches} applies to requests that name the ahead or auto "
            f"pipeline only: --pipeline is {config.pipeline}"
        ]
    return []


def _start_scheduler(
    config: GatewayConfig, tokenizer: Any, verifier: Any, drafter: Any, eos: Any, tracing: Tracing
) -> Scheduler:
    scheduler = Scheduler(
        tokenizer,
        verifier,
        drafter,
        config.num_speculative_tokens,
        config.max_batch,
        eos,
        tracing=tracing,
        speculative_mode=config.speculative_mode,
        disable_by_batch_size=config.speculative_disable_by_batch_size,
        policy_off=config.heuristics_off,
        max_waiting=config.max_waiting,
        max_sequences_per_key=config.max_sequences_per_key,
        request_timeout_s=config.request_timeout_s,
        pipeline=config.pipeline,
        siblings=config.speculative_siblings,
        branches=config.speculative_branches,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        drafter_overlap=config.drafter_overlap,
    )
    if config.exchange == "direct":
        # The drafter's deadline bounds the verifier's wait for a round's drafts, as it bounds a draft exchange.
        one_hop(scheduler.exchange, verifier, drafter, config.drafter_timeout_s, scheduler.metrics.registry)
    if drafter is not None and drafter.info is not None:
        scheduler.policy.costs.seed_steps((t.sequences, t.forward_ns) for t in drafter.info.step_timings)
    scheduler.metrics.registry.register(PoolCollector([verifier, drafter]))
    for problem in idle_widths(config, scheduler.k_limit):
        log.warning("%s", problem)
    scheduler.start(config.log_stats_interval_s)
    return scheduler


def _health_status(scheduler: Scheduler, verifier: Any, drafter: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """The /health body: the gateway's state and each backend pool's."""

    async def health_status() -> dict[str, Any]:
        verifier_ok = await verifier.healthy()
        status: dict[str, Any] = {
            "status": "draining" if scheduler.draining else "ok" if verifier_ok else "unavailable",
            "verifier": "ok" if verifier_ok else "unavailable",
            "drafter": "disabled",
            "running": scheduler.num_running,
            "waiting": scheduler.num_waiting,
            "verifier_replicas": verifier.status(),
        }
        if drafter is not None and scheduler.drafter_link is not None:
            # Whether the gateway uses the drafter now, not whether it answers a
            # health check: a drafter is taken back only after one.
            link = scheduler.drafter_link
            status["drafter"] = link.status()
            status["drafter_kind"] = common_pb2.DrafterKind.Name(drafter.kind)
            status["drafter_replicas"] = drafter.status()
            status["speculation"] = "on" if link.up else "off (target-only until the drafter is back)"
            if not link.up:
                status["drafter_error"] = link.last_error
        return status

    return health_status


def _openai_api(
    config: GatewayConfig,
    scheduler: Scheduler,
    tokenizer: Any,
    model_name: str,
    health_status: Callable[[], Awaitable[dict[str, Any]]],
) -> OpenAIApi:
    api = OpenAIApi(
        scheduler,
        tokenizer,
        model_name,
        health_status,
        RateLimiter(config.rate_limit),
        config.max_n,
        config.tool_call_parser,
        config.json_undeclared_keys,
        config.chat_template,
        config.per_request_spec_decode_metrics,
    )
    if api.template_tools_problem:
        log.warning(
            'tool_choice "auto" is refused: %s cannot show the model its tools (%s); "required" and named calls work',
            api.template_name,
            api.template_tools_problem,
        )
    return api


async def _start_grpc(
    config: GatewayConfig,
    scheduler: Scheduler,
    tokenizer: Any,
    model_name: str,
    api_keys: tls.ApiKeys,
    api_tls: Any,
) -> grpc.aio.Server:
    """The client-facing gRPC server (GatewayService, health, reflection), started and SERVING."""
    # Innermost last: the key is checked before anything else looks at the request.
    interceptors = [tls.ApiKeyInterceptor(api_keys)] if api_keys.enabled else []
    interceptors.append(DecodeErrorInterceptor())
    # Clients' messages are capped as HTTP bodies are; the backends' channels keep the larger cap.
    options = [
        ("grpc.max_receive_message_length", config.http_max_body_bytes)
        if k == "grpc.max_receive_message_length"
        else (k, v)
        for k, v in channel_options(config.max_message_bytes)
    ] + SERVER_OPTIONS
    grpc_server = grpc.aio.server(options=options, interceptors=interceptors)
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(
            scheduler, tokenizer, model_name, config.max_n, config.json_undeclared_keys, keyed=api_keys.enabled
        ),
        grpc_server,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    name = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
    reflection_v1.enable([name, health.SERVICE_NAME], grpc_server)
    tls.add_port(grpc_server, f"{config.host}:{config.grpc_port}", api_tls)
    await grpc_server.start()
    for service in ("", name):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return grpc_server


def _http_server(config: GatewayConfig, api: OpenAIApi, api_keys: tls.ApiKeys, screen: BodyScreen) -> uvicorn.Server:
    # /health answers probes and /metrics scrapers without a key; neither shows prompts or outputs.
    # The key is checked before the body is read: a caller without one costs nothing.
    limited = http_limits.body_limits(api.app(), config.http_max_body_bytes, config.http_read_timeout_s, screen)
    app = tls.http_api_key_middleware(limited, api_keys, open_paths=("/health", "/metrics"))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.http_port,
            log_level="warning",
            lifespan="off",
            http=http_limits.read_deadline_protocol(config.http_read_timeout_s),
            limit_concurrency=config.http_max_connections or None,
            ssl_certfile=config.tls_cert or None,
            ssl_keyfile=config.tls_key or None,
            # In-flight requests already had the grace period (see drain below).
            timeout_graceful_shutdown=1,
        )
    )
    # uvicorn's own signal handlers would stop only the HTTP side, at once.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    return server


def _drain_on_signals(
    config: GatewayConfig, scheduler: Scheduler, server: uvicorn.Server, grpc_server: grpc.aio.Server | None
) -> None:
    """SIGTERM and SIGINT drain: the first one starts it, later ones are ignored."""
    loop = asyncio.get_running_loop()
    shutdown: list[asyncio.Task[None]] = []

    async def drain() -> None:
        """Stop admitting, give in-flight requests the grace period, fail the rest, then stop serving."""
        log.info("stopping: no new requests; %d in flight get %.0f s", scheduler.num_running, config.shutdown_grace_s)
        scheduler.drain()
        stops = [asyncio.create_task(grpc_server.stop(config.shutdown_grace_s))] if grpc_server else []
        deadline = loop.time() + config.shutdown_grace_s
        while not scheduler.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await scheduler.stop()
        await asyncio.gather(*stops)
        server.should_exit = True

    def on_signal() -> None:
        if not shutdown:
            shutdown.append(asyncio.create_task(drain(), name="specd-drain"))

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on_signal)


def main(argv: Sequence[str] | None = None) -> None:
    config = GatewayConfig.from_args(argv)
    setup_logging(config.log_level)
    try:
        asyncio.run(run(config))
    except (
        BackendError,
        checkpoints.ModelLoadError,
        tls.TlsConfigError,
        tls.ApiKeyError,
        backend_auth.BackendAuthError,
        tool_parsers.ParserUnusable,
        chat_templates.ChatTemplateError,
        PortUnavailable,
    ) as exc:
        log.error("%s", exc)
        sys.exit(2)
    exit_at_once()


if __name__ == "__main__":
    main()
