"""Several replicas of the drafter or of the verifier behind one client.

`DrafterPool` and `VerifierPool` present the interface the scheduler uses on
`DrafterClient` / `VerifierClient`, so the scheduler batches a round once and
the pool splits it by replica. Each sequence stays on the replica that opened
it for its whole life: the replica's KV cache holds its state. New sequences
go to the healthy replica with the fewest open sequences.

An endpoint is `host:port`, or `dns:///name:port` for every address `name`
resolves to (a Kubernetes headless Service lists one per ready pod); names are
resolved again every `resolve_interval_s`, so pods that appear join and pods
that vanish stop receiving new sequences.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.backends import BackendError, DrafterClient, VerifierClient, describe, round_header
from gateway.endpoints import DNS_SCHEME, Endpoint, Resolver, parse_endpoints, resolve_host
from gateway.owed_closes import OwedCloses
from specd.engine.fingerprint import TokenizerFingerprint
from specd.proto.speculative.v1 import common_pb2, drafter_pb2, verifier_pb2
from specd.rpc.serving import fingerprint_from_pb

log = logging.getLogger(__name__)

# (address, server name for TLS) -> a client of one replica.
ClientFactory = Callable[[str, str], Any]

# How often a backend waited for is asked if it serves: at start, and a replica that served (not refused) once down.
READY_POLL_S = 0.1


@dataclass(eq=False)
class Replica:
    client: Any
    endpoint: Endpoint  # the entry it came from
    up: bool = False  # passed its last health check and serves a compatible model
    admitted: bool = False  # its info was loaded and found compatible with the pool's
    removed: bool = False  # its name no longer resolves to it: no new sequences
    refused: bool = False  # serves a model incompatible with the pool's
    sequences: set[str] = field(default_factory=set)
    placed: int = 0  # sequences ever placed here
    model_id: str = ""  # the model it served when first admitted: it must come back with the same

    @property
    def address(self) -> str:
        return str(self.client.address)

    @property
    def capacity(self) -> int:
        info = self.client.info
        return int(info.max_sequences) if info is not None else 0


class _Pool:
    service = ""
    response_type: Any = None
    items_field = ""  # the reply's per-task field

    def __init__(
        self,
        spec: str,
        factory: ClientFactory,
        health_interval_s: float = 1.5,
        resolve_interval_s: float = 10.0,
        resolver: Resolver = resolve_host,
        timeout_s: float = 5.0,
    ) -> None:
        self.endpoints = parse_endpoints(spec)
        self.timeout_s = timeout_s  # each replica's call deadline (its client has the same)
        if not self.endpoints:
            raise BackendError(f"no {self.service} endpoint given")
        self.address = ",".join(e.address if not e.dns else DNS_SCHEME + e.address for e in self.endpoints)
        self.name = self.service
        self._factory = factory
        self._resolver = resolver
        self.health_interval_s = health_interval_s
        self.resolve_interval_s = resolve_interval_s
        self.replicas: dict[str, Replica] = {}
        self._owner: dict[str, Replica] = {}
        # Closes not confirmed yet: failed in transit, or for opens that failed in transit
        # (a deadline, a stall) and may have opened the sequence all the same.
        self.owed = OwedCloses(self.service)
        # What the gateway started with: a replica that comes back is compared with it.
        self._reference: common_pb2.ModelInfo | None = None
        self._reference_kind = common_pb2.DRAFTER_KIND_UNSPECIFIED
        self._turn = 0  # round-robin among equally loaded replicas
        self.info: common_pb2.ModelInfo | None = None
        self.kind = common_pb2.DRAFTER_KIND_UNSPECIFIED
        self.feature_size = 0  # of the drafter replicas: the hidden-state width they read
        self._monitor: asyncio.Task[None] | None = None
        self._dns_errors: dict[Endpoint, str] = {}

    # -- membership -----------------------------------------------------
    async def resolve(self) -> None:
        """Add replicas for new addresses; retire those a name no longer resolves to."""
        seen: set[str] = set()
        for endpoint in self.endpoints:
            if not endpoint.dns:
                addresses = [endpoint.address]
            else:
                try:
                    addresses = await self._resolver(endpoint.host, endpoint.port)
                except OSError as exc:
                    # A transient DNS failure must not drain every replica of the name. A Service
                    # has no records until its first pod is ready: say so once, not every retry.
                    if self._dns_errors.get(endpoint) != str(exc):
                        log.warning("resolving %s failed: %s; keeping its replicas", endpoint.host, exc)
                    self._dns_errors[endpoint] = str(exc)
                    seen.update(a for a, r in self.replicas.items() if r.endpoint == endpoint)
                    continue
                self._dns_errors.pop(endpoint, None)
            for address in addresses:
                seen.add(address)
                replica = self.replicas.get(address)
                if replica is None:
                    # TLS checks a pod's certificate against the name it was found under, not its IP.
                    client = self._factory(address, endpoint.host if endpoint.dns else "")
                    self.replicas[address] = Replica(client, endpoint)
                    log.info("%s replica %s found", self.service, address)
                elif replica.removed:
                    replica.removed = False
                    log.info("%s replica %s is back in %s", self.service, address, endpoint.host)
        for address, replica in list(self.replicas.items()):
            if address not in seen and not replica.removed:
                replica.removed = True
                replica.up = False
                log.info("%s replica %s no longer resolves; no new sequences go to it", self.service, address)
            if replica.removed and not replica.sequences:
                del self.replicas[address]
                self.owed.forget(replica)
                await replica.client.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until every fixed address and at least one address per name answers SERVING."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self.resolve()
            live = [r for r in self.replicas.values() if not r.removed]
            states = await asyncio.gather(*(r.client.healthy() for r in live))
            healthy = {r.address for r, ok in zip(live, states, strict=True) if ok}
            missing = [e for e in self.endpoints if not self._endpoint_ready(e, healthy)]
            if not missing:
                for r in live:
                    r.up = r.address in healthy
                return
            if loop.time() > deadline:
                names = ", ".join(e.address for e in missing)
                raise BackendError(f"{self.service} at {names} not ready after {timeout_s:.0f}s")
            await asyncio.sleep(READY_POLL_S)

    def _endpoint_ready(self, endpoint: Endpoint, healthy: set[str]) -> bool:
        return any(r.endpoint == endpoint and r.address in healthy for r in self.replicas.values())

    async def load_info(self) -> common_pb2.ModelInfo:
        """Load every ready replica's info; refuse replicas that disagree on the tokenizer or model."""
        ready = [r for r in self.replicas.values() if r.up]
        await asyncio.gather(*(r.client.load_info() for r in ready))
        first = ready[0]
        self._reference = common_pb2.ModelInfo()
        self._reference.CopyFrom(first.client.info)
        self._reference_kind = getattr(first.client, "kind", common_pb2.DRAFTER_KIND_UNSPECIFIED)
        for r in ready[1:]:
            problem = self._incompatibility(first.client, r.client, check_limits=False)
            if problem:
                raise BackendError(
                    f"{self.service} replicas {first.address} and {r.address} differ: {problem}; "
                    f"every {self.service} replica must serve the same model"
                )
        for r in ready:
            r.admitted = True
            r.model_id = r.client.info.model_id
        self.kind = getattr(first.client, "kind", common_pb2.DRAFTER_KIND_UNSPECIFIED)
        self.feature_size = getattr(first.client, "feature_size", 0)
        self.info = self._pool_info()
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name=f"specd-{self.service}-pool")
        return self.info

    def _pool_info(self) -> common_pb2.ModelInfo:
        admitted = [r.client.info for r in self.replicas.values() if r.admitted and not r.removed]
        info = common_pb2.ModelInfo()
        info.CopyFrom(admitted[0])
        # The scheduler caps its batch with max_sequences: the pool holds as many as all replicas together;
        # context and draft length must fit whichever replica a sequence lands on.
        info.max_sequences = sum(i.max_sequences for i in admitted)
        info.max_context = min(i.max_context for i in admitted)
        info.max_draft_tokens = min(i.max_draft_tokens for i in admitted)
        return info

    def _incompatibility(self, reference: Any, other: Any, check_limits: bool) -> str:
        a, b = reference.info, other.info
        fa, fb = fingerprint_from_pb(a.tokenizer), fingerprint_from_pb(b.tokenizer)
        if (fa is None) != (fb is None):
            return "one reports a tokenizer fingerprint and the other none"
        if fa is not None and fb is not None and (diffs := fa.differences(fb)):
            return "tokenizer: " + "; ".join(diffs)
        if a.model_vocab_size != b.model_vocab_size:
            return f"model vocabulary size {a.model_vocab_size} vs {b.model_vocab_size}"
        unspecified = common_pb2.DRAFTER_KIND_UNSPECIFIED  # a verifier has no kind
        kinds = getattr(reference, "kind", unspecified), getattr(other, "kind", unspecified)
        if kinds[0] != kinds[1]:
            return f"drafter kind {common_pb2.DrafterKind.Name(kinds[0])} vs {common_pb2.DrafterKind.Name(kinds[1])}"
        widths = getattr(reference, "feature_size", 0), getattr(other, "feature_size", 0)
        if widths[0] != widths[1]:
            return f"hidden-state width read {widths[0]} vs {widths[1]}"
        # A replica joining later must fit the limits the scheduler already works with.
        if check_limits and self.info is not None:
            if b.max_context < self.info.max_context:
                return f"max_context {b.max_context} is below the pool's {self.info.max_context}"
            if b.max_draft_tokens < self.info.max_draft_tokens:
                return f"max_draft_tokens {b.max_draft_tokens} is below the pool's {self.info.max_draft_tokens}"
        return ""

    @property
    def lease_renew_s(self) -> float:
        """How often to renew leases: a third of the shortest lease any replica grants."""
        leases = [r.client.info.lease_seconds for r in self.replicas.values() if r.client.info is not None]
        shortest = min((t for t in leases if t > 0), default=0.0)
        return shortest / 3 if shortest > 0 else self.health_interval_s

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        resolved_at = renew_at = loop.time()
        while True:
            down = any(not r.up and not r.removed and not r.refused and r.model_id for r in self.replicas.values())
            await asyncio.sleep(min(self.health_interval_s, self.lease_renew_s, READY_POLL_S if down else math.inf))
            try:
                if any(e.dns for e in self.endpoints) and loop.time() - resolved_at >= self.resolve_interval_s:
                    resolved_at = loop.time()
                    await self.resolve()
                live = [r for r in self.replicas.values() if not r.removed]
                await asyncio.gather(*(self._check(r) for r in live))
                if loop.time() >= renew_at:
                    renew_at = loop.time() + self.lease_renew_s
                    await self._renew_leases()
                await self._deliver_owed()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s pool health check failed", self.service)

    async def _check(self, replica: Replica) -> None:
        ok = await replica.client.healthy(timeout_s=max(0.5, min(2.0, self.health_interval_s)))
        if ok and not replica.up:
            # Whatever comes back may be a new pod or a new version: check it again before using it.
            try:
                await replica.client.load_info()
            except Exception as exc:
                log.warning("%s replica %s is serving but its info failed: %s", self.service, replica.address, exc)
                return
            problem = self._returning_problem(replica)
            if problem:
                if not replica.refused:  # once, not at every health check
                    log.error("%s", problem)
                replica.admitted, replica.refused = False, True
                return
            replica.model_id = replica.model_id or replica.client.info.model_id
            replica.admitted, replica.refused, replica.up = True, False, True
            if self.info is not None:
                self.info.max_sequences = sum(
                    r.capacity for r in self.replicas.values() if r.admitted and not r.removed
                )
            log.info("%s replica %s is up", self.service, replica.address)
        elif not ok and replica.up:
            replica.up = False
            log.warning(
                "%s replica %s failed its health check; no new sequences go to it", self.service, replica.address
            )

    def _returning_problem(self, replica: Replica) -> str:
        """Why a replica that (re)appears cannot serve this gateway, as at startup; "" when it can.

        Compared with what the gateway started with, not with other replicas: with one
        replica (the default) there is no other to compare with.
        """
        if self._reference is None:
            return ""
        info = replica.client.info
        started = fingerprint_from_pb(self._reference.tokenizer)
        now = fingerprint_from_pb(info.tokenizer)
        where = f"refusing {self.service} at {replica.address}"
        if started is not None and now is None:
            return f"{where}: it reports no tokenizer fingerprint; the gateway started with one"
        if started is not None and now is not None and (diffs := now.differences(started)):
            whose = "the verifier's" if self.service == "drafter" else "the gateway's"
            return (
                f"{where}: its tokenizer differs from {whose} (" + "; ".join(diffs) + f"); a {self.service} that "
                "comes back must serve the tokenizer the gateway started with"
            )
        if replica.model_id and info.model_id != replica.model_id:
            return (
                f"{where}: it came back serving model {info.model_id!r}, not {replica.model_id!r} as when the "
                "gateway admitted it; restart the gateway to change models"
            )
        reference = _Snapshot(self._reference, self._reference_kind, self.feature_size)
        problem = self._incompatibility(reference, replica.client, True)
        return f"{where}: {problem}; every {self.service} replica must serve the same model" if problem else ""

    async def _renew_leases(self) -> None:
        """Keep this gateway's lease on its sequences alive on every replica, rounds or not."""
        live = [r for r in self.replicas.values() if r.up and hasattr(r.client, "keep_alive")]
        outcomes = await asyncio.gather(*(r.client.keep_alive() for r in live), return_exceptions=True)
        for replica, outcome in zip(live, outcomes, strict=True):
            if isinstance(outcome, Exception):
                log.debug("keep-alive to %s failed: %s", replica.address, describe(outcome))

    async def _deliver_owed(self) -> None:
        up = [r for r in self.replicas.values() if r.up and self.owed.owed(r)]
        await asyncio.gather(*(self.owed.deliver(r, r.client) for r in up))

    def _mark_down(self, replica: Replica, exc: BaseException) -> None:
        if replica.up:
            log.warning(
                "%s replica %s failed: %s; no new sequences go to it until it is healthy again",
                self.service,
                replica.address,
                exc if isinstance(exc, BackendError) else describe(exc),
            )
        replica.up = False

    # -- the interface the scheduler uses -------------------------------
    @property
    def fingerprint(self) -> TokenizerFingerprint | None:
        return fingerprint_from_pb(self.info.tokenizer) if self.info is not None else None

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether any replica can take sequences (the background checks' latest view)."""
        return any(r.up for r in self.replicas.values())

    async def open(self, specs: list[common_pb2.SequenceSpec]) -> list[common_pb2.OpenResult]:
        results: dict[str, common_pb2.OpenResult] = {}
        pending = list(specs)
        failed: set[Replica] = set()
        last_error: BaseException | None = None
        while pending:
            groups = self._place(pending, failed)
            if not groups:
                break
            outcomes = await asyncio.gather(
                *(self._open_on(r, batch) for r, batch in groups.items()), return_exceptions=True
            )
            pending = []
            for (replica, batch), outcome in zip(groups.items(), outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if not isinstance(outcome, Exception):
                        raise outcome
                    # Its sequences try the remaining replicas; it may have opened them all the same.
                    self.owed.add(replica, (spec.sequence_id for spec in batch))
                    self._mark_down(replica, outcome)
                    failed.add(replica)
                    pending.extend(batch)
                    last_error = outcome
                    continue
                for spec, result in zip(batch, outcome, strict=True):
                    if not result.error.code:
                        replica.sequences.add(spec.sequence_id)
                        replica.placed += 1
                        self._owner[spec.sequence_id] = replica
                    results[spec.sequence_id] = result
        if pending:
            reason = describe(last_error) if last_error is not None else "none is available"
            if not results:
                raise BackendError(f"no {self.service} replica could open the sequences: {reason}")
            for spec in pending:
                results[spec.sequence_id] = common_pb2.OpenResult(
                    sequence_id=spec.sequence_id,
                    error=common_pb2.SequenceError(
                        code=common_pb2.ERROR_CODE_UNAVAILABLE,
                        message=f"no {self.service} replica could open it: {reason}",
                    ),
                )
        return [results[s.sequence_id] for s in specs]

    async def _open_on(self, replica: Replica, batch: list[common_pb2.SequenceSpec]) -> Any:
        # A close still owed for one of these ids must land first, or it would close the new sequence.
        if not await self.owed.deliver(replica, replica.client, (s.sequence_id for s in batch)):
            raise BackendError(f"closes owed to {replica.address} could not be delivered before an open")
        return await replica.client.open(batch)

    def _place(self, specs: list[common_pb2.SequenceSpec], excluded: set[Replica]) -> dict[Replica, list[Any]]:
        """Assign each spec to the least loaded usable replica, counting this batch's own placements."""
        usable = [r for r in self.replicas.values() if r.admitted and not r.removed and r not in excluded]
        candidates = [r for r in usable if r.up] or usable  # none healthy: try anyway rather than refuse
        if not candidates:
            return {}
        load = {r: len(r.sequences) for r in candidates}
        groups: dict[Replica, list[Any]] = {}
        for spec in specs:
            with_room = [r for r in candidates if load[r] < r.capacity] or candidates
            least = min(load[r] for r in with_room)
            tied = [r for r in with_room if load[r] == least]
            chosen = tied[self._turn % len(tied)]
            self._turn += 1
            load[chosen] += 1
            groups.setdefault(chosen, []).append(spec)
        return groups

    def replica_of(self, sequence_id: str) -> str | None:
        replica = self._owner.get(sequence_id)
        return replica.address if replica is not None else None

    def reset_rounds(self) -> None:
        """Drop every replica's round stream: the next round starts on fresh ones."""
        for replica in self.replicas.values():
            replica.client.reset_rounds()

    async def close_sequences(self, ids: list[str], **drafter_kw: Any) -> None:
        """Close sequences where they live (`drafter_kw`: its `tails`); a failed close is owed and retried."""
        groups: dict[Replica, list[str]] = {}
        for sid in ids:
            replica = self._owner.pop(sid, None)
            if replica is not None:
                replica.sequences.discard(sid)
                groups.setdefault(replica, []).append(sid)
        outcomes = await asyncio.gather(
            *(r.client.close_sequences(batch, missing_ok=True, **drafter_kw) for r, batch in groups.items()),
            return_exceptions=True,
        )
        errors = []
        for (replica, batch), outcome in zip(groups.items(), outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.owed.add(replica, batch)
                errors.append(outcome)
        for replica in [r for r in groups if r.removed and not r.sequences and not self.owed.owed(r)]:
            self.replicas.pop(replica.address, None)
            await replica.client.close()
        if errors:
            raise BackendError(
                f"closing sequences on the {self.service} failed: {describe(errors[0])}; retrying in the background"
            )

    async def _round(self, request: Any, call: Callable[[Any, Any], Awaitable[Any]]) -> Any:
        """Split one round by replica, run the parts concurrently, reassemble in task order.

        A replica that fails costs only its own sequences (per-task errors); when
        every replica in the round fails, the round fails as a single backend's would.
        """
        groups: dict[Replica, list[int]] = {}
        unknown: list[int] = []
        for i, task in enumerate(request.tasks):
            replica = self._owner.get(task.sequence_id)
            if replica is None:
                unknown.append(i)
            else:
                groups.setdefault(replica, []).append(i)
        if len(groups) == 1 and not unknown:
            (replica,) = groups
            try:
                return await call(replica.client, request)
            except BackendError as exc:
                self._mark_down(replica, exc)
                raise
        parts = []
        for idx in groups.values():
            part = round_header(request)
            part.tasks.extend(request.tasks[i] for i in idx)
            parts.append(part)
        outcomes = await asyncio.gather(
            *(call(r.client, part) for r, part in zip(groups, parts, strict=True)), return_exceptions=True
        )
        reply = self.response_type(round_id=request.round_id)
        items: list[Any] = [None] * len(request.tasks)
        failures: list[str] = []
        for (replica, idx), outcome in zip(groups.items(), outcomes, strict=True):
            got = getattr(outcome, self.items_field, None) if not isinstance(outcome, BaseException) else None
            if got is None or len(got) != len(idx):
                if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome
                problem = describe(outcome) if isinstance(outcome, BaseException) else "a reply of the wrong length"
                self._mark_down(replica, outcome if isinstance(outcome, BaseException) else BackendError(problem))
                failures.append(f"{replica.address}: {problem}")
                for i in idx:
                    items[i] = self._error_item(
                        request.tasks[i].sequence_id,
                        common_pb2.ERROR_CODE_UNAVAILABLE,
                        f"{self.service} replica {replica.address} failed: {problem}",
                    )
                continue
            for i, item in zip(idx, got, strict=True):
                items[i] = item
            # The round waits for the slowest replica.
            t = outcome.timings
            reply.timings.queue_ns = max(reply.timings.queue_ns, t.queue_ns)
            reply.timings.forward_ns = max(reply.timings.forward_ns, t.forward_ns)
            reply.timings.total_ns = max(reply.timings.total_ns, t.total_ns)
        if groups and len(failures) == len(groups):
            raise BackendError(f"every {self.service} replica of the round failed: " + "; ".join(failures))
        for i in unknown:
            items[i] = self._error_item(
                request.tasks[i].sequence_id,
                common_pb2.ERROR_CODE_NOT_FOUND,
                f"the sequence is not open on any {self.service} replica",
            )
        getattr(reply, self.items_field).extend(items)
        return reply

    def _error_item(self, sequence_id: str, code: int, message: str) -> Any:
        raise NotImplementedError

    def status(self) -> list[dict[str, Any]]:
        """Per-replica state for /health."""
        return [
            {
                "address": r.address,
                "healthy": r.up,
                "open_sequences": len(r.sequences),
                **({"draining": True} if r.removed else {}),
                **({"refused": True} if r.refused else {}),
            }
            for r in self.replicas.values()
        ]

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        for replica in self.replicas.values():
            await replica.client.close()


class VerifierPool(_Pool):
    service = "verifier"
    response_type = verifier_pb2.VerifyResponse
    items_field = "results"

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        return await self._round(request, lambda client, part: client.verify(part))

    def _error_item(self, sequence_id: str, code: int, message: str) -> verifier_pb2.VerifyResult:
        return verifier_pb2.VerifyResult(
            sequence_id=sequence_id, error=common_pb2.SequenceError(code=code, message=message)
        )


class DrafterPool(_Pool):
    service = "drafter"
    response_type = drafter_pb2.DraftResponse
    items_field = "proposals"

    async def draft(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        return await self._round(request, lambda client, part: client.draft(part))

    def _error_item(self, sequence_id: str, code: int, message: str) -> drafter_pb2.DraftProposal:
        return drafter_pb2.DraftProposal(
            sequence_id=sequence_id, error=common_pb2.SequenceError(code=code, message=message)
        )


@dataclass(frozen=True)
class _Snapshot:
    """A replica's info and kind as the gateway first saw them, shaped like a client."""

    info: common_pb2.ModelInfo
    kind: int
    feature_size: int = 0


P = TypeVar("P", "VerifierPool", "DrafterPool")


def _pool(
    pool_cls: type[P],
    client_cls: type[VerifierClient] | type[DrafterClient],
    spec: str,
    timeout_s: float,
    max_message_bytes: int,
    credentials: Any = None,
    server_name: str = "",
    token: str = "",
    lease_owner: str = "",
    **options: Any,
) -> P:
    def factory(address: str, name_hint: str) -> Any:
        return client_cls(
            address, timeout_s, max_message_bytes, credentials, server_name or name_hint, lease_owner, token
        )

    return pool_cls(spec, factory, timeout_s=timeout_s, **options)


def verifier_pool(spec: str, *args: Any, **options: Any) -> VerifierPool:
    """A pool of verifiers; arguments as their clients take them, plus the pool's options."""
    return _pool(VerifierPool, VerifierClient, spec, *args, **options)


def drafter_pool(spec: str, *args: Any, **options: Any) -> DrafterPool:
    """A pool of drafters; arguments as their clients take them, plus the pool's options."""
    return _pool(DrafterPool, DrafterClient, spec, *args, **options)
