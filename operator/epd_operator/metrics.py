"""Prometheus metrics of the operator, served at /metrics by `epd-operator run`."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)


class OperatorMetrics:
    """The operator's metrics, in a registry of their own (plus the usual process_* ones)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._reconciles = Counter(
            "epd_reconciles_total", "EPDDeployment reconciles by result.", ["result"], registry=self.registry
        )
        self._reconcile_seconds = Histogram(
            "epd_reconcile_duration_seconds",
            "Time to validate, render, apply children and write status.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self._stage_seconds = Histogram(
            "epd_reconcile_stage_duration_seconds",
            "Time of one stage of a reconcile: plan (validate and render, cached per generation), "
            "children (children created, applied or deleted; only reconciles that wrote) and status "
            "(only those that patched it).",
            ["stage"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self._ready_units = Gauge(
            "epd_ready_units", "Ready EPD units per EPDDeployment.", ["namespace", "name"], registry=self.registry
        )
        self._desired_units = Gauge(
            "epd_desired_units",
            "EPD units each EPDDeployment asks for (every model's replicas).",
            ["namespace", "name"],
            registry=self.registry,
        )
        self._invalid_specs = Gauge(
            "epd_invalid_specs", "EPDDeployments whose spec is invalid.", registry=self.registry
        )
        self._invalid: set[tuple[str, str]] = set()

    def observe_reconcile(self, result: str, seconds: float) -> None:
        self._reconciles.labels(result).inc()
        self._reconcile_seconds.observe(seconds)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self._stage_seconds.labels(stage).observe(seconds)

    def set_units(self, namespace: str, name: str, *, ready: int, desired: int) -> None:
        self._ready_units.labels(namespace, name).set(ready)
        self._desired_units.labels(namespace, name).set(desired)

    def mark_invalid(self, namespace: str, name: str) -> None:
        self._invalid.add((namespace, name))
        self._invalid_specs.set(len(self._invalid))

    def forget_invalid(self, namespace: str, name: str) -> None:
        self._invalid.discard((namespace, name))
        self._invalid_specs.set(len(self._invalid))

    def forget(self, namespace: str, name: str) -> None:
        """The EPDDeployment is gone: drop its series."""
        self.forget_invalid(namespace, name)
        for gauge in (self._ready_units, self._desired_units):
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
