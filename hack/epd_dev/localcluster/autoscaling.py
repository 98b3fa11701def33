"""The autoscaling stack on the local cluster: KEDA and the Prometheus its scaler queries, on the
real node, installed as their users install them.

    python -m epd_dev.localcluster.autoscaling up|down [--dir .cluster]   (make autoscaling-up)

KEDA: its own manifests (its module's config/ kustomize tree, which `make autoscaling` copies
into the autoscaling cache), rendered by `kubectl kustomize` as its release renders them
(config/default), through an overlay that changes only what must change here: the local images,
never pulled; the real node's selector and toleration; the release's version label. KEDA's
securityContexts stay. Its operator makes its own certificates (`--enable-cert-rotation`, in
KEDA's manifest): the secret kedaorg-certs, whose CA it patches into the APIService
v1beta1.external.metrics.k8s.io and its ValidatingWebhookConfiguration; no cert-manager.

Prometheus: the server (localhost/prometheus) in the namespace `monitoring` behind the Service
KEDA's Prometheus scaler is given (PROMETHEUS_URL), discovering pods with a ClusterRole of its
own. Its scrape jobs are the chart's PodMonitor (charts/epd-operator, rendered by helm) as the
Prometheus Operator turns one into `kubernetes_sd_configs` role pod jobs: the selector's keep
rules, the endpoint's port, the namespace, container and pod labels, then the PodMonitor's own
relabelings; scraped every SCRAPE_INTERVAL (the tests' pace, not the chart's 30 s).

Nothing is built here: missing binaries or images fail with the command that builds them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from .. import operator_chart
from ..images import build as images
from ..images import recipes
from ..paths import REPO
from . import binaries, node
from .cluster import ClusterError, LocalCluster

BUILD_HINT = "make autoscaling"
KEDA_NAMESPACE = "keda"
KEDA_DEPLOYMENTS = ("keda-operator", "keda-metrics-apiserver", "keda-admission")
APISERVICE = "v1beta1.external.metrics.k8s.io"
MONITORING_NAMESPACE = "monitoring"
PROMETHEUS = "prometheus"
PROMETHEUS_PORT = 9090
PROMETHEUS_URL = f"http://{PROMETHEUS}.{MONITORING_NAMESPACE}.svc:{PROMETHEUS_PORT}"
PROMETHEUS_LABELS = {"app.kubernetes.io/name": PROMETHEUS}
SCRAPE_INTERVAL = "5s"
# The rendered objects of the last install, which `uninstall` deletes (the cluster folder's run/
# is emptied at every start).
RENDERED = Path("run") / "autoscaling"


class AutoscalingError(RuntimeError):
    """The stack cannot be installed: the message says what is missing and how to get it."""


@dataclass(frozen=True)
class Stack:
    """The installed stack: Prometheus from the host (its pod IP) and from pods (its Service)."""

    prometheus_url: str
    seconds: float
    prometheus_in_cluster: str = PROMETHEUS_URL


def keda_overlay(config: Path, overlay_dir: Path) -> dict[str, Any]:
    """The kustomization rendering KEDA's config/default (in `config`) from `overlay_dir` with the
    local changes only."""
    pin_to_real_node = [
        {"op": "add", "path": f"/spec/template/spec/nodeSelector/{key.replace('/', '~1')}", "value": value}
        for key, value in node.NODE_SELECTOR.items()
    ]
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        # kustomize takes no absolute path for a base.
        "resources": [os.path.relpath(config / "default", overlay_dir)],
        "images": [_local_image(name) for name in recipes.KEDA_IMAGES],
        # What KEDA's `make release` writes into its metadata label transformer.
        "labels": [{"pairs": {"app.kubernetes.io/version": recipes.KEDA_TAG}}],
        "patches": [
            {
                "target": {"kind": "Deployment"},
                "patch": json.dumps(
                    [
                        *pin_to_real_node,
                        {"op": "add", "path": "/spec/template/spec/tolerations", "value": node.TOLERATIONS},
                        {
                            "op": "replace",
                            "path": "/spec/template/spec/containers/0/imagePullPolicy",
                            "value": "IfNotPresent",
                        },
                    ]
                ),
            }
        ],
    }


def _local_image(name: str) -> dict[str, str]:
    """KEDA's image `name` (ghcr.io/kedacore/<name>) as the local one."""
    repository, tag = recipes.keda_ref(name).rsplit(":", 1)
    return {"name": f"ghcr.io/kedacore/{name}", "newName": repository, "newTag": tag}


