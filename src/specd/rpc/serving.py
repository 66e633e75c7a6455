"""What the gRPC services share: server setup, health, reflection, error mapping (metrics: service_metrics)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import SpanKind

from specd.engine.checkpoints import ModelLoadError
from specd.engine.errors import EngineError, ErrorKind
from specd.engine.fingerprint import TokenizerFingerprint
from specd.engine.params import LogprobsRequest, Penalties, SamplingParams, TokenLogprob
from specd.engine.tasks import RoundTiming, SequenceSpec, SparseDist
from specd.ports import SERVER_OPTIONS, PortUnavailable, check_free, write_port_file
from specd.proto.speculative.v1 import common_pb2
from specd.rpc import backend_auth
from specd.rpc.leases import Leases, bad_owner, engine_id, public_message
from specd.rpc.service_metrics import ServiceMetrics
from specd.rpc.tls import add_port, server_credentials
from specd.rpc.tracing import Tracing

log = logging.getLogger(__name__)
R = TypeVar("R")

STATUS = {
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
WIRE_CODE = {
    ErrorKind.NOT_FOUND: common_pb2.ERROR_CODE_NOT_FOUND,
    ErrorKind.INVALID_ARGUMENT: common_pb2.ERROR_CODE_INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
    ErrorKind.FAILED_PRECONDITION: common_pb2.ERROR_CODE_FAILED_PRECONDITION,
    ErrorKind.INTERNAL: common_pb2.ERROR_CODE_INTERNAL,
}
KIND_OF_WIRE = {v: k for k, v in WIRE_CODE.items()}


# The presence streams held open now (SequenceRpcs.attach): a stopping server ends them, or its
# grace period would wait them out.
_PRESENCE: set[asyncio.Future[None]] = set()


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # A client channel to a restarted (or still starting) service reconnects within about half
        # a second of its port opening, not after gRPC's default backoff of up to two minutes: an
        # attempt at a closed port costs next to nothing.
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 500),
    ]


def sequence_error(exc: EngineError | None) -> common_pb2.SequenceError | None:
    if exc is None:
        return None
    return common_pb2.SequenceError(code=WIRE_CODE[exc.kind], message=exc.message)


def fingerprint_pb(fp: TokenizerFingerprint | None) -> common_pb2.TokenizerFingerprint | None:
    if fp is None:
        return None
    return common_pb2.TokenizerFingerprint(
        vocab_size=fp.vocab_size,
        vocab_sha256=fp.vocab_sha256,
        special_token_ids=fp.special_token_ids,
        end_token_ids=fp.end_token_ids,
        special_ids=fp.special_ids,
    )


def fingerprint_from_pb(msg: common_pb2.TokenizerFingerprint) -> TokenizerFingerprint | None:
    if not msg.vocab_sha256:
        return None
    return TokenizerFingerprint(
        msg.vocab_size,
        msg.vocab_sha256,
        dict(msg.special_token_ids),
        tuple(sorted(msg.end_token_ids)),
        tuple(sorted(msg.special_ids)),
    )


def sampling_from_pb(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
    )


def sampling_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def penalties_from_pb(msg: common_pb2.SamplingParams) -> Penalties:
    # 0 on the wire is "unset" for the repetition penalty, whose neutral value is 1.
    return Penalties.of(
        msg.presence_penalty,
        msg.frequency_penalty,
        msg.repetition_penalty or 1.0,
        dict(msg.logit_bias),
        msg.min_tokens,
        list(msg.min_tokens_eos_ids),
    )


def add_penalties_pb(msg: common_pb2.SamplingParams, penalties: Penalties) -> common_pb2.SamplingParams:
    msg.presence_penalty = penalties.presence
    msg.frequency_penalty = penalties.frequency
    msg.repetition_penalty = penalties.repetition
    msg.logit_bias.update(dict(penalties.logit_bias))
    msg.min_tokens = penalties.min_tokens
    msg.min_tokens_eos_ids.extend(penalties.eos)
    return msg


def logprobs_request_pb(request: LogprobsRequest | None) -> common_pb2.LogprobsRequest | None:
    if request is None:
        return None
    return common_pb2.LogprobsRequest(top_logprobs=request.top, prompt=request.prompt)


def token_logprob_pb(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_ids, top_logprobs=lp.top_logprobs
    )


def token_logprob_from_pb(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple(msg.top_token_ids), tuple(msg.top_logprobs))


def spec_from_pb(msg: common_pb2.SequenceSpec) -> SequenceSpec:
    logprobs = msg.logprobs if msg.HasField("logprobs") else None
    return SequenceSpec(
        msg.sequence_id,
        list(msg.prompt_token_ids),
        sampling_from_pb(msg.sampling),
        penalties_from_pb(msg.sampling),
        msg.num_generated,
        LogprobsRequest(logprobs.top_logprobs, logprobs.prompt) if logprobs is not None else None,
        msg.json_schema,
        msg.prefill_tokens if msg.HasField("prefill_tokens") else None,
        msg.grammar,
        msg.tenant,
        tuple(msg.end_token_ids),
    )


def dist_from_pb(msg: common_pb2.SparseDistribution) -> SparseDist:
    return SparseDist(list(msg.token_ids), list(msg.probs))


class EngineRunner:
    """Runs all torch work of a service on one dedicated thread.

    Engines are not thread-safe and their forwards block, so the event loop
    hands them to this thread and stays free for health checks, new streams and
    cancellations. Model loading must run here too (`call`): each thread that
    runs torch ops gets its own OpenMP team, and with two teams on a small
    machine libgomp throttles its spinning and every step gets slower (measured
    here: an int8 draft step 23 ms on one thread, 42 ms once a second thread had
    run torch ops).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """Run fn on the engine thread and wait (for startup, outside the event loop)."""
        return self._pool.submit(fn, *args).result()

    async def run(self, fn: Callable[..., R], *args: Any) -> tuple[R, int]:
        """Returns fn's result and the ns it waited for the worker (queue time)."""
        submitted = time.perf_counter_ns()
        started: list[int] = []

        def call() -> R:
            started.append(time.perf_counter_ns())
            return fn(*args)

        result = await asyncio.get_running_loop().run_in_executor(self._pool, call)
        return result, started[0] - submitted

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceRpcs:
    """Open/close handling shared by the drafter and verifier servicers.

    The engine sees each sequence under its owner's namespace (see specd.rpc.leases);
    the wire carries the caller's own ids.
    """

    engine: Any
    runner: EngineRunner
    tracing: Tracing
    metrics: ServiceMetrics
    leases: Leases

    async def open_sequences(
        self, sequences: Iterable[common_pb2.SequenceSpec], owner: str
    ) -> list[common_pb2.OpenResult]:
        sequences = list(sequences)
        wire = [spec_from_pb(s) for s in sequences]
        if problem := bad_owner(owner):
            error = common_pb2.SequenceError(code=common_pb2.ERROR_CODE_INVALID_ARGUMENT, message=problem)
            return [common_pb2.OpenResult(sequence_id=s.sequence_id, error=error) for s in wire]
        self.leases.renew(owner)
        # An empty id stays empty, for the engine to refuse as it would without owners.
        specs = [dataclasses.replace(s, sequence_id=s.sequence_id and engine_id(owner, s.sequence_id)) for s in wire]
        take = getattr(self.engine, "take_prompt_logprobs", None)  # a verifier's: prompt logprobs when asked for

        def open_all() -> tuple[list[EngineError | None], list[list[TokenLogprob]], list[int], list[int], int]:
            errors, forward_ns = open_leased(self.engine, self.leases, owner, specs)
            scored = [take(s.sequence_id) if take and e is None else [] for s, e in zip(specs, errors, strict=True)]
            table = self.engine.table
            states = [table.seqs[s.sequence_id] if e is None else None for s, e in zip(specs, errors, strict=True)]
            cached = [len(state.cached) if state else 0 for state in states]
            self.metrics.observe_open(sum(cached), forward_ns)
            return errors, scored, [table.pending(state) if state else 0 for state in states], cached, forward_ns

        arrived = time.time_ns()
        (errors, scored, pending, cached, forward_ns), queue_ns = await self.runner.run(open_all)
        if self.tracing.enabled:
            contexts = [dict(s.trace_context) for s in sequences]
            attributes = {
                "specd.batch_size": len(wire),
                "specd.forward_ms": forward_ns / 1e6,
                "specd.queue_ms": queue_ns / 1e6,
            }
            per_sequence = [
                {
                    **attributes,
                    "specd.prompt_tokens": len(s.prompt),
                    "specd.prefilled": n,
                    "specd.error": bool(e),
                }
                for s, n, e in zip(wire, cached, errors, strict=True)
            ]
            self.tracing.record_opens(f"{self.runner.name}.open", contexts, per_sequence, arrived, time.time_ns())
        return [
            common_pb2.OpenResult(
                sequence_id=s.sequence_id,
                error=self.wire_error(e, owner),
                prompt_logprobs=[token_logprob_pb(lp) for lp in lps],
                prefill_pending=n,
            )
            for s, e, lps, n in zip(wire, errors, scored, pending, strict=True)
        ]

    def round_ids(self, owner: str, sequence_ids: Iterable[str]) -> list[str]:
        """The engine's ids for one round's tasks; the round renews the owner's lease."""
        self.leases.renew(owner)
        return [engine_id(owner, sid) for sid in sequence_ids]

    @staticmethod
    def wire_error(exc: EngineError | None, owner: str) -> common_pb2.SequenceError | None:
        if exc is None:
            return None
        return common_pb2.SequenceError(code=WIRE_CODE[exc.kind], message=public_message(exc.message, owner))

    async def keep_alive(self, owner: str, context: grpc.aio.ServicerContext) -> common_pb2.KeepAliveResponse:
        if problem := bad_owner(owner):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.leases.renew(owner)
        return common_pb2.KeepAliveResponse(open_sequences=self.leases.count(owner), lease_seconds=self.leases.lease_s)

    async def attach(self, owner: str, context: grpc.aio.ServicerContext) -> AsyncIterator[common_pb2.AttachResponse]:
        """Hold the caller's presence stream open until it goes (its cancellation ends this)."""
        if problem := bad_owner(owner):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.leases.attach(owner)
        held = asyncio.get_running_loop().create_future()
        _PRESENCE.add(held)
        try:
            yield common_pb2.AttachResponse(detach_seconds=self.leases.detach_s)
            await held
        finally:
            _PRESENCE.discard(held)
            self.leases.detach(owner)

    async def run_round(
        self,
        span_name: str,
        round_id: int,
        tasks: Sequence[Any],
        contexts: Sequence[Mapping[str, str]],
        work: Callable[[Sequence[Any]], tuple[list[Any], RoundTiming]],
        failed: Callable[[str, EngineError], Any],
        span_attributes: Callable[[Any, Any], dict[str, Any]],
    ) -> tuple[list[Any], common_pb2.ServiceTimings]:
        """One batched round on the engine thread: results, metrics, spans and the reply's timings."""
        arrived, arrived_wall = time.perf_counter_ns(), time.time_ns()
        timing: RoundTiming | None = None
        try:
            (results, timing), queue_ns = await self.runner.run(work, tasks)
        except Exception as exc:  # one bad round must not end the stream for every sequence
            log.exception("%s round %d failed", span_name, round_id)
            error = EngineError(ErrorKind.INTERNAL, f"{span_name} failed: {exc}")
            results, queue_ns = [failed(t.sequence_id, error) for t in tasks], 0
        self.metrics.observe(timing)
        if self.tracing.enabled:
            shared = {"specd.round_id": round_id, "specd.batch_size": len(tasks), "specd.queue_ms": queue_ns / 1e6}
            attributes = [{**shared, **span_attributes(t, r)} for t, r in zip(tasks, results, strict=True)]
            trace_round(self.tracing, span_name, contexts, attributes, arrived_wall, time.time_ns(), timing)
        return results, common_pb2.ServiceTimings(
            queue_ns=queue_ns,
            forward_ns=timing.forward_ns if timing is not None else 0,
            total_ns=time.perf_counter_ns() - arrived,
        )

    async def close_sequences(
        self, ids: Iterable[str], owner: str, missing_ok: bool, context: grpc.aio.ServicerContext, tails: Any = None
    ) -> int:
        if problem := bad_owner(owner):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        keys = [engine_id(owner, sid) for sid in ids]
        keyed = {engine_id(owner, sid): tail for sid, tail in (tails or {}).items()}
        self.leases.renew(owner)
        (closed, error), _ = await self.runner.run(close_present, self.engine, self.leases, keys, missing_ok, keyed)
        if error is not None:
            await context.abort(STATUS[error.kind], public_message(error.message, owner))
        return closed


