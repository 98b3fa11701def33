"""The chart's alerts (charts/epd-operator/prometheus/alerts.yaml): wrapped in a PrometheusRule by
the real helm, checked and evaluated by the real promtool (built by `make cluster`), and naming
only metrics the product's exporters really export.

promtool's rule unit tests feed each alert the series its exporters give once the chart's
ServiceMonitor and PodMonitor have labelled them, and assert when it fires, with which labels and
what it says, and that the series of a healthy deployment leave it quiet.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_dev.localcluster import binaries

from .chart import CHART, documents, find, template
from .dashboard import (
    ENGINE_METRICS,
    janitor_metric_names,
    metric_names,
    operator_metric_names,
    proxy_metric_names,
    read_metric_names,
)

pytestmark = pytest.mark.cluster

ALERTS = CHART / "prometheus" / "alerts.yaml"
SEVERITIES = {"critical", "warning", "info"}

# The labels each exporter's series carry in Prometheus: the operator's through its ServiceMonitor
# (honorLabels keeps the EPDDeployment's namespace), a unit's proxy, janitor and engines through
# the PodMonitor (role, deployment, model; worker_type on engines).
OPERATOR = {"job": "epd-epd-operator-metrics", "instance": "10.0.0.9:9090"}
UNIT = {"namespace": "team-a", "pod": "vision-default-0", "role": "unit", "deployment": "vision", "model": "default"}
STORE = {**UNIT, "path": "/dev/shm/epd-ec/vision/default"}


@functools.cache
def rules() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]}


def promtool(*args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    path = binaries.bin_dir(binaries.MONITORING) / "promtool"
    if not os.access(path, os.X_OK):
        pytest.fail(f"promtool is not built ({path} missing). Build it once with:\n\n    make cluster\n", pytrace=False)
    return subprocess.run([str(path), *map(str, args)], capture_output=True, text=True, timeout=120, check=False)


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    body = ", ".join(f'{key}="{value}"' for key, value in labels.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def expanded(text: str, labels: dict[str, str], value: str) -> str:
    """An annotation as Prometheus renders it, for the two template forms the alerts use."""
    text = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m[1]], text)
    return re.sub(r"\{\{\s*\$value\s*\}\}", value, text)


def firing(alert: str, labels: dict[str, str], value: str = "1") -> dict[str, Any]:
    """What promtool must find for ``alert`` with these labels (its own severity added)."""
    rule = rules()[alert]
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {key: expanded(text, labels, value) for key, text in rule["annotations"].items()},
    }


def case(alert: str, at: str, inputs: list[dict[str, str]], *expected: dict[str, Any]) -> dict[str, Any]:
    return {
        "interval": "1m",
        "input_series": inputs,
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": list(expected)}],
    }


UNITS = {"namespace": "team-a", "name": "vision", **OPERATOR}
CASES = [
    # No unit Ready of the two asked for: critical after 10 minutes; pending before.
    case(
        "EPDDeploymentDown",
        "11m",
        [series("epd_ready_units", UNITS, "0x15"), series("epd_desired_units", UNITS, "2x15")],
        firing("EPDDeploymentDown", UNITS),
    ),
    case(
        "EPDDeploymentDown",
        "9m",
        [series("epd_ready_units", UNITS, "0x15"), series("epd_desired_units", UNITS, "2x15")],
    ),
    # Scaled to zero on purpose: nothing is down.
    case(
        "EPDDeploymentDown",
        "30m",
        [series("epd_ready_units", UNITS, "0x40"), series("epd_desired_units", UNITS, "0x40")],
    ),
    case(
        "EPDDeploymentDegraded",
        "31m",
        [series("epd_ready_units", UNITS, "1x40"), series("epd_desired_units", UNITS, "2x40")],
        firing("EPDDeploymentDegraded", UNITS, "1"),
    ),
    # A rollout that took 20 minutes to bring the units back is no alert.
    case(
        "EPDDeploymentDegraded",
        "45m",
        [series("epd_ready_units", UNITS, "1x20 2x30"), series("epd_desired_units", UNITS, "2x50")],
    ),
    case("EPDInvalidSpec", "6m", [series("epd_invalid_specs", OPERATOR, "1x10")], firing("EPDInvalidSpec", OPERATOR)),
    case(
        "EPDReconcileErrors",
        "20m",
        [series("epd_reconciles_total", {**OPERATOR, "result": "error"}, "0+1x30")],
        firing("EPDReconcileErrors", {**OPERATOR, "result": "error"}),
    ),
    case("EPDReconcileErrors", "20m", [series("epd_reconciles_total", {**OPERATOR, "result": "success"}, "0+9x30")]),
    # Priming fails on the encoders: the proxies refuse requests with media.
    case(
        "EPDPrimesFailing",
        "10m",
        [series("epd_proxy_prime_failures_total", {**UNIT, "reason": "encoder_error"}, "0+3x20")],
        firing("EPDPrimesFailing", {"namespace": "team-a", "deployment": "vision", "model": "default"}),
    ),
    # Clients' own bad requests (an unreachable image URL) are not the deployment's trouble.
    case(
        "EPDPrimesFailing",
        "10m",
        [series("epd_proxy_prime_failures_total", {**UNIT, "reason": "client_error"}, "0+3x20")],
    ),
    case(
        "EPDEncoderLeftOut",
        "11m",
        [series("epd_proxy_encoders_ejected", UNIT, "1x15")],
        firing(
            "EPDEncoderLeftOut",
            {"namespace": "team-a", "deployment": "vision", "model": "default", "pod": "vision-default-0"},
            "1",
        ),
    ),
    # Left out once for its 30 s and back: no alert.
    case("EPDEncoderLeftOut", "11m", [series("epd_proxy_encoders_ejected", UNIT, "0x3 1 0x11")]),
    case(
        "EPDFallbackEncodes",
        "5m",
        [series("epd_ec_fallback_encodes_total", STORE, "0 0 0 2 3x5")],
        firing("EPDFallbackEncodes", {"namespace": "team-a", "deployment": "vision", "model": "default"}),
    ),
    case("EPDFallbackEncodes", "20m", [series("epd_ec_fallback_encodes_total", STORE, "0x25")]),
    case(
        "EPDECStoreOverBudget",
        "16m",
        [series("epd_ec_store_bytes", STORE, "900x20"), series("epd_ec_store_budget_bytes", STORE, "800x20")],
        firing("EPDECStoreOverBudget", STORE),
    ),
    case(
        "EPDECStoreOverBudget",
        "16m",
        [series("epd_ec_store_bytes", STORE, "700x20"), series("epd_ec_store_budget_bytes", STORE, "800x20")],
    ),
    case(
        "EPDECEvictionFailures",
        "5m",
        [series("epd_ec_eviction_failures_total", STORE, "0 0 1x8")],
        firing("EPDECEvictionFailures", STORE),
    ),
    case(
        "EPDEncodersSaturated",
        "16m",
        [
            series("vllm:num_requests_waiting", {**UNIT, "worker_type": "encoder", "engine": "0"}, "3x20"),
            series("vllm:num_requests_waiting", {**UNIT, "worker_type": "regular", "engine": "0"}, "0x20"),
        ],
        firing("EPDEncodersSaturated", {"namespace": "team-a", "deployment": "vision", "model": "default"}),
    ),
    # Consumers queueing while encoders keep up: not the encoders' alert.
    case(
        "EPDEncodersSaturated",
        "16m",
        [
            series("vllm:num_requests_waiting", {**UNIT, "worker_type": "encoder", "engine": "0"}, "0x20"),
            series("vllm:num_requests_waiting", {**UNIT, "worker_type": "regular", "engine": "0"}, "5x20"),
        ],
    ),
]


def test_the_alerts_are_off_by_default_and_rendered_from_the_rule_file_with_the_extra_labels():
    assert not find(documents(template().stdout), "PrometheusRule")
    values = {
        "monitoring.prometheusRule.enabled": True,
        "monitoring.prometheusRule.labels": {"release": "kube-prometheus-stack"},
        "monitoring.prometheusRule.alertLabels": {"team": "ml-serving", "severity": "page"},
    }
    (rule,) = find(documents(template(values).stdout), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    # Every rule as the file has it, with the team label added and its own severity kept.
    for group in groups:
        for each in group["rules"]:
            each["labels"] = {"team": "ml-serving", **each["labels"]}
    assert rule["spec"]["groups"] == groups


def test_every_alert_names_only_exported_metrics_and_says_how_bad_and_what_to_do():
    exported = read_metric_names(ENGINE_METRICS) | janitor_metric_names() | proxy_metric_names()
    exported |= operator_metric_names()
    for name, rule in rules().items():
        assert metric_names(rule["expr"]) <= exported, (name, metric_names(rule["expr"]) - exported)
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert {"summary", "description"} <= rule["annotations"].keys(), name
    # What the alerts are for: the deployment down or degraded, media refused or encoded on a
    # consumer, a hung encoder, the EC store, the operator itself.
    assert {
        "EPDDeploymentDown",
        "EPDDeploymentDegraded",
        "EPDPrimesFailing",
        "EPDEncoderLeftOut",
        "EPDFallbackEncodes",
        "EPDECStoreOverBudget",
        "EPDInvalidSpec",
    } <= rules().keys()


def test_promtool_accepts_the_rule_file():
    checked = promtool("check", "rules", ALERTS)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules())} rules found" in checked.stdout


def test_each_alert_fires_on_the_series_of_its_trouble_and_stays_quiet_otherwise(tmp_path: Path):
    assert {c["alert_rule_test"][0]["alertname"] for c in CASES} == rules().keys()  # every alert is tested
    tests = tmp_path / "alerts_test.yaml"
    tests.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": CASES}))
    ran = promtool("test", "rules", tests)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "SUCCESS" in ran.stdout
