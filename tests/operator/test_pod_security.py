"""The unit and encoder-pool pods pass Pod Security "restricted", as the real API server's
admission judges it (a server-side dry run in a namespace that enforces it)."""

from __future__ import annotations

import json

import pytest

from tests.operator.test_resources import children_of

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("example", ["encoder-regular.yaml", "encoder-prefill-decode.yaml", "encoder-pools.yaml"])
def test_pods_pass_restricted(cluster, namespace, example):
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    templates = [c for c in children_of(example) if c["kind"] == "StatefulSet"]
    assert templates
    for sts in templates:
        template = sts["spec"]["template"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": sts["metadata"]["name"], "labels": template["metadata"]["labels"]},
            "spec": template["spec"],
        }
        out = cluster.kubectl(
            "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False
        )
        assert out.returncode == 0, f"{sts['metadata']['name']}: {out.stderr}"
