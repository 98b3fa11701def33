"""An operator for the smoke tests of `make bench` and `make chaos`, which kill and restart it.

tests/operator/conftest.py has the session's `epd_operator`, but a conftest's fixtures are
visible only below it. So this package starts its own operator and stops it when the
module ends; in a full run these tests come before tests/operator, so the two never overlap.
Two operators on one namespace would make the chaos counts meaningless, so a second live
operator on this cluster fails the test instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_dev.operator_process import OperatorProcess


def operators_on(kubeconfig: Path) -> list[int]:
    """Pids of `epd-operator run` processes using this kubeconfig."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ours = f"KUBECONFIG={kubeconfig}".encode()
            if b"epd_operator.cli" in argv and b"run" in argv and ours in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue  # not ours to read, or gone meanwhile
    return pids


@pytest.fixture(scope="module")
def bench_operator(cluster, crd, tmp_path_factory) -> Iterator[OperatorProcess]:
    others = operators_on(cluster.kubeconfig)
    if others:
        pytest.fail(f"another operator (pid {others}) watches this cluster: run tests/bench before tests/operator")
    operator = OperatorProcess(cluster.kubeconfig, tmp_path_factory.mktemp("bench-operator")).start()
    yield operator
    operator.stop()
