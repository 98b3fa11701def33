"""Two peered operator replicas: one reconciles, the other stands by and takes over."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from .harness import ROOT, OperatorProcess, wait_for
from .test_reconcile import EXAMPLES, apply, wait_condition

pytestmark = pytest.mark.cluster

PEERING_CRDS = ROOT / "charts" / "epd-operator" / "crds" / "kopf-peerings.kopf.dev.yaml"


def reconciles(operator: OperatorProcess) -> float:
    for line in operator.metrics().splitlines():
        if line.startswith('epd_reconciles_total{result="success"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def peers(cluster, crd, tmp_path: Path):
    cluster.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "epd-test-peering"}}))
    others = OperatorProcess.running(cluster.kubeconfig)
    for operator in others:  # only these two may reconcile while the test runs
        operator.stop()
    args = ["--all-namespaces", "--peering", "epd-test-peering", "--priority", "random"]
    replicas = [OperatorProcess(cluster.kubeconfig, tmp_path / f"replica-{i}", extra_args=args).start()
                for i in range(2)]
    yield replicas
    for replica in replicas:
        replica.stop()
    for operator in others:
        operator.start()


def test_one_replica_works_and_the_other_takes_over(cluster, namespace, peers):
    first = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    apply(cluster, namespace, first)
    wait_condition(cluster, namespace, "qwen-vl-regular", "Ready", "True", timeout=120)
    working = [p for p in peers if reconciles(p) > 0]
    assert len(working) == 1, [p.tail(20) for p in peers]
    (leader,) = working
    (standby,) = [p for p in peers if p is not leader]

    leader.kill(signal.SIGTERM)  # a graceful exit withdraws from the peering at once
    apply(cluster, namespace, EXAMPLES / "encoder-prefill-decode.yaml")
    wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)
    wait_for(lambda: reconciles(standby) > 0, 30, "the standby to reconcile", standby.tail)
