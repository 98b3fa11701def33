"""Two peered operator replicas: one reconciles, the other stands by and takes over."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import yaml

from epd_dev.operator_process import OperatorProcess, wait_for
from epd_dev.paths import REPO

from .test_reconcile import EXAMPLES, apply, wait_condition

pytestmark = pytest.mark.cluster

PEERING_CRDS = REPO / "charts" / "epd-operator" / "crds" / "kopf-peerings.kopf.dev.yaml"


def reconciles(operator: OperatorProcess) -> float:
    for line in operator.metrics().splitlines():
        if line.startswith('epd_reconciles_total{result="success"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def peers(cluster, crd, tmp_path: Path):
    cluster.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "epd-test-peering"}}
        ),
    )
    others = OperatorProcess.running(cluster.kubeconfig)
    for operator in others:  # only these two may reconcile while the test runs
        operator.stop()
    args = ["--all-namespaces", "--peering", "epd-test-peering", "--priority", "random"]
    replicas = [
        OperatorProcess(cluster.kubeconfig, tmp_path / f"replica-{i}", extra_args=args).start() for i in range(2)
    ]
    yield replicas
    for replica in replicas:
        replica.stop()
    for operator in others:
        operator.start()


def test_one_replica_works_and_the_other_takes_over(cluster, namespace, peers):
    def apply_and_wait(name: str) -> None:
        manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
        manifest["metadata"]["name"] = name
        apply(cluster, namespace, manifest)
        wait_condition(cluster, namespace, name, "Ready", "True", timeout=120)

    # While the peers discover each other both may work for a moment: settle on a first object.
    apply_and_wait("first")
    before = [reconciles(p) for p in peers]
    apply_and_wait("second")
    grew = [p for p, count in zip(peers, before) if reconciles(p) > count]
    assert len(grew) == 1, [p.tail(20) for p in peers]  # exactly one replica works
    (leader,) = grew
    (standby,) = [p for p in peers if p is not leader]

    idle = reconciles(standby)
    leader.kill(signal.SIGTERM)  # a graceful exit withdraws from the peering at once
    apply_and_wait("third")
    wait_for(lambda: reconciles(standby) > idle, 30, "the standby to take over", standby.tail)