def open_leased(
    engine: Any, leases: Leases, owner: str, specs: list[SequenceSpec]
) -> tuple[list[EngineError | None], int]:
    """On the engine thread: open, and enter what opened in the owner's lease in the same step;
    returns the per-spec errors and the prefill's forward ns.

    A gateway that dies mid-open cancels the RPC, but not the engine's work: recorded
    here, what it opened still expires with its lease.
    """
    errors, forward_ns = engine.open(specs)
    leases.opened(owner, [s.sequence_id for s, e in zip(specs, errors, strict=True) if e is None])
    return errors, forward_ns


def close_present(
    engine: Any, leases: Leases, keys: list[str], missing_ok: bool, tails: Mapping[str, Any] | None = None
) -> tuple[int, EngineError | None]:
    """On the engine thread: close `keys` (only those open when missing_ok; a drafter's `tails` with
    them); returns the count closed and the engine's refusal if any. Closed ones leave their lease."""
    open_now = engine.table.seqs
    targets = [k for k in keys if k in open_now] if missing_ok else keys
    closed, error = 0, None
    try:
        closed = (engine.close(targets, tails=tails) if tails else engine.close(targets)) if targets else 0
    except EngineError as exc:
        error = exc
    leases.closed(k for k in keys if k not in open_now)
    return closed, error


