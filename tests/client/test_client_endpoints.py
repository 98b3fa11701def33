"""Endpoints from a status dict or the cluster, the retry policy's checks, and what
importing the library drags in."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from epd_client import DiscoveryError, Endpoints, EndpointsError, RetryPolicy, Unit, discover

STATUS = {
    "observedGeneration": 3,
    "models": [
        {
            "name": "actor",
            "servedModelName": "Qwen/Qwen2-VL-2B",
            "ecStoragePath": "/dev/shm/vime-ec-actor",
            "units": [
                {
                    "name": "actor-0",
                    "pod": "demo-actor-0",
                    "node": "gpu-1",
                    "ready": True,
                    "encoderUrls": ["http://10.0.0.5:8001", "http://10.0.0.5:8002/"],
                    "routerUrl": "http://10.0.0.5:8000",
                    "consumerUrls": ["http://10.0.0.5:8010"],
                },
                {
                    "name": "actor-1",
                    "pod": "demo-actor-1",
                    "node": "gpu-2",
                    "ready": False,
                    "encoderUrls": ["http://10.0.0.6:8001"],
                    "routerUrl": None,
                    "consumerUrls": ["http://10.0.0.6:8010", "http://10.0.0.6:8011"],
                },
            ],
        },
        {"name": "critic", "units": [{"name": "critic-0", "encoderUrls": []}]},
    ],
}


def test_from_status() -> None:
    endpoints = Endpoints.from_status(STATUS)
    actor = endpoints.model("actor")
    assert actor.served_name == "Qwen/Qwen2-VL-2B"
    first, second = actor.units
    assert first == Unit(
        name="actor-0",
        encoder_urls=("http://10.0.0.5:8001", "http://10.0.0.5:8002"),
        router_url="http://10.0.0.5:8000",
        consumer_urls=("http://10.0.0.5:8010",),
        ready=True,
        pod="demo-actor-0",
        node="gpu-1",
    )
    # The entry URL is the router, else the first consumer.
    assert first.entry_url == "http://10.0.0.5:8000"
    assert second.entry_url == "http://10.0.0.6:8010"
    assert actor.ready_units() == (first,)
    # No servedModelName: the model's name is sent; a unit without "ready" is not ready.
    critic = endpoints.model("critic")
    assert critic.served_name == "critic"
    assert critic.units[0].ready is False


@pytest.mark.parametrize(
    "status",
    [{"models": [{"units": []}]}, {"models": [{"name": "m", "units": [{}]}]}, {"models": 3}],
)
def test_malformed_status(status) -> None:
    with pytest.raises(EndpointsError, match="malformed"):
        Endpoints.from_status(status)


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(deadline=0)
    with pytest.raises(ValueError):
        RetryPolicy(backoff=-1)


class FakeKubernetes:
    """Stands in for the kubernetes package: records the calls, returns ``obj``."""

    def __init__(self, obj: dict | None = None, error_status: int | None = None) -> None:
        calls: list[tuple] = []
        self.calls = calls

        class ApiException(Exception):
            def __init__(self, status: int) -> None:
                self.status, self.reason = status, "Not Found"

        class ApiClient:
            def close(self) -> None:
                calls.append(("close",))

        class CustomObjectsApi:
            def __init__(self, api_client: ApiClient) -> None:
                assert isinstance(api_client, ApiClient)

            def get_namespaced_custom_object(self, *args: str) -> dict | None:
                calls.append(("get", *args))
                if error_status:
                    raise ApiException(error_status)
                return obj

        def new_client_from_config(config_file: str | None = None) -> ApiClient:
            calls.append(("config", config_file))
            return ApiClient()

        self.client = types.SimpleNamespace(CustomObjectsApi=CustomObjectsApi, ApiException=ApiException)
        self.config = types.SimpleNamespace(
            new_client_from_config=new_client_from_config,
            ConfigException=RuntimeError,
            KUBE_CONFIG_DEFAULT_LOCATION="~/.kube/config",
        )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        package = types.ModuleType("kubernetes")
        package.client, package.config = self.client, self.config  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "kubernetes", package)


def test_discover_reads_the_epddeployment_status(monkeypatch) -> None:
    fake = FakeKubernetes({"status": STATUS})
    fake.install(monkeypatch)
    endpoints = discover("demo", "team-a", kubeconfig="/tmp/kubeconfig")
    assert fake.calls == [
        ("config", "/tmp/kubeconfig"),
        ("get", "epd.vime.dev", "v1alpha1", "team-a", "epddeployments", "demo"),
        ("close",),
    ]
    assert endpoints == Endpoints.from_status(STATUS)


@pytest.mark.parametrize(
    ("obj", "error_status", "message"),
    [({"spec": {}}, None, "no models"), (None, 404, "404")],
)
def test_discover_errors(monkeypatch, obj, error_status, message) -> None:
    fake = FakeKubernetes(obj, error_status)
    fake.install(monkeypatch)
    with pytest.raises(DiscoveryError, match=message):
        discover("demo", "team-a", kubeconfig="/tmp/kubeconfig")
    assert fake.calls[-1] == ("close",)


def test_discover_without_kubernetes_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # makes `import kubernetes` fail
    with pytest.raises(ImportError, match=r"pip install 'epd-operator\[discovery\]'"):
        discover("demo", "team-a")


def test_import_loads_neither_kopf_nor_kubernetes() -> None:
    code = (
        "import json, sys, epd_client\n"
        "print(json.dumps(sorted(m for m in sys.modules"
        " if m.split('.')[0] in ('kopf', 'kubernetes', 'epd_operator'))))"
    )
    operator_dir = Path(__file__).parents[2] / "operator"
    env = {**os.environ, "PYTHONPATH": str(operator_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []


def test_the_units_front_door_from_the_status_is_where_render_and_generate_go():
    status = {
        "models": [
            {
                "name": "default",
                "servedModelName": "m",
                "units": [
                    {
                        "name": "u-0",
                        "ready": True,
                        "encoderUrls": ["http://10.0.0.5:8100"],
                        "consumerUrls": ["http://10.0.0.5:8101", "http://10.0.0.5:8102"],
                        "entryUrl": "http://10.0.0.5:8000/",
                    }
                ],
            }
        ]
    }
    (unit,) = Endpoints.from_status(status).model("default").units
    assert unit.entry_url == "http://10.0.0.5:8000"  # the EPD proxy: the router behind it serves the loopback only
    # An operator before the proxy wrote no entryUrl: the router, else the first consumer.
    del status["models"][0]["units"][0]["entryUrl"]
    (unit,) = Endpoints.from_status(status).model("default").units
    assert unit.entry_url == "http://10.0.0.5:8101"
