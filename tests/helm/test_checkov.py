"""checkov, a well-known IaC scanner nobody here wrote, on what a user would scan: the objects
the operator creates for the examples (`epd-operator render --objects`) and the chart.

Its findings must be the short list of opinionated checks docs/security.md explains, nothing
else (before the hardening it failed 69 checks: no securityContext, no requests, no
NetworkPolicy, root, NET_RAW, seccomp, service-account tokens, ...).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import yaml

from epd_dev.vllm import envs

from .chart import CHART, ROOT, template

pytestmark = pytest.mark.vllm  # checkov's venv comes with `make vllm-envs`

EXAMPLES = ("encoder-prefill-decode.yaml", "encoder-pools.yaml", "encoder-regular.yaml")

# Check id -> why it is left failing (docs/security.md, "What checkov says").
OPINIONATED = {
    "CKV_K8S_11": "CPU limits: they throttle the engines' host threads; requests size them",
    "CKV_K8S_15": "pull policy Always: IfNotPresent is Kubernetes' default for tagged images",
    "CKV_K8S_43": "image digests: the examples name tags; a user pins digests in spec.image",
    "CKV_K8S_21": "the default namespace: render --objects uses it when the manifest names none",
}


def scan(folder: Path) -> dict[str, set[str]]:
    """checkov's failed checks, by check id -> the resources failing it."""
    out = subprocess.run(
        [
            str(envs.checkov_binary()),
            "-d",
            str(folder),
            "--framework",
            "kubernetes",
            "--quiet",
            "--compact",
            "-o",
            "json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.stdout.strip(), f"checkov said nothing on stdout (exit {out.returncode}): {out.stderr[-2000:]}"
    reports = json.loads(out.stdout)
    failed: dict[str, set[str]] = defaultdict(set)
    for report in reports if isinstance(reports, list) else [reports]:
        for check in report["results"]["failed_checks"]:
            failed[check["check_id"]].add(check["resource"])
    return failed


def loopback_router_units(objects: str) -> set[str]:
    """checkov's names of the unit StatefulSets whose only unprobed container is vllm-router
    behind the EPD proxy: it listens on the pod's loopback, which no kubelet probe reaches, and
    the proxy's readiness asks through it instead (docs/proxy.md, "Health and readiness")."""
    found = set()
    for obj in yaml.safe_load_all(objects):
        if not obj or obj["kind"] != "StatefulSet":
            continue
        containers = obj["spec"]["template"]["spec"]["containers"]
        unprobed = [c for c in containers if "readinessProbe" not in c and "livenessProbe" not in c]
        if [c["name"] for c in unprobed] == ["router"] and any(c["name"] == "proxy" for c in containers):
            args = unprobed[0]["args"]
            assert args[args.index("--host") + 1] == "127.0.0.1"
            found.add(f"StatefulSet.default.{obj['metadata']['name']}")
    return found


def test_checkov_finds_nothing_but_the_documented_opinionated_checks(tmp_path):
    loopback_routers: set[str] = set()
    for example in EXAMPLES:
        objects = subprocess.run(
            [
                sys.executable,
                "-m",
                "epd_operator.cli",
                "render",
                "--objects",
                "-f",
                str(ROOT / "docs" / "examples" / example),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (tmp_path / example).write_text(objects)
        loopback_routers |= loopback_router_units(objects)
    (tmp_path / "chart.yaml").write_text(template({}).stdout)
    assert CHART.is_dir()

    failed = scan(tmp_path)

    unexpected = {check: sorted(resources) for check, resources in failed.items() if check not in OPINIONATED}
    # Only the operator needs its service-account token: it is the one pod that calls the API.
    operator_token = unexpected.pop("CKV_K8S_38", [])
    # Liveness and readiness probes: missing on the loopback router alone (above).
    assert loopback_routers
    for check in ("CKV_K8S_8", "CKV_K8S_9"):
        assert set(unexpected.pop(check, [])) <= loopback_routers, check
    assert unexpected == {}, "checkov failed checks docs/security.md does not explain"
    assert [r for r in operator_token if not r.startswith("Deployment.")] == []  # no unit pod mounts a token
    # The scan saw the operator's children: each StatefulSet fails only the opinionated checks.
    assert any(r.startswith("StatefulSet.") for r in failed["CKV_K8S_43"])