# How often the leases are looked at for owners that lapsed or left.
EXPIRY_INTERVAL_S = 0.1


async def expire_leases(
    service: str, leases: Leases, engine: Any, runner: EngineRunner, metrics: ServiceMetrics
) -> None:
    """Free the sequences of owners that stopped renewing their lease (a gateway cut off) or whose
    presence streams all ended (a gateway that died)."""
    # Often enough that a detached owner's sequences go within detach_s + interval_s; a look is a
    # scan of the owners (a handful of gateways), so a short interval costs nothing worth saving.
    interval_s = min(EXPIRY_INTERVAL_S, leases.lease_s / 4) if leases.lease_s > 0 else EXPIRY_INTERVAL_S
    while True:
        await asyncio.sleep(interval_s)
        keys = leases.expired()
        if not keys:
            continue
        (closed, _), _ = await runner.run(close_present, engine, leases, keys, True)
        metrics.expired.inc(closed)
        log.warning(
            "%s: freed %d sequences of %d lease owner(s) disconnected for %.0f s or not heard from for %.0f s",
            service,
            closed,
            len({k.split("/", 1)[0] for k in keys}),
            leases.detach_s,
            leases.lease_s,
        )


def trace_round(
    tracing: Tracing,
    name: str,
    contexts: Sequence[Mapping[str, str]],
    attributes: Sequence[Mapping[str, Any]],
    start_ns: int,
    end_ns: int,
    timing: RoundTiming | None,
) -> None:
    """Record this service's share of a round in each traced sequence's trace.

    One span per traced sequence (`<service>.<verb>`, under the gateway's round
    span for that sequence) with the batch's phases as children: the forward
    pass is shared, but each request's trace then shows where its round went.
    """
    service = name.split(".")[0]
    phases, attributes_of = (timing.phases, timing.phase_attributes) if timing is not None else ([], {})
    for carrier, attrs in zip(contexts, attributes, strict=True):
        parent = tracing.extract(carrier)
        if parent is None:
            continue
        span = tracing.start(name, parent, start_ns, attrs, kind=SpanKind.SERVER)
        steps = 0
        for index, (phase, a, b) in enumerate(phases):
            extra: dict[str, Any] = dict(attributes_of.get(index, {}))
            if phase == "step":
                extra = {"specd.step": steps}
                steps += 1
            tracing.record(f"{service}.{phase}", span, a, b, extra)
        span.end(end_time=end_ns)


