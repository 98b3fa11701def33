"""The chart's monitoring, rendered by the real helm: a PodMonitor for every engine and EC
janitor of the operator's units, and a Grafana dashboard whose every query names a metric that
really exists (tests/helm/dashboard.py). The PodMonitor, the ServiceMonitor and the
PrometheusRule are validated by the real API server against the Prometheus Operator's own CRDs.

Whether the PodMonitor selects the right targets is checked on the pods the operator really
renders, through a STAND-IN for Prometheus' pod discovery and relabeling (`scrape_targets`):
no Prometheus or Prometheus Operator runs here.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_dev.localcluster import binaries
from epd_operator.render import render
from epd_operator.resources import JANITOR_METRICS_PORT, PROXY_METRICS_PORT, desired_children
from epd_operator.validation import validate

from .chart import documents, find, template
from .dashboard import (
    ENGINE_METRICS,
    grafana_to_promql,
    janitor_metric_names,
    metric_names,
    operator_metric_names,
    proxy_metric_names,
    queries,
    read_metric_names,
)

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
MONITORING = {
    "monitoring.podMonitor.enabled": True,
    "monitoring.grafanaDashboard.enabled": True,
    "monitoring.prometheusRule.enabled": True,
    "metrics.serviceMonitor.enabled": True,
}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return documents(template(MONITORING).stdout)


def dashboard_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (config_map,) = find(docs, "ConfigMap")
    return json.loads(config_map["data"]["epd.json"])


def test_monitoring_is_off_by_default():
    docs = documents(template().stdout)
    assert not find(docs, "PodMonitor") and not find(docs, "ConfigMap")


def test_the_api_server_accepts_the_monitors_and_the_rule_against_the_prometheus_operators_crds(cluster):
    crds = binaries.monitoring_crds()
    missing = [str(path) for path in crds if not path.is_file()]
    if missing:
        pytest.fail(
            f"the Prometheus Operator's CRDs are missing ({', '.join(missing)}). Get them with:\n\n    make cluster\n",
            pytrace=False,
        )
    for path in crds:
        cluster.kubectl("apply", "--server-side", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", *(f"-f={path}" for path in crds))
    namespace = f"epd-monitoring-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", namespace)
    try:
        docs = documents(template(MONITORING, namespace=namespace).stdout)
        monitoring = [d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"]
        assert sorted(d["kind"] for d in monitoring) == ["PodMonitor", "PrometheusRule", "ServiceMonitor"]
        dry_run = ("apply", "--dry-run=server", "--validate=strict", "-n", namespace, "-f", "-")
        accepted = cluster.kubectl(*dry_run, input=yaml.safe_dump_all(monitoring), check=False)
        assert accepted.returncode == 0, accepted.stderr
        # The CRDs do check: a rule whose `for` is no Prometheus duration is refused.
        (rule,) = [d for d in monitoring if d["kind"] == "PrometheusRule"]
        rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
        refused = cluster.kubectl(*dry_run, input=yaml.safe_dump(rule), check=False)
        assert refused.returncode != 0 and "spec.groups[0].rules[0].for" in refused.stderr, refused.stderr
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_every_dashboard_query_names_only_metrics_that_are_exported(rendered):
    engine = read_metric_names(ENGINE_METRICS)
    assert engine, (
        f"{ENGINE_METRICS} is empty: record a real engine's metrics with "
        "UPDATE_GOLDEN=1 pytest -m node tests/node/test_janitor.py"
    )
    exported = engine | janitor_metric_names() | proxy_metric_names() | operator_metric_names()
    used: dict[str, str] = {}
    for where, expr in queries(dashboard_of(rendered)):
        for name in metric_names(expr):
            used.setdefault(name, where)
    unknown = {name: where for name, where in used.items() if name not in exported}
    assert unknown == {}, f"no engine, janitor or operator exports these: {unknown}"
    # What the dashboard is for: per-role load and latency, encoder queues, the EC store, the
    # consumers' fallback encodes, and the units the operator sees ready.
    assert {
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "epd_ec_store_bytes",
        "epd_ec_evictions_total",
        "epd_ec_fallback_encodes_total",
        "epd_ready_units",
        "epd_desired_units",
        "epd_proxy_requests_total",
        "epd_proxy_media_primed_total",
        "epd_proxy_prime_failures_total",
        "epd_proxy_prime_duration_seconds_bucket",
        "epd_proxy_encoders_ejected",
    } <= used.keys()


def test_engine_panels_are_per_role(rendered):
    for panel in dashboard_of(rendered)["panels"]:
        for target in panel.get("targets", []):
            if any(name.startswith("vllm:") for name in metric_names(grafana_to_promql(target["expr"]))):
                assert "by (worker_type)" in target["expr"] or "by (le, worker_type)" in target["expr"], panel["title"]
                assert "{{worker_type}}" in target["legendFormat"], panel["title"]


def test_the_dashboard_configmap_is_labelled_for_grafanas_sidecar(rendered):
    (config_map,) = find(rendered, "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "epd-system"
    docs = documents(
        template(
            {
                **MONITORING,
                "monitoring.grafanaDashboard.namespace": "grafana",
                "monitoring.grafanaDashboard.annotations": {"grafana_folder": "EPD"},
            }
        ).stdout
    )
    (config_map,) = find(docs, "ConfigMap")
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "EPD"}


def test_the_operators_servicemonitor_keeps_the_deployments_namespace_label(rendered):
    (monitor,) = find(rendered, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # epd_ready_units{namespace=...}


@pytest.mark.parametrize("example", ["encoder-prefill-decode.yaml", "encoder-regular.yaml"])
def test_the_podmonitor_scrapes_every_engine_proxy_and_janitor_of_a_unit_with_its_role(rendered, example):
    (monitor,) = find(rendered, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    name = manifest["metadata"]["name"]
    checked = validate(manifest["spec"])
    plans = render(checked, namespace="team-a", name=name, uid="uid-1")
    for plan in plans:
        (sts,) = [
            c for c in desired_children(checked.spec, name, [plan], "epd-operator:test") if c["kind"] == "StatefulSet"
        ]
        pod = {
            "metadata": {
                **sts["spec"]["template"]["metadata"],
                "name": f"{sts['metadata']['name']}-0",
                "namespace": "team-a",
            },
            "spec": sts["spec"]["template"]["spec"],
            "status": {"podIP": "10.1.2.3"},
        }
        engines_endpoint, proxy_endpoint, gateway_endpoint, janitor_endpoint = monitor["spec"]["podMetricsEndpoints"]
        assert scrape_targets(monitor, gateway_endpoint, pod) == []  # a unit has no gateway

        engines = scrape_targets(monitor, engines_endpoint, pod)
        assert sorted((t["container"], t["worker_type"], t["__address__"]) for t in engines) == sorted(
            (e.container_name, e.worker_type.value, f"10.1.2.3:{e.port}") for e in plan.engines
        )
        for target in engines:
            assert (target["role"], target["deployment"], target["model"], target["namespace"]) == (
                "unit",
                name,
                plan.name,
                "team-a",
            )
            assert target["__metrics_path__"] == "/metrics"

        (proxy,) = scrape_targets(monitor, proxy_endpoint, pod)
        assert (proxy["container"], proxy["__address__"]) == ("proxy", f"10.1.2.3:{PROXY_METRICS_PORT}")
        assert (proxy["role"], proxy["deployment"], proxy["model"]) == ("unit", name, plan.name)

        (janitor,) = scrape_targets(monitor, janitor_endpoint, pod)
        assert (janitor["container"], janitor["__address__"]) == ("janitor", f"10.1.2.3:{JANITOR_METRICS_PORT}")
        assert (janitor["role"], janitor["deployment"], janitor["model"]) == ("unit", name, plan.name)
        assert "worker_type" not in janitor


def test_the_podmonitor_scrapes_each_gateway_under_its_model(rendered):
    (monitor,) = find(rendered, "PodMonitor")
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["gateway"] = {"enabled": True}
    name = manifest["metadata"]["name"]
    checked = validate(manifest["spec"])
    plans = render(checked, namespace="team-a", name=name, uid="uid-1")
    (deployment,) = [
        c for c in desired_children(checked.spec, name, plans, "epd-operator:test") if c["kind"] == "Deployment"
    ]
    pod = {
        "metadata": {**deployment["spec"]["template"]["metadata"], "name": "gw-abc", "namespace": "team-a"},
        "spec": deployment["spec"]["template"]["spec"],
        "status": {"podIP": "10.1.2.4"},
    }
    engines_endpoint, proxy_endpoint, gateway_endpoint, janitor_endpoint = monitor["spec"]["podMetricsEndpoints"]
    (gateway,) = scrape_targets(monitor, gateway_endpoint, pod)
    assert (gateway["container"], gateway["__address__"]) == ("gateway", f"10.1.2.4:{PROXY_METRICS_PORT}")
    assert (gateway["role"], gateway["deployment"], gateway["model"]) == ("gateway", name, plans[0].name)
    for other in (engines_endpoint, proxy_endpoint, janitor_endpoint):
        assert scrape_targets(monitor, other, pod) == []


def test_the_podmonitor_scrapes_each_encoder_pool_engine_under_its_model(rendered):
    """A pool's pods carry no model label (the units' selector has it); the PodMonitor names the
    model from the pool's own label, so the encoders' load adds up per model."""
    (monitor,) = find(rendered, "PodMonitor")
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    name = manifest["metadata"]["name"]
    checked = validate(manifest["spec"])
    (plan,) = render(checked, namespace="team-a", name=name, uid="uid-1")
    (pool,) = [
        c
        for c in desired_children(checked.spec, name, [plan], "epd-operator:test")
        if c["kind"] == "StatefulSet" and c["metadata"]["name"].endswith("-encoders")
    ]
    pod = {
        "metadata": {**pool["spec"]["template"]["metadata"], "name": "pool-0", "namespace": "team-a"},
        "spec": pool["spec"]["template"]["spec"],
        "status": {"podIP": "10.1.2.5"},
    }
    engines_endpoint, *others = monitor["spec"]["podMetricsEndpoints"]
    engines = scrape_targets(monitor, engines_endpoint, pod)
    assert sorted((t["container"], t["__address__"]) for t in engines) == sorted(
        (e.container_name, f"10.1.2.5:{e.port}") for e in plan.encoders
    )
    for target in engines:
        assert (target["role"], target["deployment"], target["model"], target["worker_type"]) == (
            "encoder-pool",
            name,
            plan.name,
            "encoder",
        )
    for other in others:
        assert scrape_targets(monitor, other, pod) == []


def test_with_watched_namespaces_the_podmonitor_looks_only_there():
    docs = documents(template({**MONITORING, "watchNamespaces": ["team-a", "team-b"]}).stdout)
    (monitor,) = find(docs, "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


# --------------------------------------------------------------------------- the stand-in


def scrape_targets(monitor: dict[str, Any], endpoint: dict[str, Any], pod: dict[str, Any]) -> list[dict[str, str]]:
    """STAND-IN for Prometheus' `kubernetes_sd_configs` role `pod` plus the relabeling the
    Prometheus Operator generates for one PodMonitor endpoint (its selector, its `port`, its
    namespace/container/pod labels), then the endpoint's own `relabelings`: the targets left,
    each with its labels (`__address__` and `__metrics_path__` included)."""
    spec = monitor["spec"]
    namespaces = spec["namespaceSelector"]
    if not namespaces.get("any") and pod["metadata"]["namespace"] not in namespaces.get("matchNames", []):
        return []
    generated: list[dict[str, Any]] = []
    for key, value in spec["selector"].get("matchLabels", {}).items():
        generated.append(
            {
                "action": "keep",
                "regex": f"({value});true",
                "sourceLabels": [
                    f"__meta_kubernetes_pod_label_{_sanitize(key)}",
                    f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}",
                ],
            }
        )
    for expression in spec["selector"].get("matchExpressions", []):
        assert expression["operator"] == "Exists", "the stand-in knows only Exists"
        generated.append(
            {
                "action": "keep",
                "regex": "true",
                "sourceLabels": [f"__meta_kubernetes_pod_labelpresent_{_sanitize(expression['key'])}"],
            }
        )
    if endpoint.get("port"):
        generated.append(
            {"action": "keep", "regex": endpoint["port"], "sourceLabels": ["__meta_kubernetes_pod_container_port_name"]}
        )
    generated += [
        {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
        {"sourceLabels": ["__meta_kubernetes_pod_container_name"], "targetLabel": "container"},
        {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
    ]
    targets = []
    for labels in _discover(pod):
        labels["__metrics_path__"] = endpoint.get("path", "/metrics")
        kept = _relabel(labels, [*generated, *endpoint.get("relabelings", [])])
        if kept is not None:
            targets.append({k: v for k, v in kept.items() if not k.startswith("__meta_")})
    return targets


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _discover(pod: dict[str, Any]) -> list[dict[str, str]]:
    """One target per declared port of every container, init containers (native sidecars) too."""
    meta = pod["metadata"]
    common = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"]}
    for key, value in meta.get("labels", {}).items():
        common[f"__meta_kubernetes_pod_label_{_sanitize(key)}"] = value
        common[f"__meta_kubernetes_pod_labelpresent_{_sanitize(key)}"] = "true"
    found = []
    for init, containers in ((True, pod["spec"].get("initContainers", [])), (False, pod["spec"]["containers"])):
        for container in containers:
            for port in container.get("ports", []):
                found.append(
                    {
                        **common,
                        "__address__": f"{pod['status']['podIP']}:{port['containerPort']}",
                        "__meta_kubernetes_pod_container_name": container["name"],
                        "__meta_kubernetes_pod_container_init": str(init).lower(),
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    }
                )
    return found


def _relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabel_config semantics for keep, drop and replace (regexes fully anchored)."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("sourceLabels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep" and not match or action == "drop" and match:
            return None
        if action == "replace" and match:
            result = match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rule.get("replacement", "$1")))
            if result:
                labels[rule["targetLabel"]] = result
            else:
                labels.pop(rule["targetLabel"], None)
        elif action not in ("keep", "drop", "replace"):
            raise AssertionError(f"the stand-in does not implement relabel action {action}")
    return labels
