"""Fixtures for installing the chart with the real helm on the session's local control plane."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .chart import CHART, helm, set_args


class Release:
    """One helm release of charts/epd-operator in a test namespace."""

    def __init__(self, cluster: Any, name: str, namespace: str):
        self.cluster, self.name, self.namespace = cluster, name, namespace

    def helm(self, *args: str, check: bool = True):
        return helm(*args, "--namespace", self.namespace, env=self.cluster.env(), check=check)

    def install(self, values: dict[str, Any] | None = None):
        # --wait: the Deployment must become Available (kwok runs the operator's pod).
        return self.helm("install", self.name, str(CHART), *set_args(values or {}), "--wait", "--timeout", "120s")

    def upgrade(self, values: dict[str, Any] | None = None):
        return self.helm("upgrade", self.name, str(CHART), *set_args(values or {}), "--wait", "--timeout", "120s")

    def uninstall(self, check: bool = True):
        return self.helm("uninstall", self.name, "--wait", "--timeout", "120s", check=check)

    def status(self) -> dict[str, Any]:
        return json.loads(self.helm("status", self.name, "-o", "json").stdout)

    @property
    def fullname(self) -> str:
        return f"{self.name}-epd-operator"


@pytest.fixture
def release(cluster, namespace) -> Iterator[Callable[[str], Release]]:
    """Make releases in the test namespace; whatever is left is uninstalled afterwards (the
    namespace's deletion would not remove the ClusterRole and ClusterRoleBinding)."""
    made: list[Release] = []

    def make(name: str = "epd") -> Release:
        made.append(Release(cluster, name, namespace))
        return made[-1]

    yield make
    for rel in made:
        rel.uninstall(check=False)


@pytest.fixture
def sole_operator(cluster) -> Iterator[None]:
    """No other operator on this cluster while the test runs.

    Only one operator may watch a namespace, and tests/operator's session-wide `epd_operator`
    watches every namespace: if it (or any other OperatorProcess on this cluster) runs, stop it
    for the test and start it again afterwards.
    """
    from epd_dev.operator_process import OperatorProcess

    running = OperatorProcess.running(cluster.kubeconfig)
    for operator in running:
        operator.stop()
    try:
        yield
    finally:
        for operator in running:
            operator.start()
