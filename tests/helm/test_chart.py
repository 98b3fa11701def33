"""The chart rendered by the real helm: lint, golden output, guard rails, least-privilege RBAC.

These need the helm binary of `make cluster` (hence the `cluster` mark) but no running cluster.
The checks that only read the golden files are in test_rendered.py and run everywhere.
"""

from __future__ import annotations

import os

import pytest
import yaml

from .chart import (
    CHART,
    GOLDEN_CASES,
    KUBE_VERSION,
    documents,
    find,
    golden_path,
    helm,
    operator_roles,
    set_args,
    template,
)

pytestmark = pytest.mark.cluster


def test_lint_is_clean():
    for values in GOLDEN_CASES.values():
        out = helm("lint", "--strict", CHART, *set_args(values), "--kube-version", KUBE_VERSION)
        report = out.stdout + out.stderr
        assert "0 chart(s) failed" in report
        assert "[WARNING]" not in report and "[ERROR]" not in report, report


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_template_matches_golden(case):
    rendered = template(GOLDEN_CASES[case]).stdout
    path = golden_path(case)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(rendered)
    assert path.exists(), f"{path} missing: run UPDATE_GOLDEN=1 pytest {__file__} (or make chart-golden)"
    assert rendered == path.read_text(), (
        f"`helm template` differs from {path.name}; if the change is intended, regenerate with "
        "UPDATE_GOLDEN=1 (make chart-golden) and review the diff"
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": 2}, "replicaCount > 1 needs peering.enabled=true"),
        ({"replicaCount": 0}, "replicaCount"),
        ({"logLevel": "TRACE"}, "logLevel"),
        ({"logFormat": "xml"}, "logFormat"),
        ({"watchNamespaces": ["Team_A"]}, "watchNamespaces"),
        ({"watchNamespaces": ["a", "a"]}, "watchNamespaces"),
        ({"metrics.port": 70000}, "port"),
        ({"metrics.enabled": False, "metrics.serviceMonitor.enabled": True}, "needs metrics.enabled=true"),
        ({"unknownKey": 1}, "unknownKey"),
        ({"monitoring.podMonitor.interval": "soon"}, "interval"),
        ({"monitoring.grafanaDashboard.namespace": "Grafana_NS"}, "namespace"),
        ({"monitoring.dashboards": True}, "dashboards"),
        ({"janitorScrape.rate": 0}, "/janitorScrape/rate"),
        ({"janitorScrape.interval": -1}, "/janitorScrape/interval"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_values_are_refused(values, message):
    out = template(values, check=False)
    assert out.returncode != 0, out.stdout
    assert message in out.stderr, out.stderr


def test_peering_in_all_namespaces_mode_uses_a_cluster_peering_object():
    docs = documents(template({"peering.enabled": True}).stdout)
    (deployment,) = find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--peering=epd-operator" in container["args"] and "--standalone" not in container["args"]
    (peering,) = find(docs, "ClusterKopfPeering", "epd-operator")
    assert peering["apiVersion"] == "kopf.dev/v1"
    (cluster_role,) = operator_roles(docs)
    assert {
        "apiGroups": ["kopf.dev"],
        "resources": ["clusterkopfpeerings"],
        "verbs": ["list", "watch", "patch"],
    } in cluster_role["rules"]


def test_metrics_can_be_turned_off():
    docs = documents(template({"metrics.enabled": False}).stdout)
    assert not find(docs, "Service")
    (deployment,) = find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=0" in container["args"]
    assert [p["name"] for p in container["ports"]] == ["health"]


def test_existing_service_account_and_no_rbac():
    docs = documents(
        template({"serviceAccount.create": False, "serviceAccount.name": "mine", "rbac.create": False}).stdout
    )
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "NetworkPolicy"}
    (deployment,) = find(docs, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


def test_image_tag_defaults_to_app_version():
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    custom = {"image.repository": "registry.example/epd", "image.tag": "dev"}
    for values, image in [({}, f"epd-operator:{app_version}"), (custom, "registry.example/epd:dev")]:
        (deployment,) = find(documents(template(values).stdout), "Deployment")
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == image


def test_several_replicas_elect_a_leader_through_peering():
    out = template({"replicaCount": 3, "peering.enabled": True})
    assert out.returncode == 0, out.stderr
    assert "- --peering=" in out.stdout and "- --priority=random" in out.stdout


def test_the_operators_metrics_are_behind_a_network_policy():
    (policy,) = find(documents(template({}).stdout), "NetworkPolicy")
    (deployment,) = find(documents(template({}).stdout), "Deployment")
    assert policy["spec"]["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (rule,) = policy["spec"]["ingress"]
    assert rule == {"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP", "port": 9090}]}
    (closed,) = find(documents(template({"networkPolicy.metricsFrom": None}).stdout), "NetworkPolicy")
    assert closed["spec"]["ingress"] == []
    assert not find(documents(template({"networkPolicy.enabled": False}).stdout), "NetworkPolicy")
