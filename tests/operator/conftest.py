"""Fixtures for the operator's cluster tests (the operator itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def crd_without_cel(cluster, crd) -> Iterator[None]:
    """The CRD as on a cluster without CEL validation, so only the operator can refuse a layout."""
    import yaml

    from epd_dev.operator_process import CRD
    from epd_operator.crd import build_crd

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "x-kubernetes-validations"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=yaml.safe_dump(strip(build_crd())))
    yield
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
