"""What the operator benchmark and the chaos run share: the cluster they start, admin API
access, the example EPDDeployment, and the operator process they measure."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import ssl
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from ..localcluster import LocalCluster
from ..operator_process import OperatorProcess, install_crd
from ..paths import REPO, cache_root

OURS = "app.kubernetes.io/managed-by=epd-operator"
EPD_PATH = "/apis/epd.vime.dev/v1alpha1"
EXAMPLE = REPO / "docs" / "examples" / "encoder-regular.yaml"
# kwok nodes advertise 8 GPUs; a unit of the example needs 2 (encoder + regular engine), so
# 1,000 units plus the latency runs' need more: the benchmark's nodes advertise 32.
GPUS_PER_NODE = 32


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def runtime_python() -> Path:
    """A venv with the operator's runtime dependencies only, as the image installs them (the
    test venv also holds the `kubernetes` client, which kopf imports when present: ~10 MB of
    RSS the shipped operator does not have). Versions pinned to the test venv's; cached by them.
    The operator itself runs from source (PYTHONPATH), so it need not be reinstalled."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True, text=True
    ).stdout
    key = hashlib.sha256(("\n".join(project["dependencies"]) + frozen).encode()).hexdigest()[:12]
    venv = cache_root() / "runtime" / key
    python = venv / "bin" / "python"
    if python.exists():
        return python
    log(f"runtime venv: installing {', '.join(project['dependencies'])} into {venv} (once)")
    partial = venv.with_name(key + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(partial)], check=True)
    constraints = partial / "constraints.txt"
    constraints.write_text(frozen)
    subprocess.run(
        [
            str(partial / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-c",
            str(constraints),
            *project["dependencies"],
        ],
        check=True,
    )
    partial.rename(venv)  # a venv's scripts name their folder, but `python -m` works from anywhere
    return python


def start_cluster(folder: Path, nodes: int, gpus_per_node: int = GPUS_PER_NODE) -> LocalCluster:
    cluster = LocalCluster(folder, nodes=nodes, die_with_parent=True, log=lambda m: log(f"cluster: {m}"))
    cluster.start()
    set_node_gpus(cluster, gpus_per_node)
    install_crd(cluster)
    return cluster


def set_node_gpus(cluster: LocalCluster, gpus: int) -> None:
    """Advertise ``gpus`` GPUs per node (kwok keeps whatever capacity a node registered)."""
    api = Api(cluster)
    patch = {"status": {key: {"nvidia.com/gpu": str(gpus)} for key in ("capacity", "allocatable")}}
    try:
        for name in cluster.node_names:
            api.merge_patch(f"/api/v1/nodes/{name}/status", patch)
    finally:
        api.close()


def tls_context(cluster: LocalCluster) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    context.load_cert_chain(str(cluster.pki / "admin.crt"), str(cluster.pki / "admin.key"))
    return context


class Api:
    """Admin calls to the API server over one pooled client (kubectl per call costs ~0.2 s
    of CPU on this machine, which a benchmark polling 1,000 objects cannot afford)."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.http = httpx.Client(base_url=cluster.server, verify=tls_context(cluster), timeout=60)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        response.raise_for_status()
        return response.json()

    def merge_patch(self, path: str, body: dict[str, Any]) -> Any:
        return self.call("PATCH", path, json=body, headers={"Content-Type": "application/merge-patch+json"})

    def items(self, path: str, **params: str) -> list[dict[str, Any]]:
        return self.call("GET", path, params=params)["items"]

    def close(self) -> None:
        self.http.close()


def converged(epd: dict[str, Any]) -> bool:
    """Ready, for the current generation."""
    generation = epd["metadata"].get("generation")
    status = epd.get("status") or {}
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    return (
        status.get("observedGeneration") == generation
        and ready.get("status") == "True"
        and ready.get("observedGeneration") == generation
    )


def epd_manifest(name: str, **spec: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"].update(spec)
    return manifest


def create_namespace(cluster: LocalCluster, api: Api, name: str) -> str:
    cluster.kubectl("create", "namespace", name)
    # Pods are refused until the namespace's default ServiceAccount exists (kcm creates it).
    deadline = time.monotonic() + 60
    while not api.items(f"/api/v1/namespaces/{name}/serviceaccounts", fieldSelector="metadata.name=default"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {name}")
        time.sleep(0.2)
    return name


@contextlib.contextmanager
def session(
    folder: Path,
    nodes: int,
    *,
    operator_python: Path | None = None,
    operator_src: Path | None = None,
    gpus_per_node: int = GPUS_PER_NODE,
) -> Iterator[tuple[LocalCluster, Api, OperatorProcess]]:
    """A started cluster (GPU nodes, the CRD), its admin API and a started operator, all
    stopped at the end. The operator runs from `operator_src` (default: this clone's) and
    without the janitor scrape loop: kwok pods have no janitor, so it would only add noise."""
    cluster = start_cluster(folder, nodes, gpus_per_node)
    api = Api(cluster)
    env = {"PYTHONPATH": str(operator_src.resolve())} if operator_src else None
    operator = OperatorProcess(
        cluster.kubeconfig,
        folder / "operator",
        env=env,
        python=operator_python or sys.executable,
        # An image name of its own: a source tree has no installed version to name it by.
        extra_args=["--all-namespaces", "--janitor-scrape-interval", "0", "--janitor-image", "epd-operator:bench"],
    )
    try:
        operator.start()
        yield cluster, api, operator
    except BaseException:
        print(f"--- operator log (tail) ---\n{operator.tail(40)}", file=sys.stderr)
        raise
    finally:
        operator.stop()
        api.close()
        cluster.stop()