def render_keda(cluster: LocalCluster) -> list[dict[str, Any]]:
    """KEDA's objects, as `kubectl kustomize` renders its manifests through `keda_overlay`."""
    config = binaries.keda_config()
    with tempfile.TemporaryDirectory(prefix="epd-keda-") as tmp:
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump(keda_overlay(config, Path(tmp))))
        rendered = cluster.kubectl("kustomize", tmp).stdout
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def pod_monitor(cluster: LocalCluster) -> dict[str, Any]:
    """The chart's PodMonitor as `helm template` renders it with the chart's defaults."""
    out = operator_chart.helm(
        cluster,
        "template",
        operator_chart.RELEASE,
        str(operator_chart.CHART),
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--show-only",
        "templates/podmonitor.yaml",
    ).stdout
    (monitor,) = [doc for doc in yaml.safe_load_all(out) if doc]
    return dict(monitor)


def scrape_configs(monitor: dict[str, Any], interval: str = SCRAPE_INTERVAL) -> list[dict[str, Any]]:
    """The Prometheus Operator's translation of a PodMonitor into scrape jobs, one per endpoint."""
    meta, spec = monitor["metadata"], monitor["spec"]
    job = f"{meta['namespace']}/{meta['name']}"
    jobs = []
    for index, endpoint in enumerate(spec["podMetricsEndpoints"]):
        port = endpoint.get("port")
        generated = [
            *_selector_rules(spec["selector"]),
            *([_keep(["__meta_kubernetes_pod_container_port_name"], port)] if port else []),
            {"source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)", "action": "drop"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"target_label": "job", "replacement": job},
            *([{"target_label": "endpoint", "replacement": port}] if port else []),
        ]
        jobs.append(
            {
                "job_name": f"podMonitor/{job}/{index}",
                "honor_labels": False,
                "kubernetes_sd_configs": [_pod_discovery(spec.get("namespaceSelector", {}), meta["namespace"])],
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": endpoint.get("path", "/metrics"),
                "relabel_configs": [*generated, *(_snake_keys(rule) for rule in endpoint.get("relabelings", []))],
            }
        )
    return jobs


def _pod_discovery(namespaces: dict[str, Any], own: str) -> dict[str, Any]:
    """`role: pod` discovery in the namespaces a namespaceSelector names (its own by default)."""
    if namespaces.get("any"):
        return {"role": "pod"}
    return {"role": "pod", "namespaces": {"names": namespaces.get("matchNames", [own])}}


def _selector_rules(selector: dict[str, Any]) -> list[dict[str, Any]]:
    """A label selector as keep rules on the discovered pods' labels."""
    rules = [
        _keep(
            [f"__meta_kubernetes_pod_label_{_label(key)}", f"__meta_kubernetes_pod_labelpresent_{_label(key)}"],
            f"({value});true",
        )
        for key, value in selector.get("matchLabels", {}).items()
    ]
    for expression in selector.get("matchExpressions", []):
        if expression["operator"] != "Exists":
            raise AutoscalingError(f"the PodMonitor's selector operator {expression['operator']} is not translated")
        rules.append(_keep([f"__meta_kubernetes_pod_labelpresent_{_label(expression['key'])}"], "true"))
    return rules


def _keep(source_labels: list[str], regex: str) -> dict[str, Any]:
    return {"source_labels": source_labels, "regex": regex, "action": "keep"}


def _label(name: str) -> str:
    """A Kubernetes label's name as Prometheus' discovery meta labels spell it."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _snake_keys(rule: dict[str, Any]) -> dict[str, Any]:
    """A Prometheus Operator RelabelConfig (sourceLabels, targetLabel) as Prometheus' (source_labels)."""
    return {re.sub(r"([A-Z])", r"_\1", key).lower(): value for key, value in rule.items()}


