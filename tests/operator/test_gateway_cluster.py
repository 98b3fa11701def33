"""The EPD gateway on the real control plane (kwok nodes): the operator makes each model's gateway
with a ServiceAccount and a Role of its own; with nothing but that Role's token the gateway's
watches follow the units and the model's weights version, which a patch brings within a second."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import kopf
import pytest
import yaml

from epd_dataplane.gateway import UnitsView, watch_units
from epd_dataplane.watch import Api
from tests.operator.test_reconcile import apply, get_json, wait_condition
from tests.operator.test_resources import EXAMPLES

pytestmark = pytest.mark.cluster

NAME = "qwen-vl-regular"
ACCOUNT = f"{NAME}-gateway"


def manifest(version: str) -> dict:
    found = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    found["spec"]["replicas"] = 2
    found["spec"]["gateway"] = {"enabled": True}
    found["spec"]["models"][0]["weightsVersion"] = version
    return found


def gateway_credentials(cluster, namespace: str, tmp_path: Path) -> kopf.ConnectionInfo:
    """The gateway's own identity: a token of its ServiceAccount, the cluster's address and CA."""
    token = cluster.kubectl("create", "token", ACCOUNT, "-n", namespace, "--duration=10m").stdout.strip()
    config = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    server = config["clusters"][0]["cluster"]
    ca = tmp_path / "ca.crt"
    if "certificate-authority-data" in server:
        ca.write_bytes(base64.b64decode(server["certificate-authority-data"]))
    else:
        ca.write_text(Path(server["certificate-authority"]).read_text())
    return kopf.ConnectionInfo(server=server["server"], ca_path=str(ca), token=token)


def can(cluster, namespace: str, verb: str, what: str) -> bool:
    out = cluster.kubectl(
        "auth", "can-i", verb, what, "-n", namespace, f"--as=system:serviceaccount:{namespace}:{ACCOUNT}", check=False
    )
    return out.stdout.strip() == "yes"


async def test_the_gateway_follows_the_units_and_a_new_weights_version_within_a_second(
    cluster, namespace, epd_operator, tmp_path
):
    apply(cluster, namespace, manifest("step-1"))
    status = wait_condition(cluster, namespace, NAME, "Ready", "True")["status"]
    model = status["models"][0]
    gateway = get_json(cluster, "deployment", f"{NAME}-default-gateway", "-n", namespace)
    front = get_json(cluster, "service", f"{NAME}-default", "-n", namespace)
    assert front["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    # Its account reads this EPDDeployment and the EndpointSlices, and nothing else.
    assert can(cluster, namespace, "watch", f"epddeployments.epd.vime.dev/{NAME}")
    assert not can(cluster, namespace, "watch", "epddeployments.epd.vime.dev/another")
    assert can(cluster, namespace, "list", "endpointslices.discovery.k8s.io")
    for verb, what in (("get", "pods"), ("list", "secrets"), ("patch", f"epddeployments.epd.vime.dev/{NAME}")):
        assert not can(cluster, namespace, verb, what), (verb, what)

    view = UnitsView("default")
    api = Api(lambda: gateway_credentials(cluster, namespace, tmp_path))
    watching = asyncio.create_task(
        watch_units(api, view, namespace=namespace, deployment=NAME, units_service=model["unitsService"])
    )
    try:
        deadline = time.monotonic() + 30
        while not (view.synced and len(view.ready()) == 2):
            assert time.monotonic() < deadline, f"the gateway's watches never showed two ready units: {view}"
            await asyncio.sleep(0.05)
        assert {u.name for u in view.ready()} == {f"{model['statefulSet']}-0", f"{model['statefulSet']}-1"}
        assert all(u.front_url and u.front_url.endswith(f":{model['entryPort']}") for u in view.ready())
        assert view.weights_version == "step-1"
        # The trainer's bump after a weight sync: a merge patch of the spec, nothing restarts.
        patched = time.monotonic()
        patch = {"spec": {"models": [{**manifest("step-2")["spec"]["models"][0]}]}}
        cluster.kubectl("patch", "epd", NAME, "-n", namespace, "--type=merge", "-p", json.dumps(patch))
        while view.weights_version != "step-2":
            assert time.monotonic() - patched < 5, "the new version never reached the gateway"
            await asyncio.sleep(0.01)
        seen_after = time.monotonic() - patched
        print(f"\nweights version step-2 seen by the gateway {seen_after * 1000:.0f} ms after kubectl patch started")
        assert seen_after < 1.0
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await api.aclose()
    after = get_json(cluster, "deployment", f"{NAME}-default-gateway", "-n", namespace)
    assert after["metadata"]["generation"] == gateway["metadata"]["generation"]  # the bump rolled nothing
