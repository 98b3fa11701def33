"""The client library finds a unit's encoders and router in the status the operator wrote."""

from __future__ import annotations

import pytest
import yaml

from epd_client import discover
from epd_dev.operator_process import get_json

from .test_reconcile import EXAMPLES, apply, wait_condition

pytestmark = pytest.mark.cluster


def test_discover_reads_units_from_the_live_status(cluster, namespace, epd_operator):
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    manifest["spec"]["replicas"] = 2
    apply(cluster, namespace, manifest)
    wait_condition(cluster, namespace, "qwen-vl-pd", "Ready", "True", timeout=120)

    endpoints = discover("qwen-vl-pd", namespace, kubeconfig=str(cluster.kubeconfig))

    model = endpoints.model("default")
    assert model.served_name == "Qwen/Qwen2.5-VL-7B-Instruct"
    pods = {
        p["metadata"]["name"]: p
        for p in get_json(cluster, "pods", "-n", namespace, "-l", "epd.vime.dev/deployment=qwen-vl-pd")["items"]
    }
    assert sorted(u.name for u in model.ready_units()) == sorted(pods)
    for unit in model.units:
        ip = pods[unit.pod]["status"]["podIP"]
        assert unit.encoder_urls == (f"http://{ip}:8100",)
        assert unit.entry_url == f"http://{ip}:8000"  # the unit's router, never an encoder
        assert unit.node == pods[unit.pod]["spec"]["nodeName"]
