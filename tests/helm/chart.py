"""Running the real `helm` (built by `make cluster`) on charts/epd-operator."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_dev.localcluster import K8S_VERSION, binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "epd-operator"
GOLDEN = Path(__file__).parent / "golden"
# The local cluster's Kubernetes version: fixed so that `helm template`
# output does not depend on which Kubernetes version the helm binary was built against.
KUBE_VERSION = K8S_VERSION
# Release name and namespace of the golden renders.
RELEASE, RELEASE_NAMESPACE = "epd", "epd-system"


def helm_binary() -> Path:
    """The helm of the control-plane build; fail (never skip) when it is missing."""
    path = binaries.bin_dir() / "helm"
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm is not built ({path} missing). Build it once with:\n\n    make cluster\n", pytrace=False)
    return path


def helm(
    *args: str | os.PathLike, env: dict[str, str] | None = None, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run helm; ``env`` defaults to a private HELM_* home so nothing lands in $HOME."""
    if env is None:
        home = ROOT / ".pytest_cache" / "helm-home"
        env = {**os.environ, **{f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}
    out = subprocess.run(
        [str(helm_binary()), *map(str, args)], check=False, capture_output=True, text=True, env=env, timeout=timeout
    )
    if check and out.returncode != 0:
        raise AssertionError(f"helm {' '.join(map(str, args))} failed ({out.returncode}):\n{out.stderr}")
    return out


def set_args(values: dict[str, Any]) -> list[str]:
    """``--set-json`` flags for a flat {dotted.key: value} mapping (exact types, lists included)."""
    return [arg for key, value in values.items() for arg in ("--set-json", f"{key}={json.dumps(value)}")]


def template(
    values: dict[str, Any] | None = None, *, check: bool = True, namespace: str = RELEASE_NAMESPACE
) -> subprocess.CompletedProcess[str]:
    return helm(
        "template",
        RELEASE,
        CHART,
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
        *set_args(values or {}),
        check=check,
    )


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


AGGREGATE_LABELS = ("admin", "edit", "view")


def user_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ClusterRoles for users of EPDDeployments, aggregated into Kubernetes' default roles."""
    return [
        d
        for d in find(docs, "ClusterRole")
        if any(f"rbac.authorization.k8s.io/aggregate-to-{r}" in d["metadata"]["labels"] for r in AGGREGATE_LABELS)
    ]


def operator_roles(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's own ClusterRoles."""
    users = [r["metadata"]["name"] for r in user_roles(docs)]
    return [d for d in find(docs, "ClusterRole") if d["metadata"]["name"] not in users]


# The golden renders: name -> values. Regenerate with UPDATE_GOLDEN=1 (or `make chart-golden`).
GOLDEN_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {
        "watchNamespaces": ["team-a", "team-b"],
        "peering.enabled": True,
        "metrics.serviceMonitor.enabled": True,
        "monitoring.podMonitor.enabled": True,
        "monitoring.grafanaDashboard.enabled": True,
        "janitorScrape.rate": 2.5,
    },
}


def golden_path(case: str) -> Path:
    return GOLDEN / f"{case}.yaml"


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    """The `epd-operator` arguments of the chart's Deployment."""
    (deployment,) = find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]
