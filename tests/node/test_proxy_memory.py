"""The EPD proxy's memory bound on the real node, under its container's real cgroup limit: the
proxy container exactly as the operator renders it (the operator's image, 1Gi limit, default
bounds), flooded from the host with the costliest primed requests at once (64 MiB ASCII bodies,
bodies of 4-byte characters, dense JSON), stays under its limit and is never OOM-killed: the
memory budget lets N = 1 worst-case request be parsed and primed at a time (docs/proxy.md,
"Memory: what parsed JSON can cost"), the rest wait their turn.

Its encoder is a STAND-IN in a second container of the pod: a socket that accepts and never
answers, so every prime hangs until the prime timeout and each request holds its reservation as
long as it can. Nothing is forwarded (no prime ever succeeds), so no upstream is needed.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from epd_dev.images import recipes
from epd_dev.localcluster import node
from epd_operator.render import render
from epd_operator.resources import proxy_container
from epd_operator.validation import validate
from tests.node.conftest import get, kubelet_view

pytestmark = [pytest.mark.node, pytest.mark.cluster]

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "encoder-regular.yaml"
NAME = "proxy-memory"
MiB = 1024 * 1024
GiB = 1024 * MiB
PRIME_TIMEOUT = 15  # each request holds its reservation this long, then gets a 502


def pod_manifest() -> dict:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["proxy"] = {"primeTimeoutSeconds": PRIME_TIMEOUT}
    checked = validate(manifest["spec"])
    (plan, *_) = render(checked, namespace="ns", name=NAME, uid="uid-1")
    proxy = proxy_container(checked.spec, NAME, plan, recipes.OPERATOR_REF)
    proxy.pop("readinessProbe")  # through the front port to an upstream this pod has not
    (encoder,) = plan.unit_encoders
    silent = {
        "name": "silent-encoder-standin",
        "image": recipes.OPERATOR_REF,
        "command": ["python3", "-c"],
        "args": [
            (
                "import socket, time\n"
                "s = socket.socket()\n"
                f"s.bind(('127.0.0.1', {encoder.port}))\n"
                "s.listen(4096)\n"
                "time.sleep(3600)\n"
            )
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": proxy["securityContext"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": NAME},
        "spec": {
            "containers": [proxy, silent],
            # The unit's /dev/shm, where the proxy looks up (and leases) EC store entries.
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}],
            "nodeSelector": dict(node.NODE_SELECTOR),
            "tolerations": list(node.TOLERATIONS),
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 30,  # over the rendered preStop sleep
        },
    }


def cgroup(container_id: str) -> Path:
    """The container's memory cgroup on the host (cgroup v1, the kubelet's cgroupfs driver)."""
    found = list((node.CGROUP_ROOT / "memory").glob(f"{node.KUBEPODS}/**/{container_id.removeprefix('containerd://')}"))
    assert len(found) == 1, found
    return found[0]


def body(kind: str) -> bytes:
    """The costliest primed bodies under the 64 MiB limit, each with one image part."""
    if kind == "ascii":  # 388 MiB reserved: one at a time under the 600 MiB budget
        url = "data:image/png;base64," + "A" * (64 * MiB - 1024)
        return json.dumps(chat(url)).encode()
    if kind == "wide":  # one emoji makes every copy 4-byte characters: 16 bytes a byte reserved
        url = "data:image/png;base64," + "A" * (40 * MiB) + "\U0001f600"
        return json.dumps(chat(url), ensure_ascii=False).encode()
    dense = b",".join([b"{}"] * (16 * MiB // 3))  # dense JSON: 100 bytes a value reserved
    return (
        b'{"model": "m", "extra": ['
        + dense
        + b'], "messages": '
        + json.dumps(chat("https://i.test/x")["messages"]).encode()
        + b"}"
    )


def chat(url: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.fixture(scope="module")
def proxy_pod(cluster, real_node, node_images, node_namespace):
    cluster.kubectl("apply", "-n", node_namespace, "-f", "-", input=yaml.safe_dump(pod_manifest()))
    deadline = time.monotonic() + 180
    while True:
        pod = get(cluster, "pod", NAME, "-n", node_namespace)
        if all(cid for cid, _, _ in kubelet_view(pod).values()) and pod["status"].get("podIP"):
            break
        assert time.monotonic() < deadline, json.dumps(pod["status"], indent=1)[-2000:]
        time.sleep(1)
    yield pod
    cluster.kubectl("delete", "pod", NAME, "-n", node_namespace, "--grace-period=0", "--wait=false", check=False)


async def test_the_costliest_requests_at_once_stay_under_the_proxys_memory_limit(cluster, node_namespace, proxy_pod):
    url = f"http://{proxy_pod['status']['podIP']}:{proxy_pod['spec']['containers'][0]['ports'][0]['containerPort']}"
    container_id, _, _ = kubelet_view(proxy_pod)[proxy_pod["spec"]["containers"][0]["name"]]
    memory = cgroup(container_id)
    limit = int((memory / "memory.limit_in_bytes").read_text())
    assert limit == 1 * GiB  # the rendered container's limit, enforced by its cgroup
    (memory / "memory.max_usage_in_bytes").write_text("0")  # the peak from now on
    bodies = {kind: body(kind) for kind in ("ascii", "wide", "dense")}
    flood = ["ascii"] * 6 + ["wide"] * 2 + ["dense"] * 2

    async def send(http: aiohttp.ClientSession, kind: str) -> int | str:
        try:
            async with http.post(url + "/v1/chat/completions", data=bodies[kind]) as response:
                await response.read()
                return response.status
        except aiohttp.ClientError as error:
            return repr(error)

    timeout = aiohttp.ClientTimeout(total=PRIME_TIMEOUT * 8)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        statuses = await asyncio.gather(*(send(http, kind) for kind in flood))
    peak = int((memory / "memory.max_usage_in_bytes").read_text())
    oom = (memory / "memory.oom_control").read_text()
    pod = get(cluster, "pod", NAME, "-n", node_namespace)
    restarts = {name: count for name, (_, count, _) in kubelet_view(pod).items()}
    print(f"statuses {statuses}; peak {peak / MiB:.0f} MiB of {limit / MiB:.0f} MiB; {oom!r}")
    # Every request answered: a 502 once its prime timed out, a 503 if no room came within the
    # body timeout (a 408 if the room came but the time left was too short to read the body), a
    # 413 for a body that alone would take more than the budget.
    assert set(statuses) <= {408, 413, 502, 503}, statuses
    # One at a time, 15 s each: the first four are parsed and primed within the 60 s body timeout.
    assert statuses[:4] == [502] * 4, statuses
    assert peak < limit and "oom_kill 0" in oom, (peak, oom)
    assert set(restarts.values()) == {0}, restarts
