"""Prometheus metrics of the operator, served at /metrics by `epd-operator run`."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter("epd_reconciles_total", "EPDDeployment reconciles by result.", ["result"])
RECONCILE_SECONDS = Histogram(
    "epd_reconcile_duration_seconds",
    "Time to validate, render, apply children and write status.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
READY_UNITS = Gauge("epd_ready_units", "Ready EPD units per EPDDeployment.", ["namespace", "name"])
INVALID_SPECS = Gauge("epd_invalid_specs", "EPDDeployments whose spec is invalid.")

_invalid: set[tuple[str, str]] = set()


def observe_reconcile(result: str, seconds: float) -> None:
    RECONCILES.labels(result).inc()
    RECONCILE_SECONDS.observe(seconds)


def set_ready_units(namespace: str, name: str, count: int) -> None:
    READY_UNITS.labels(namespace, name).set(count)


def mark_invalid(namespace: str, name: str) -> None:
    _invalid.add((namespace, name))
    INVALID_SPECS.set(len(_invalid))


def forget_invalid(namespace: str, name: str) -> None:
    _invalid.discard((namespace, name))
    INVALID_SPECS.set(len(_invalid))


def forget(namespace: str, name: str) -> None:
    forget_invalid(namespace, name)
    try:
        READY_UNITS.remove(namespace, name)
    except KeyError:
        pass


def serve(port: int) -> None:
    start_http_server(port)
