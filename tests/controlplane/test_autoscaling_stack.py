"""The autoscaling stack (hack/epd_dev/localcluster/autoscaling.py) end to end, with the
cluster's own HPA controller: KEDA installed from its own manifests and Prometheus scraping pods
as the chart's PodMonitor says, on the real node; then a KEDA ScaledObject with the `prometheus`
trigger scales a Deployment of stand-in encoders from 1 to 3 replicas and back as their gauge
rises and falls. The kube-controller-manager's HPA controller reads KEDA's external metric
through the aggregator (the APIService v1beta1.external.metrics.k8s.io, its certificates made by
KEDA's operator), and its SuccessfulRescale events say so.

Nothing is skipped: a missing build fails with the make target that builds it.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from epd_dev.images.build import KEY_LABEL, Builder
from epd_dev.localcluster import autoscaling, node
from epd_dev.localcluster.node import RealNode
from tests.node.conftest import RESTRICTED_CONTAINER

pytestmark = [pytest.mark.cluster, pytest.mark.node]

NAME = "encoders"
HPA = f"keda-hpa-{NAME}"  # the HPA KEDA makes for a ScaledObject
# The labels the operator gives an encoder's pod, which the chart's PodMonitor selects (the
# deployment names no EPDDeployment: an operator watching the namespace has nothing to reconcile).
POD_LABELS = {
    "app.kubernetes.io/name": "epd",
    "app.kubernetes.io/managed-by": "epd-operator",
    "epd.vime.dev/role": "encoder",
    "epd.vime.dev/deployment": "autoscaling-probe",
    "epd.vime.dev/model": "tiny",
}
METRIC = "vllm:num_requests_waiting"
PORT = 8000
# A stand-in encoder: vLLM's waiting-requests gauge on /metrics, set by a PUT of its new value.
EXPORTER = f"""
import http.server

waiting = 0.0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"# TYPE {METRIC} gauge\\n{METRIC} {{waiting}}\\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):
        global waiting
        waiting = float(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(204)
        self.end_headers()


http.server.ThreadingHTTPServer(("", {PORT}), Handler).serve_forever()
"""


@pytest.fixture(scope="module")
def base_image(real_node: RealNode) -> str:
    """The base image (python3) in the node's containerd: the stand-in encoders run it."""
    builder = Builder()
    image, archive = builder.image("base"), builder.cached("base")
    if archive is None:
        pytest.fail("the base image is not built. Build it with:\n\n    make images\n", pytrace=False)
    if f"{KEY_LABEL}={image.key}" not in real_node.ctr("images", "list", "name==" + image.ref).stdout:
        real_node.ctr("images", "import", str(archive), timeout=600)
        real_node.ctr("images", "label", image.ref, f"{KEY_LABEL}={image.key}")
    return image.ref


@pytest.fixture(scope="module")
def stack(cluster, real_node: RealNode) -> Iterator[autoscaling.Stack]:
    try:
        installed = autoscaling.install(cluster)
    except autoscaling.AutoscalingError as error:
        # What was applied goes: an APIService nobody serves stalls every namespace's deletion.
        autoscaling.uninstall(cluster)
        pytest.fail(str(error), pytrace=False)
    print(f"\nthe autoscaling stack installed in {installed.seconds:.0f}s")
    yield installed
    autoscaling.uninstall(cluster)


def objects(namespace: str, image: str, query: str) -> list[dict[str, Any]]:
    """The stand-in encoders' Deployment and the ScaledObject scaling it on `query`, with windows
    short enough for a test (the HPA's scale-down waits 5 min by default)."""
    selector = {"app.kubernetes.io/instance": NAME}
    container = {
        "name": "encoder-0",  # the PodMonitor keeps engines by container name
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", EXPORTER],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/metrics", "port": "http"}, "periodSeconds": 1},
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": RESTRICTED_CONTAINER,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**selector, **POD_LABELS}},
                "spec": {
                    "nodeSelector": node.NODE_SELECTOR,
                    "tolerations": node.TOLERATIONS,
                    "terminationGracePeriodSeconds": 1,  # python3 as pid 1 ignores SIGTERM
                    "containers": [container],
                },
            },
        },
    }
    quick = [{"type": "Percent", "value": 200, "periodSeconds": 5}]
    scaled_object = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"name": NAME},
            "pollingInterval": 5,
            "minReplicaCount": 1,
            "maxReplicaCount": 3,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 0, "policies": quick},
                        "scaleDown": {"stabilizationWindowSeconds": 0, "policies": quick},
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": autoscaling.PROMETHEUS_URL, "query": query, "threshold": "1"},
                }
            ],
        },
    }
    return [deployment, scaled_object]


def prometheus_query(stack: autoscaling.Stack, query: str) -> list[dict[str, Any]]:
    url = f"{stack.prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        return list(json.loads(response.read())["data"]["result"])


