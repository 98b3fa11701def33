"""Shared pytest configuration: the real local control plane is a session fixture."""

import pytest

from tests.operator.harness import install_crd

pytest_plugins = ["tests.controlplane.fixtures"]


@pytest.fixture(scope="session")
def crd(cluster) -> None:
    """The generated EPDDeployment CRD, installed once on the session's cluster."""
    install_crd(cluster)
