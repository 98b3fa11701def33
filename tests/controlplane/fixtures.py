"""Pytest plugin: the real local control plane, started once per test session.

Enable with ``pytest_plugins = ["tests.controlplane.fixtures"]`` (tests/conftest.py).

Fixtures:
  cluster     the started ``LocalCluster`` (session scope; stopped at session end), with the
              real node epd-real-0 unless EPD_TEST_REAL_NODES=0 or the machine's node belongs
              to another cluster (then the `real_node` fixture fails, saying which)
  real_node   that cluster's real node (fails, never skips, when it has none)
  kubectl     ``kubectl(*args, input=None, check=True)`` bound to that cluster
  namespace   a fresh namespace per test (deleted afterwards)
  k8s_api     a ``kubernetes.client.ApiClient`` for that cluster

The cluster folder is ``.cluster-test/`` in the repo root, or
``.cluster-test-2/``, ... while other sessions run (each session owns its
folder through a lock); EPD_TEST_CLUSTER_DIR forces one. Fixed places, so a
session killed hard leaves nothing behind: its components die with it, and the
next start in that folder clears whatever remains. Only one real node can run on a machine
(docs/local-cluster.md): the first session to start gets it; a session that finds it taken
runs its kwok-only tests and fails its node tests with the owner's folder.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from epd_dev.images.build import Builder
from epd_dev.localcluster import ClusterBusy, LocalCluster, binaries, node
from epd_dev.localcluster.node import NodeError, RealNode
from epd_dev.paths import REPO

BUILD_HINT = "make cluster"
# Why the session's cluster has no real node, when it has none (the `real_node` fixture says it).
NO_REAL_NODE = pytest.StashKey[str]()
# The node's images, imported while the tests that need none of them run.
IMPORT = pytest.StashKey["BackgroundImport"]()


class BackgroundImport(threading.Thread):
    """Imports the cached images into the real node's containerd (about 3 min for vLLM's 6 GB
    the first time): the session's first tests need none of them, so they run meanwhile, and the
    node tests wait for it (`wait`)."""

    def __init__(self, real: RealNode) -> None:
        super().__init__(name="node-images", daemon=True)
        self.real = real
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            Builder().import_cached(self.real)
        except BaseException as exc:  # noqa: BLE001 - handed to the node tests, which fail with it
            self.error = exc

    def wait(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


def require_binaries(real_nodes: int | None = None) -> None:
    """Fail (never skip) when what a cluster starts with has not been built (by default the
    session's, with the real node unless EPD_TEST_REAL_NODES=0)."""
    missing = binaries.missing_by_set(binaries.cluster_sets(_real_nodes() if real_nodes is None else real_nodes))
    if missing:
        pytest.fail(
            f"the local cluster's binaries are not built: {binaries.describe_missing(missing)}.\n"
            f"Build them once (about 15 min cold on 2 cores) with:\n\n    {BUILD_HINT}\n",
            pytrace=False,
        )


def _real_nodes() -> int:
    return 0 if os.environ.get("EPD_TEST_REAL_NODES") == "0" else 1


def _start_cluster() -> tuple[LocalCluster, str]:
    """The session's cluster, and why it has no real node ("" when it has one)."""
    env = os.environ.get("EPD_TEST_CLUSTER_DIR")
    candidates = (
        [Path(env)] if env else [REPO / (".cluster-test" if i == 1 else f".cluster-test-{i}") for i in range(1, 9)]
    )
    real = _real_nodes()
    for folder in candidates:
        # The cluster imports its own images (the pause image, CoreDNS's); the others come in the
        # background (BackgroundImport), while the tests that need none of them run.
        local = LocalCluster(folder, nodes=4, die_with_parent=True, real_nodes=real)
        try:
            return local.start(), "" if real else "EPD_TEST_REAL_NODES=0 turned it off"
        except ClusterBusy:
            continue  # another live test session owns it
        except NodeError as err:
            return LocalCluster(folder, nodes=4, die_with_parent=True).start(), str(err)
    pytest.fail(f"every test cluster folder is in use by other sessions: {candidates}", pytrace=False)


@pytest.fixture(scope="session")
def cluster(request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    require_binaries()
    before = node.host_footprint()
    local, no_real_node = _start_cluster()
    request.config.stash[NO_REAL_NODE] = no_real_node
    if local.real_nodes:
        request.config.stash[IMPORT] = BackgroundImport(local.real_node())
        request.config.stash[IMPORT].start()
    try:
        yield local
    finally:
        local.stop()
    # Stopping the real node leaves the host as it found it: the session errors otherwise.
    left = sorted(node.host_footprint() - before)
    if local.real_nodes and left:
        pytest.fail("stopping the real node left on the host:\n  " + "\n  ".join(left), pytrace=False)


@pytest.fixture(scope="session")
def real_node(cluster: LocalCluster, request: pytest.FixtureRequest) -> RealNode:
    if not cluster.real_nodes:
        pytest.fail(
            f"the session's cluster has no real node: {request.config.stash[NO_REAL_NODE]}.\n"
            "The node tests need it (root, make cluster; see docs/testing.md).",
            pytrace=False,
        )
    return cluster.real_node()


@pytest.fixture(scope="session")
def node_images_imported(real_node: RealNode, request: pytest.FixtureRequest) -> None:
    """The background import of the session's start, finished."""
    request.config.stash[IMPORT].wait()


@pytest.fixture(scope="session")
def kubectl(cluster: LocalCluster) -> Callable:
    return cluster.kubectl


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A new namespace whose default ServiceAccount exists (pods can be created at once)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 60
    while cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail(f"default ServiceAccount never appeared in namespace {name}")
        time.sleep(0.2)
    yield name
    # Do not wait: the namespace controller and kwok finish the job in the background.
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="session")
def k8s_api(cluster: LocalCluster):
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()
