"""What a local cluster's start needs and how long it waits, without starting one: the binary sets
its start checks are the ones `make demo` and `make cluster` build (binaries.cluster_sets), and a
first image import that takes longer than the start's timeout does not eat the waits after it.

The real node's start is driven here with STAND-IN processes (sleeps, and a kube-router stand-in
whose health port answers a moment after it starts, as the real one's does): the real node is the
machine's only one and belongs to the test session's cluster.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epd_dev import demo
from epd_dev.images import build as images
from epd_dev.localcluster import ClusterError, LocalCluster, binaries, node
from epd_dev.paths import REPO


@pytest.fixture
def nothing_built(monkeypatch):
    """A build cache where a set's binaries exist once `binaries.build` was called for it."""
    built: list[binaries.BinarySet] = []

    def build(force: bool = False, bset: binaries.BinarySet = binaries.CONTROL_PLANE) -> Path:
        built.append(bset)
        return binaries.bin_dir(bset)

    monkeypatch.setattr(binaries, "build", build)
    monkeypatch.setattr(
        binaries, "missing_binaries", lambda bset=binaries.CONTROL_PLANE: [] if bset in built else list(bset.names)
    )
    # The start itself is not what is tested: only that it finds every binary it checks.
    monkeypatch.setattr(LocalCluster, "_start", lambda self, timeout: None)
    return built


def build_command_args(command: list[str]) -> list[str]:
    """The arguments of a `python -m epd_dev.localcluster.build ...` command line."""
    module = command.index("epd_dev.localcluster.build")
    return command[module + 1 :]


def test_a_cluster_with_the_real_node_refuses_to_start_naming_each_missing_binary_and_its_folder(
    nothing_built, tmp_path
):
    with pytest.raises(ClusterError) as error:
        LocalCluster(tmp_path, real_nodes=1).start()
    message = str(error.value)
    for bset in binaries.cluster_sets(real_nodes=1):
        assert str(binaries.bin_dir(bset)) in message
        assert all(name in message for name in bset.names)
    assert "kube-router" in message and message.endswith("Build them once with: make cluster")


def test_the_demos_build_step_builds_every_binary_a_cluster_with_the_real_node_starts_with(nothing_built, tmp_path):
    binaries.main(build_command_args(demo.GO_BUILDS))
    LocalCluster(tmp_path, real_nodes=1).start()  # raises ClusterError naming what is missing


@pytest.mark.parametrize("real_nodes", ["0", "1"])
def test_make_cluster_builds_every_binary_the_cluster_starts_with(nothing_built, tmp_path, real_nodes):
    dry_run = subprocess.run(
        ["make", "-n", "--no-print-directory", "cluster", f"CLUSTER_REAL_NODES={real_nodes}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (line,) = [line for line in dry_run.splitlines() if "epd_dev.localcluster.build" in line]
    binaries.main(build_command_args(shlex.split(line)))
    LocalCluster(tmp_path, real_nodes=int(real_nodes)).start()
    assert binaries.MONITORING in nothing_built  # promtool, for the tests of the chart's alerts


class SlowImportNode:
    """A STAND-IN for the real node: its containerd, kubelet and kube-proxy are sleeps, its
    kube-router answers on its health port half a second after it starts."""

    def __init__(self, cluster_dir: Path) -> None:
        self.cluster_dir = cluster_dir
        self.recorded: dict[str, dict[str, int]] = {}

    def write_configs(self, pki: Path, kubeconfigs: Path) -> None:
        pass

    def containerd_args(self) -> list[str]:
        return ["600"]

    def containerd_ready(self) -> bool:
        return True

    def purge_containers(self) -> None:
        pass

    def kubelet_args(self, kubeconfigs: Path) -> list[str]:
        return ["600"]

    def kube_proxy_args(self) -> list[str]:
        return ["600"]

    def kube_router_args(self, kubeconfigs: Path, health_port: int) -> list[str]:
        return [str(health_port)]

    def record(self, processes: dict[str, dict[str, int]]) -> None:
        self.recorded = processes


KUBE_ROUTER_STANDIN = f"""#!{sys.executable}
import http.server, sys, time

class Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

time.sleep(0.5)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Healthz).serve_forever()
"""


def test_an_image_import_longer_than_the_start_timeout_leaves_every_later_wait_its_own_time(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE", str(tmp_path / "cache"))
    for bset in (binaries.NODE, binaries.NETWORK_POLICY):
        binaries.bin_dir(bset).mkdir(parents=True)
        for name in bset.names:
            standin = binaries.bin_dir(bset) / name
            standin.write_text(KUBE_ROUTER_STANDIN if name == "kube-router" else '#!/bin/sh\nexec sleep "$1"\n')
            standin.chmod(0o755)
    monkeypatch.setattr(node, "CONTAINERD", Path("/bin/sleep"))
    monkeypatch.setattr(images.Builder, "import_cached", lambda self, real, names: [])  # no containerd to import into
    timeout = 2.0
    imported = []

    def slow_import(real: object) -> None:
        time.sleep(timeout + 1)  # vLLM's 6 GB image takes minutes the first time
        imported.append(real)

    cluster = LocalCluster(tmp_path / "cluster", die_with_parent=True, on_node_runtime=slow_import)
    monkeypatch.setattr(cluster, "kubectl", lambda *args, **kwargs: None)  # kube-router's RBAC: no API server here
    for folder in ("logs", "run"):
        (cluster.dir / folder).mkdir(parents=True)
    cluster._api_host = "127.0.0.1"  # what the start has set by then; the node's processes are recorded with it
    real = SlowImportNode(cluster.dir)
    try:
        cluster._start_real_node(real, timeout)  # type: ignore[arg-type]  # a RealNode subclass's stand-in, duck-typed
        assert imported == [real]
        assert set(real.recorded) == {"containerd", "kubelet", "kube-proxy", "kube-router"}
    finally:
        cluster.stop(quiet=True)
