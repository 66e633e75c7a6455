"""Per-replica series of the backend pools on the gateway's /metrics."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.pool import _Pool


class PoolCollector(Collector):
    """Per-replica gauges on the gateway's /metrics: which replicas are up and how loaded."""

    def __init__(self, pools: Iterable[_Pool | None]) -> None:
        self.pools = [p for p in pools if p is not None]

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        labels = ["service", "address"]
        up = GaugeMetricFamily("specd_backend_up", "1 when the replica takes new sequences", labels=labels)
        open_ = GaugeMetricFamily(
            "specd_backend_open_sequences", "Sequences the gateway has open on the replica", labels=labels
        )
        placed = CounterMetricFamily(
            "specd_backend_sequences_placed", "Sequences the gateway placed on the replica", labels=labels
        )
        owed = GaugeMetricFamily(
            "specd_backend_owed_closes",
            "Closes the replica has not confirmed yet (retried until it does)",
            labels=labels,
        )
        for pool in self.pools:
            for replica in list(pool.replicas.values()):
                key = [pool.service, replica.address]
                up.add_metric(key, 1.0 if replica.up else 0.0)
                open_.add_metric(key, float(len(replica.sequences)))
                placed.add_metric(key, float(replica.placed))
                owed.add_metric(key, float(len(pool.owed.owed(replica))))
        yield from (up, open_, placed, owed)