def prometheus_objects(config: dict[str, Any]) -> list[dict[str, Any]]:
    """Prometheus in `monitoring`: its RBAC for pod discovery, its configuration, its Deployment on
    the real node (upstream image's user and data folder) and its Service."""
    text = yaml.safe_dump(config, sort_keys=False)
    meta = {"name": PROMETHEUS, "namespace": MONITORING_NAMESPACE, "labels": PROMETHEUS_LABELS}
    user = int(recipes.PROMETHEUS_USER.split(":")[0])
    container = {
        "name": PROMETHEUS,
        "image": recipes.PROMETHEUS_REF,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--config.file=/etc/prometheus/prometheus.yml",
            f"--storage.tsdb.path={recipes.PROMETHEUS_DATA}",
            f"--web.listen-address=:{PROMETHEUS_PORT}",
        ],
        "ports": [{"name": "web", "containerPort": PROMETHEUS_PORT}],
        "readinessProbe": {"httpGet": {"path": "/-/ready", "port": "web"}, "periodSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/-/healthy", "port": "web"}, "initialDelaySeconds": 30},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/prometheus", "readOnly": True},
            {"name": "data", "mountPath": recipes.PROMETHEUS_DATA},
        ],
    }
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": MONITORING_NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": f"epd-dev:{PROMETHEUS}", "labels": PROMETHEUS_LABELS},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"epd-dev:{PROMETHEUS}", "labels": PROMETHEUS_LABELS},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": f"epd-dev:{PROMETHEUS}",
            },
            "subjects": [{"kind": "ServiceAccount", "name": PROMETHEUS, "namespace": MONITORING_NAMESPACE}],
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"prometheus.yml": text}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": PROMETHEUS_LABELS},
                "template": {
                    # A new configuration rolls the pod: Prometheus reads it at its start.
                    "metadata": {
                        "labels": PROMETHEUS_LABELS,
                        "annotations": {"epd.vime.dev/config-sha256": hashlib.sha256(text.encode()).hexdigest()},
                    },
                    "spec": {
                        "serviceAccountName": PROMETHEUS,
                        "nodeSelector": node.NODE_SELECTOR,
                        "tolerations": node.TOLERATIONS,
                        "securityContext": {
                            "runAsNonRoot": True,
                            "runAsUser": user,
                            "runAsGroup": user,
                            "fsGroup": user,
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                        "containers": [container],
                        "volumes": [
                            {"name": "config", "configMap": {"name": PROMETHEUS}},
                            {"name": "data", "emptyDir": {}},
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {
                "selector": PROMETHEUS_LABELS,
                "ports": [{"name": "web", "port": PROMETHEUS_PORT, "targetPort": "web"}],
            },
        },
    ]


def prometheus_config(monitor: dict[str, Any]) -> dict[str, Any]:
    return {
        "global": {
            "scrape_interval": SCRAPE_INTERVAL,
            "scrape_timeout": SCRAPE_INTERVAL,
            "evaluation_interval": SCRAPE_INTERVAL,
        },
        "scrape_configs": scrape_configs(monitor),
    }


def require_built() -> None:
    """Fail, naming the command, when the stack's binaries or images are not built."""
    missing = binaries.missing_binaries(binaries.AUTOSCALING)
    builder = images.Builder()
    unbuilt = [name for name in images.AUTOSCALING_IMAGES if builder.cached(name) is None]
    if missing or unbuilt:
        what = [binaries.describe_missing({binaries.AUTOSCALING: missing})] if missing else []
        what += [f"the images {', '.join(unbuilt)}"] if unbuilt else []
        raise AutoscalingError(f"the autoscaling stack is not built: {'; '.join(what)}. Build it with: {BUILD_HINT}")


def install(cluster: LocalCluster, timeout: float = 300, log: Callable[[str], None] | None = None) -> Stack:
    """KEDA and Prometheus on `cluster`'s real node, once both serve: KEDA's APIService Available
    (the aggregator reaches its metrics server) and Prometheus ready (`/-/ready` from the host)."""
    say = log or _log
    started = time.monotonic()
    require_built()
    real = cluster.running_real_node()
    if real is None:
        raise AutoscalingError(
            f"no real node runs for {cluster.dir}: the stack runs on epd-real-0 (make cluster-up starts it)"
        )
    imported = images.Builder(log=say).import_cached(real, images.AUTOSCALING_IMAGES)
    say(f"images in the node's containerd ({', '.join(imported) or 'all there already'})")
    keda = render_keda(cluster)
    prometheus = prometheus_objects(prometheus_config(pod_monitor(cluster)))
    folder = cluster.dir / RENDERED
    folder.mkdir(parents=True, exist_ok=True)
    for name, objects in (("keda", keda), ("prometheus", prometheus)):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
        # Server-side: KEDA's CRDs are too big for client-side apply's annotation, as KEDA's docs say.
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(folder / f"{name}.yaml"), timeout=120)
    say(f"applied KEDA {binaries.KEDA_VERSION} (its manifests) and Prometheus {binaries.PROMETHEUS_VERSION}")
    for namespace, deployment in (*((KEDA_NAMESPACE, d) for d in KEDA_DEPLOYMENTS), (MONITORING_NAMESPACE, PROMETHEUS)):
        _wait(
            partial(_rolled_out, cluster, namespace, deployment),
            timeout,
            f"{namespace}/{deployment} rolled out",
            cluster,
        )
    _wait(lambda: _apiservice_available(cluster), timeout, f"APIService {APISERVICE} Available", cluster)
    url = f"http://{_pod_ip(cluster)}:{PROMETHEUS_PORT}"
    _wait(lambda: _http_ok(url + "/-/ready"), timeout, f"Prometheus ready at {url}", cluster)
    stack = Stack(url, round(time.monotonic() - started, 1))
    say(
        f"ready in {stack.seconds:.0f}s: KEDA's external metrics API, Prometheus at {url} ({PROMETHEUS_URL} in the cluster)"
    )
    return stack


def uninstall(cluster: LocalCluster, timeout: float = 180, log: Callable[[str], None] | None = None) -> None:
    """Remove what `install` applied. KEDA's ScaledObjects and ScaledJobs go first, while KEDA
    runs to remove their finalizers (else their namespaces never finish deleting); then every
    object in reverse order, the APIService before the metrics server behind it."""
    say = log or _log
    folder = cluster.dir / RENDERED
    if cluster.kubectl("get", "crd", "scaledobjects.keda.sh", check=False).returncode == 0:
        cluster.kubectl(
            "delete",
            "scaledobjects.keda.sh,scaledjobs.keda.sh",
            "--all",
            "--all-namespaces",
            f"--timeout={timeout:.0f}s",
            timeout=timeout + 10,
        )
    for name in ("prometheus", "keda"):
        path = folder / f"{name}.yaml"
        if not path.is_file():
            continue
        objects = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        listed = {"apiVersion": "v1", "kind": "List", "items": objects[::-1]}
        cluster.kubectl(
            "delete",
            "--ignore-not-found",
            f"--timeout={timeout:.0f}s",
            "-f",
            "-",
            input=json.dumps(listed),
            timeout=timeout + 10,
        )
        path.unlink()
        say(f"removed {name}")


def _rolled_out(cluster: LocalCluster, namespace: str, name: str) -> bool:
    """As `kubectl rollout status`: the Deployment's spec seen, every replica of it available, no
    older one left (a reinstall with a new configuration rolls Prometheus)."""
    status, body = cluster.api("GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}")
    if status != 200:
        return False
    seen = body.get("status", {})
    replicas = (seen.get("updatedReplicas"), seen.get("availableReplicas"), seen.get("replicas"))
    return (
        seen.get("observedGeneration") == body["metadata"]["generation"] and replicas == (body["spec"]["replicas"],) * 3
    )


def _apiservice_available(cluster: LocalCluster) -> bool:
    status, body = cluster.api("GET", f"/apis/apiregistration.k8s.io/v1/apiservices/{APISERVICE}")
    conditions = body.get("status", {}).get("conditions", []) if status == 200 else []
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def _pod_ip(cluster: LocalCluster) -> str:
    selector = ",".join(f"{k}%3D{v}" for k, v in PROMETHEUS_LABELS.items())
    _, body = cluster.api("GET", f"/api/v1/namespaces/{MONITORING_NAMESPACE}/pods?labelSelector={selector}")
    (ip,) = {
        p["status"]["podIP"]
        for p in body["items"]
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    }
    return str(ip)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _wait(check: Callable[[], bool], timeout: float, what: str, cluster: LocalCluster) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pods = [
                cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
                for namespace in (KEDA_NAMESPACE, MONITORING_NAMESPACE)
            ]
            raise AutoscalingError(f"timed out after {timeout:.0f}s waiting for {what}\n{''.join(pods)}")
        time.sleep(1)


def _log(msg: str) -> None:
    print(f"[autoscaling] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_dev.localcluster.autoscaling",
        description="Install KEDA and Prometheus on a running local cluster (build them first: make autoscaling).",
    )
    parser.add_argument("command", choices=("up", "down"))
    parser.add_argument("--dir", help="cluster folder (default: .cluster in the repo root)")
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.dir or REPO / ".cluster")
    try:
        if args.command == "up":
            stack = install(cluster)
            print(f"Prometheus: {stack.prometheus_url} (from pods: {stack.prometheus_in_cluster})")
            print(f"kubectl --kubeconfig {cluster.kubeconfig} get --raw /apis/external.metrics.k8s.io/v1beta1")
        else:
            uninstall(cluster)
    except (AutoscalingError, ClusterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
