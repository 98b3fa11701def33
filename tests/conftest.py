"""Shared pytest configuration: the real local control plane and the operator are session
fixtures; STAND-IN servers (tests/client, tests/proxy) are entered on one ExitStack per test."""

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from epd_dev.operator_process import OperatorProcess, install_crd
from epd_dev.standins.vllm_server import StandinServer

pytest_plugins = ["tests.controlplane.fixtures"]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


@pytest.fixture
def server(stack: ExitStack) -> Callable[..., StandinServer]:
    """``server(**kw)``: a stand-in vLLM server on its own thread, stopped after the test."""
    return lambda **kw: stack.enter_context(StandinServer(**kw))


@pytest.fixture(scope="session")
def crd(cluster) -> None:
    """The generated EPDDeployment CRD, installed once on the session's cluster."""
    install_crd(cluster)


@pytest.fixture(scope="session")
def epd_operator(cluster, crd, tmp_path_factory) -> Iterator[OperatorProcess]:
    """One operator for the session, watching every namespace (two would fight over objects)."""
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
