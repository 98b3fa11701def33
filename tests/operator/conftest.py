"""Fixtures for tests that run the operator as a real process on the local control plane."""

from __future__ import annotations

from typing import Iterator

import pytest

from .harness import OperatorProcess


@pytest.fixture(scope="session")
def epd_operator(cluster, crd, tmp_path_factory) -> Iterator[OperatorProcess]:
    """One operator for the session, watching every namespace."""
    operator = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("operator")).start()
    yield operator
    operator.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the operator's log to failures: the usual reason a cluster test fails is in there."""
    outcome = yield
    report = outcome.get_result()
    operator = item.funcargs.get("epd_operator") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(operator, OperatorProcess):
        report.sections.append(("operator log (tail)", operator.tail(80)))


@pytest.fixture
def crd_without_cel(cluster, crd) -> Iterator[None]:
    """The CRD as on a cluster without CEL validation, so only the operator can refuse a layout."""
    import yaml

    from epd_operator.crd import build_crd

    from .harness import CRD

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(strip(build_crd())))
    yield
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
