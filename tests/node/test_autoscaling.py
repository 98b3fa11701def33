"""Encoders sized by demand, on the real node: the operator (installed by its chart) makes a KEDA
ScaledObject for a Pools model's encoder pool; KEDA (built from its module, installed as its
manifests install it) reads the proxies' primes in flight from Prometheus (scraping as the
chart's PodMonitor says), and the cluster's own HPA controller scales the pool's StatefulSet
through its scale subresource. The engines are STAND-INs (the vllm-standin image: vLLM 0.34, which
Pools needs, has no CPU build); everything else is real: pods on containerd, the proxies, KEDA,
Prometheus, the HPA controller, the openai SDK as the clients (hack/epd_dev/autoscale_demo.py).

A step of picture requests through the front door grows the pool from 1 to 3 encoders, the load's
end brings it back to 1; no request fails, no picture is encoded on a consumer, the prime p90 is
back under its target within one scale step, the operator never writes the pool's size
(managedFields), and the HPA's SuccessfulRescale events, `kubectl get hpa` and the
EPDDeployment's status say why. Prometheus labels the pool's engines as the PodMonitor says, and
KEDA's admission webhook refuses a second autoscaler of the pool."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import yaml

from epd_dev import autoscale_demo as scenario
from epd_dev.demo_serving import front_service_url
from epd_dev.localcluster import autoscaling
from epd_dev.operator_process import wait_for
from tests.node.conftest import get

pytestmark = [pytest.mark.node, pytest.mark.cluster]


@pytest.fixture(scope="module")
def stack(cluster, real_node, node_images) -> Iterator[autoscaling.Stack]:
    try:
        installed = autoscaling.install(cluster)
    except autoscaling.AutoscalingError as error:
        autoscaling.uninstall(cluster)  # an APIService nobody serves stalls every namespace's deletion
        pytest.fail(str(error), pytrace=False)
    yield installed
    autoscaling.uninstall(cluster)


@pytest.fixture(scope="module")
def deployed(cluster, stack, helm_operator, node_namespace) -> Iterator[str]:
    manifest = scenario.manifest(stack.prometheus_in_cluster)
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(manifest))
    wait_for(
        lambda: (get(cluster, "epd", scenario.NAME, "-n", node_namespace).get("status") or {}).get("phase") == "Ready",
        300,
        f"epd/{scenario.NAME} Ready",
        lambda: str(get(cluster, "epd", scenario.NAME, "-n", node_namespace).get("status")),
    )
    # The proxy finds the pool through DNS, which may answer empty for a while after the pool's
    # first pod became ready (a resolver's negative cache): the load starts once it has.
    wait_for(lambda: scenario.proxies_know_encoders(cluster, node_namespace), 60, "the unit's proxy knowing an encoder")
    yield front_service_url(cluster, node_namespace, scenario.NAME)
    cluster.kubectl("delete", "epd", scenario.NAME, "-n", node_namespace, "--wait=false", check=False)


def test_a_step_of_pictures_grows_the_encoder_pool_to_three_and_its_end_shrinks_it_to_one(
    cluster, stack, deployed, node_namespace
):
    run = scenario.run_scenario(cluster, node_namespace, deployed, stack.prometheus_url)
    run.consumer_encodes = scenario.consumer_encodes(cluster, node_namespace)
    writers = scenario.replica_writers(cluster, node_namespace)
    summary = scenario.summarise(run, int("epd-operator" in writers))
    print("\n" + summary.line())
    print(f"{summary}")
    assert run.failures == [], run.failures[:5]
    assert summary.most_encoders == scenario.MAX_ENCODERS and summary.last_encoders == 1
    assert run.consumer_encodes == 0
    # The pool's size is the HPA controller's, written through the scale subresource.
    assert writers.get("kube-controller-manager") == "Update/scale" and "epd-operator" not in writers, writers
    # The signal passed its target before the answers slowed (if they did at all); the grown pool
    # brought the prime p90 back under its target.
    assert summary.signal_crossed_at is not None, summary
    assert summary.answers_slowed_at is None or summary.signal_crossed_at < summary.answers_slowed_at, summary
    assert summary.prime_p90_after_scale is not None, summary
    assert summary.prime_p90_after_scale < scenario.PRIME_P90_TARGET_SECONDS, summary
    assert any("above target" in m for m in run.rescales) and any("below target" in m for m in run.rescales), (
        run.rescales
    )


def quantity(text: str) -> float:
    """A Kubernetes quantity as the HPA prints its targets: "1.500", "1500m"."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_kubectl_get_hpa_and_the_status_say_why(cluster, stack, deployed, node_namespace):
    hpa = get(cluster, "hpa", scenario.HPA, "-n", node_namespace)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": scenario.POOL}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    target = metric["external"]["target"]
    assert target["type"] == "AverageValue"
    assert quantity(target["averageValue"]) == scenario.TARGET_PRIMES_IN_FLIGHT  # KEDA writes "1.500"
    printed = cluster.kubectl("get", "hpa", scenario.HPA, "-n", node_namespace).stdout
    shown = re.search(r"/(\S+) \(avg\)", printed)
    assert scenario.POOL in printed and shown, printed
    assert quantity(shown.group(1)) == scenario.TARGET_PRIMES_IN_FLIGHT
    pool = get(cluster, "epd", scenario.NAME, "-n", node_namespace)["status"]["models"][0]["encoderPool"]
    assert pool["autoscaler"] == scenario.SCALED_OBJECT and pool["replicas"] >= 1


def test_kedas_webhook_keeps_the_pool_to_one_autoscaler_and_prometheus_labels_its_engines(
    cluster, stack, deployed, node_namespace
):
    # Scraped as the chart's PodMonitor says: the pool's engines by container name, with the
    # labels of the pod the operator made.
    selector = ",".join(
        f'{label}="{value}"'
        for label, value in {
            "namespace": node_namespace,
            "deployment": scenario.NAME,
            "model": scenario.MODEL,
            "role": "encoder-pool",
            "worker_type": "encoder",
            "container": "encoder-0",
        }.items()
    )
    assert (
        scenario.Prometheus(stack.prometheus_url).value(f"count(vllm:num_requests_waiting{{{selector}}})") or 0
    ) >= 1
    # KEDA's admission webhook answers the API server (through the certificate KEDA's operator
    # made): a second ScaledObject of the pool is refused, the operator's being the first.
    second = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": f"{scenario.SCALED_OBJECT}-again"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": scenario.POOL},
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": stack.prometheus_in_cluster, "query": "vector(1)", "threshold": "1"},
                }
            ],
        },
    }
    refused = cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(second), check=False)
    assert refused.returncode != 0
    assert 'admission webhook "vscaledobject.kb.io" denied the request' in refused.stderr, refused.stderr
    assert f"the workload '{scenario.POOL}' of type 'apps/v1.StatefulSet' is already managed by the" in refused.stderr