def set_waiting(cluster, namespace: str, value: float) -> list[str]:
    """Every stand-in encoder's gauge set to `value` (pod IPs are reachable from the host)."""
    pods = json.loads(
        cluster.kubectl("get", "pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={NAME}", "-o", "json").stdout
    )
    ips = [
        p["status"]["podIP"]
        for p in pods["items"]
        if p["status"].get("podIP") and not p["metadata"].get("deletionTimestamp")
    ]
    for ip in ips:
        request = urllib.request.Request(f"http://{ip}:{PORT}/", data=str(value).encode(), method="PUT")
        urllib.request.urlopen(request, timeout=5).close()
    return ips


def hpa(cluster, namespace: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "hpa", HPA, "-n", namespace, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait(check: Callable[[], Any], timeout: float, what: str, context: Callable[[], str]) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{context()}", pytrace=False)
        time.sleep(1)
    return result


def test_keda_scales_a_deployment_on_a_prometheus_gauge_through_the_clusters_hpa_controller(
    cluster, stack, base_image, namespace
):
    started = time.monotonic()
    query = f'max({METRIC}{{namespace="{namespace}", worker_type="encoder"}})'

    def context() -> str:
        return "\n".join(
            cluster.kubectl(*args, check=False).stdout
            for args in (
                ("get", "hpa,scaledobject,pods", "-n", namespace, "-o", "wide"),
                ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
            )
        )

    def replicas() -> tuple[int, int]:
        status = hpa(cluster, namespace).get("status", {})
        return status.get("desiredReplicas", -1), status.get("currentReplicas", -1)

    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects(namespace, base_image, query)))
    cluster.kubectl("rollout", "status", f"deployment/{NAME}", "-n", namespace, "--timeout=60s", timeout=70)

    # Scraped as the PodMonitor says: its relabelings' labels are on the series.
    (series,) = wait(
        lambda: prometheus_query(stack, f'{METRIC}{{namespace="{namespace}"}}'), 60, "the gauge in Prometheus", context
    )
    assert {k: series["metric"].get(k) for k in ("worker_type", "role", "deployment", "model", "container")} == {
        "worker_type": "encoder",
        "role": "encoder",
        "deployment": "autoscaling-probe",
        "model": "tiny",
        "container": "encoder-0",
    }
    # The HPA controller reads the external metric through the aggregator and KEDA's metrics server.
    wait(
        lambda: any(
            c["type"] == "ScalingActive" and c["status"] == "True"
            for c in hpa(cluster, namespace).get("status", {}).get("conditions", [])
        ),
        90,
        f"hpa/{HPA} ScalingActive (its external metric read)",
        context,
    )
    (metric,) = hpa(cluster, namespace)["spec"]["metrics"]
    assert metric["type"] == "External"
    # KEDA's admission webhooks answer the API server (through the certificate KEDA's operator
    # made): a second ScaledObject of the Deployment is refused, by the first one's ScaledObject or
    # its HPA, whichever the webhook finds first.
    _, scaled_object = objects(namespace, base_image, query)
    scaled_object["metadata"]["name"] = f"{NAME}-again"
    refused = cluster.kubectl("apply", "-f", "-", input=json.dumps(scaled_object), check=False)
    assert refused.returncode != 0
    assert 'admission webhook "vscaledobject.kb.io" denied the request' in refused.stderr, refused.stderr
    assert f"the workload '{NAME}' of type 'apps/v1.Deployment' is already managed by the" in refused.stderr

    set_waiting(cluster, namespace, 5)
    wait(lambda: replicas() == (3, 3), 120, "3 replicas", context)
    print(cluster.kubectl("get", "hpa", HPA, "-n", namespace).stdout)
    cluster.kubectl("rollout", "status", f"deployment/{NAME}", "-n", namespace, "--timeout=60s", timeout=70)

    assert len(set_waiting(cluster, namespace, 0)) == 3
    wait(lambda: replicas() == (1, 1), 120, "back to 1 replica", context)
    print(cluster.kubectl("get", "hpa", HPA, "-n", namespace).stdout)

    events = json.loads(
        cluster.kubectl(
            "get",
            "events",
            "-n",
            namespace,
            "--field-selector",
            f"involvedObject.name={HPA},reason=SuccessfulRescale",
            "-o",
            "json",
        ).stdout
    )["items"]
    messages = [e["message"] for e in events]
    assert any("New size: 3" in m for m in messages) and any("New size: 1" in m for m in messages), messages
    assert {e["source"].get("component") or e.get("reportingComponent") for e in events} == {
        "horizontal-pod-autoscaler"
    }
    print(f"scaled 1 -> 3 -> 1 in {time.monotonic() - started:.0f}s: {messages}")