def run_service(
    name: str,
    config: Any,
    build: Callable[[Any], tuple[Any, common_pb2.ModelInfo]],
    register: Callable[
        [grpc.aio.Server, Any, common_pb2.ModelInfo, EngineRunner, Tracing, ServiceMetrics, Leases], Iterable[str]
    ],
) -> None:
    """Load a service's engine on its engine thread, then serve until SIGTERM/SIGINT."""
    setup_logging(config.log_level)
    tracing = Tracing(f"specd-{name}", config.otlp_endpoint, config.trace_file)
    kind = getattr(config, "drafter", "model")  # a model-free drafter reads only the model's tokenizer
    what = f"model {config.model}" if kind == "model" else f"{kind}, model-free (the tokenizer of {config.model})"
    log.info("loading the %s: %s on %s", name, what, config.device)
    runner = EngineRunner(name)
    try:
        # Before the model loads: a bad certificate path should not cost a model load.
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        tokens = backend_auth.load_tokens(config.backend_token, config.backend_token_file)
        log.info("clients: %s", client_authentication(config.host, bool(tokens), bool(config.tls_client_ca)))
        check_free({name: (config.host, config.port), "metrics": (config.host, config.metrics_port)})
    except (ValueError, PortUnavailable) as exc:
        log.error("cannot start the %s: %s", name, exc)
        sys.exit(2)

    def load() -> tuple[Callable[[grpc.aio.Server], Iterable[str]], Callable[[], Awaitable[None]]]:
        try:
            engine, info = runner.call(build, config)
        except (ModelLoadError, ValueError, PortUnavailable) as exc:
            log.error("cannot start the %s: %s", name, exc)
            sys.exit(2)
        log.info("%s", kv_cache_summary(engine.table))
        if info.weights:
            log.warning("the %s serves %s weights: its text is meaningless, only its speed is real", name, info.weights)
        info.lease_seconds = config.lease_s
        leases = Leases(config.lease_s)
        metrics = ServiceMetrics(name, engine)
        if config.metrics_port:
            metrics.serve(config.host, config.metrics_port)
        return (
            lambda server: register(server, engine, info, runner, tracing, metrics, leases),
            lambda: expire_leases(name, leases, engine, runner, metrics),
        )

    listen = Listen(config.host, config.port, config.port_file, credentials)
    asyncio.run(serve(name, listen, config.max_message_bytes, load, backend_auth.server_interceptors(tokens)))
    tracing.shutdown()
    exit_at_once()


