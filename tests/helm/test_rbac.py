"""The chart's RBAC is enough for the operator, and no more.

The operator runs as a real process (tests/operator's harness) with a kubeconfig that holds
nothing but a token of the chart's ServiceAccount (TokenRequest API, `kubectl create token`),
exactly the identity its pod would have, and with the arguments of the chart's Deployment.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from epd_dev.operator_process import OperatorProcess, wait_for

from .chart import ROOT

pytestmark = pytest.mark.cluster

EXAMPLE = ROOT / "docs" / "examples" / "encoder-regular.yaml"
POOLS_EXAMPLE = ROOT / "docs" / "examples" / "encoder-pools.yaml"
GATE = "epd.vime.dev/encoders-ready"


def token_kubeconfig(cluster, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig with the cluster's server and CA and only a ServiceAccount token."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    (entry,) = admin["clusters"]
    server = entry["cluster"]["server"]
    ca = entry["cluster"]["certificate-authority-data"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority-data": ca}}],
                "users": [{"name": service_account, "user": {"token": token}}],
                "contexts": [
                    {
                        "name": "operator",
                        "context": {"cluster": "local", "user": service_account, "namespace": namespace},
                    }
                ],
                "current-context": "operator",
            }
        )
    )
    path.chmod(0o600)
    return path


def test_operator_reconciles_with_only_the_charts_namespaced_rbac(
    cluster, kubectl, namespace, release, sole_operator, tmp_path
):
    rel = release("epd")
    rel.install({"watchNamespaces": [namespace]})
    kubeconfig = token_kubeconfig(cluster, namespace, rel.fullname, tmp_path / "operator.kubeconfig")

    def as_operator(*args: str, check: bool = False):
        return kubectl("--kubeconfig", str(kubeconfig), *args, check=check)

    assert as_operator("auth", "whoami", "-o", "jsonpath={.status.userInfo.username}", check=True).stdout == (
        f"system:serviceaccount:{namespace}:{rel.fullname}"
    )

    # The pod's arguments, as rendered and installed; the harness adds its own free ports
    # for --liveness and --metrics-port (later flags win) and --standalone (already there).
    deployment = json.loads(kubectl("get", "deployment", rel.fullname, "-n", namespace, "-o", "json").stdout)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "run" and f"--namespace={namespace}" in args
    operator = OperatorProcess(kubeconfig, tmp_path, extra_args=args[1:]).start()
    try:
        kubectl("apply", "-n", namespace, "-f", str(EXAMPLE))
        kubectl("apply", "-n", namespace, "-f", str(POOLS_EXAMPLE))
        kubectl(
            "wait",
            "--for=condition=Ready",
            "epd/qwen-vl-regular",
            "epd/qwen-vl-pools",
            "-n",
            namespace,
            "--timeout=120s",
            timeout=130,
        )
        # The Pools units' readiness gate was written by this operator (kwok's pod-ready writes no reason).
        unit = json.loads(kubectl("get", "pod", "qwen-vl-pools-default-0", "-n", namespace, "-o", "json").stdout)
        gate = next(c for c in unit["status"]["conditions"] if c["type"] == GATE)
        assert (gate["status"], gate.get("reason")) == ("True", "EncodersReady"), gate
        # It was this operator: its own metrics count the ready unit.
        metrics = operator.metrics()
        assert any(
            line.startswith("epd_ready_units{")
            and f'namespace="{namespace}"' in line
            and 'name="qwen-vl-regular"' in line
            and line.endswith(" 1.0")
            for line in metrics.splitlines()
        ), metrics
        # A spec change: before its first apply to a child it created, the operator reads the child
        # and takes over its fields (get, then a patch of managedFields).
        kubectl(
            "patch",
            "epd",
            "qwen-vl-regular",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"env": [{"name": "EXTRA_SETTING", "value": "1"}]}}),
        )

        def changed() -> bool:
            sts = json.loads(
                kubectl(
                    "get",
                    "statefulset",
                    "qwen-vl-regular-default",
                    "-n",
                    namespace,
                    "-o",
                    "json",
                    "--show-managed-fields",
                ).stdout
            )
            ours = [e["operation"] for e in sts["metadata"]["managedFields"] if e["manager"] == "epd-operator"]
            env = sts["spec"]["template"]["spec"]["containers"][0].get("env") or []
            return ours == ["Apply"] and {"name": "EXTRA_SETTING", "value": "1"} in env

        wait_for(changed, 60, "the spec change applied")
        log = operator.tail(100_000)
    finally:
        operator.stop()
    refusals = [line for line in log.splitlines() if re.search(r"forbidden|HTTP/1\.1 403", line, re.IGNORECASE)]
    assert not refusals, "the operator hit a permission error:\n" + "\n".join(refusals)

    # Outside its role the same token is refused.
    denied = as_operator("get", "secrets", "-n", namespace)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    for verb, resource, where in [
        ("get", "secrets", ["-n", namespace]),
        ("create", "pods", ["-n", namespace]),
        ("update", "epddeployments.epd.vime.dev", ["-n", namespace]),  # never touches the spec
        ("delete", "epddeployments.epd.vime.dev", ["-n", namespace]),
        ("list", "epddeployments.epd.vime.dev", ["--all-namespaces"]),  # namespaced mode
        ("patch", "statefulsets.apps", ["-n", "default"]),
        ("update", "poddisruptionbudgets.policy", ["-n", namespace]),  # server-side apply is a patch
        ("create", "clusterroles.rbac.authorization.k8s.io", []),
        # Pod status: patch only, and nothing else of pods.
        ("patch", "pods", ["-n", namespace]),
        ("update", "pods", ["--subresource=status", "-n", namespace]),
        ("get", "pods", ["--subresource=status", "-n", namespace]),
        ("delete", "pods", ["-n", namespace]),
        ("patch", "pods", ["--subresource=status", "-n", "default"]),
    ]:
        answer = as_operator("auth", "can-i", verb, resource, *where).stdout.strip()
        assert answer == "no", f"the operator may {verb} {resource} {' '.join(where)}"
    for verb, resource, *extra in [
        ("list", "epddeployments.epd.vime.dev"),
        ("patch", "epddeployments.epd.vime.dev", "--subresource=status"),
        ("patch", "statefulsets.apps"),
        ("get", "services"),
        ("delete", "services"),
        ("watch", "pods"),
        ("patch", "poddisruptionbudgets.policy"),
        ("patch", "pods", "--subresource=status"),
        ("create", "events"),
    ]:
        answer = as_operator("auth", "can-i", verb, resource, *extra, "-n", namespace).stdout.strip()
        assert answer == "yes", f"the operator may not {verb} {resource} {' '.join(extra)}"
