"""The operator as users install it: `helm install` of charts/epd-operator, its pod on the real node.

The image is the local `localhost/epd-operator:dev` (images/, `make images`; never pulled), the
pod tolerates and selects epd-real-0, and it watches the namespaces given: the values a user gives,
nothing more (the cluster's DNS resolves the API server's name as on any cluster). The node tests
and `make demo` install it this way.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping
from typing import Any

from .images import recipes
from .localcluster import binaries
from .localcluster import node as real_node
from .paths import REPO

CHART = REPO / "charts" / "epd-operator"
RELEASE = "epd"


class ChartError(RuntimeError):
    pass


def values(watch: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """The chart's values a user of the local cluster gives: the local image (its containerd has
    it, so the chart's IfNotPresent never pulls), the real node's selector and toleration, and the
    namespaces to watch (`watch`; None: the chart's default, every namespace)."""
    repository, tag = recipes.OPERATOR_REF.rsplit(":", 1)
    given: dict[str, Any] = {
        "image.repository": repository,
        "image.tag": tag,
        "nodeSelector": real_node.NODE_SELECTOR,
        "tolerations": real_node.TOLERATIONS,
    }
    if watch is not None:
        given["watchNamespaces"] = watch
    return {**given, **extra}


def helm(cluster: Any, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """The control plane build's helm, against `cluster` (a LocalCluster: its env has KUBECONFIG
    and helm's caches in the cluster folder)."""
    out = subprocess.run(
        [str(binaries.bin_dir() / "helm"), *args],
        check=False,
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=timeout,
    )
    if check and out.returncode != 0:
        raise ChartError(f"helm {' '.join(args)} failed ({out.returncode}):\n{out.stderr.strip()}")
    return out


def install(cluster: Any, namespace: str, settings: Mapping[str, Any], timeout: float = 180) -> dict[str, Any]:
    """`helm install` into `namespace` with `settings` (dotted keys, as --set-json), waiting for
    the operator's pod; returns that pod."""
    flags = [arg for key, value in settings.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]
    helm(
        cluster,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        namespace,
        *flags,
        "--wait",
        "--timeout",
        f"{timeout:.0f}s",
        timeout=timeout + 30,
    )
    pods = json.loads(
        cluster.kubectl(
            "get", "pods", "-n", namespace, "-l", "app.kubernetes.io/name=epd-operator", "-o", "json"
        ).stdout
    )["items"]
    (pod,) = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return dict(pod)


def uninstall(cluster: Any, namespace: str) -> bool:
    """`helm uninstall` (waiting); False when there was no release."""
    return helm(cluster, "uninstall", RELEASE, "-n", namespace, "--wait", check=False).returncode == 0
