"""The chart's Grafana dashboard and PodMonitor, checked against what really exists.

Every panel's PromQL must name only metrics that something in an EPD deployment exports: the
real vLLM engine (its names recorded from a real engine by tests/node/test_janitor.py
into ENGINE_METRICS), the EC janitor, the EPD proxy or the operator (read from their registries).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client import CollectorRegistry

from epd_dataplane.gateway import GatewayMetrics, UnitsView
from epd_dataplane.metrics import ProxyMetrics
from epd_operator.ec.janitor import StoreMetrics
from epd_operator.metrics import OperatorMetrics

# Sample names a real vLLM 0.32 CPU engine (an encoder and a consumer) exports after serving.
ENGINE_METRICS = Path(__file__).parent / "vllm-0.32-metrics.txt"
# Grafana's `label_values(<selector>, <label>)` variable query.
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def read_metric_names(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()} if path.exists() else set()


def sample_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


def janitor_metric_names() -> set[str]:
    return sample_names(StoreMetrics(["/dev/shm/store"], 1).registry)


def proxy_metric_names() -> set[str]:
    """A unit's proxy's and a gateway's (a gateway is a proxy with metrics of its own)."""
    metrics = ProxyMetrics()
    metrics.observe_request("chat_completions", 200)  # labelled series exist once observed
    metrics.observe_primed(["image"])
    metrics.observe_found(["image"], 1)
    metrics.observe_prime_seconds(0.1)
    metrics.watch_store(lambda: 0, lambda: True)
    GatewayMetrics(metrics, UnitsView("m")).observe("unit-0", "key", own=False)
    return sample_names(metrics.registry)


def operator_metric_names() -> set[str]:
    metrics = OperatorMetrics()
    metrics.set_units("ns", "name", ready=1, desired=1)  # labelled series exist once set
    metrics.observe_reconcile("error", 0.1)
    return sample_names(metrics.registry)


def queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable, as Grafana sends them."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", grafana_to_promql(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not a label_values() query"
            yield f"variable {variable['name']}", grafana_to_promql(match["selector"])


def grafana_to_promql(expr: str) -> str:
    """The query Grafana sends: its interval and the dashboard's variables (as with "All") filled in."""
    expr = re.sub(r"\$__(rate_)?interval", "1m", expr)
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects, parsed by a real PromQL parser."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"{expr}: a selector without a metric name"
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names