def exit_at_once(code: int = 0) -> NoReturn:
    """End a stopped service's process once its logs and output are flushed, without the interpreter's
    teardown: freeing torch's and transformers' object graphs one by one is most of a stop, which
    every supervised restart and every Ctrl-C of `specd up` would wait out."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def kv_cache_summary(table: Any) -> str:
    """What the KV cache reserves, for the startup log."""
    reserved = table.kv_reserved_bytes()
    if table.lm is None:
        return "KV cache: none (a model-free drafter)"
    cache = table.lm.cache
    backing = (
        "pages are backed as sequences write them and handed back when they close"
        if cache.lazy
        else "allocated up front"
    )
    branches = getattr(table, "branch_slots", 0)
    slots = f"{table.max_sequences} sequences" + (f" + {branches} fan-out branches" if branches else "")
    return (
        f"KV cache: {reserved} bytes ({reserved / 2**30:.2f} GiB) reserved for {slots} x "
        f"{cache.max_positions} positions x {cache.bytes_per_token()} bytes/token; {backing}"
    )


def client_authentication(host: str, token: bool, mutual_tls: bool) -> str:
    """How this service knows its caller is the gateway, for the startup log."""
    ways = [w for w, on in (("a backend token", token), ("mutual TLS", mutual_tls)) if on]
    if ways:
        return "only the gateway, by " + " and ".join(ways)
    if backend_auth.is_loopback(host):
        return f"any local process (no token, no mutual TLS; {host} is loopback)"
    return f"ANYONE who reaches {host} (--insecure: no token, no mutual TLS)"


@dataclasses.dataclass(frozen=True)
class Listen:
    """Where a service listens: port 0 takes one the OS picks; `port_file`, if set, gets the port
    bound, written before the model loads (the port is the service's from then on)."""

    host: str
    port: int
    port_file: str = ""
    credentials: grpc.ServerCredentials | None = None


async def serve(
    name: str,
    listen: Listen,
    max_message_bytes: int,
    load: Callable[[], tuple[Callable[[grpc.aio.Server], Iterable[str]], Callable[[], Awaitable[None]] | None]],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    grace_s: float = 5.0,
) -> None:
    """Bind the port, `load` the engine (its servicers' registration and a background task), then
    serve gRPC (TLS with credentials) with health checking and reflection until SIGTERM/SIGINT."""
    options = channel_options(max_message_bytes) + SERVER_OPTIONS
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    try:
        port = add_port(server, f"{listen.host}:{listen.port}", listen.credentials)
    except PortUnavailable as exc:  # taken since run_service's check
        log.error("cannot start the %s: %s", name, exc)
        sys.exit(2)
    if listen.port_file:
        write_port_file(listen.port_file, port)
    register, background = load()
    service_names = list(register(server))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    await server.start()
    for service in ["", *service_names]:
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    secure = "TLS" if listen.credentials is not None else "plaintext"
    log.info("%s serving on %s:%d (%s)", name, listen.host, port, secure)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(background(), name=f"specd-{name}-background") if background is not None else None
    await stop.wait()
    log.info("%s stopping", name)
    if task is not None:
        task.cancel()
    for held in list(_PRESENCE):
        if not held.done():
            held.set_result(None)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
