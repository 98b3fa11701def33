"""Endpoints from a status dict or the cluster, the retry policy's checks, and what
importing the library drags in."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from epd_client import (
    DiscoveryError,
    Endpoints,
    EndpointsError,
    Engine,
    ModelEndpoints,
    RetryPolicy,
    Unit,
    discover,
)

from .helpers import endpoint_slice, model_status

ACTOR = model_status(
    "actor",
    "demo-actor",
    3,
    [("encoder-0", "encoder", 8001), ("encoder-1", "encoder", 8002), ("regular-0", "regular", 8010)],
    entry_port=8000,
    served_model_name="Qwen/Qwen2-VL-2B",
)
STATUS = {"observedGeneration": 3, "models": [ACTOR, model_status("critic", "demo-critic", 1, [])]}
SLICES = [
    endpoint_slice("demo-actor-units", ("demo-actor-0", "10.0.0.5", True)),
    endpoint_slice("demo-actor-units", ("demo-actor-1", "10.0.0.6", False), node="gpu-2"),
    endpoint_slice("someone-elses", ("demo-actor-2", "10.0.0.9", True)),  # another Service's: not a unit of ours
]


def test_from_status_and_endpoint_slices() -> None:
    endpoints = Endpoints.from_status(STATUS, SLICES)
    actor = endpoints.model("actor")
    assert actor.served_name == "Qwen/Qwen2-VL-2B"
    first, second, third = actor.units
    assert first == Unit(
        name="demo-actor-0",
        encoder_urls=("http://10.0.0.5:8001", "http://10.0.0.5:8002"),
        consumer_urls=("http://10.0.0.5:8010",),
        front_url="http://10.0.0.5:8000",
        ready=True,
        pod="demo-actor-0",
        node="gpu-1",
        engines=(
            Engine("demo-actor-0", "encoder-0", "encoder", "http://10.0.0.5:8001"),
            Engine("demo-actor-0", "encoder-1", "encoder", "http://10.0.0.5:8002"),
            Engine("demo-actor-0", "regular-0", "regular", "http://10.0.0.5:8010"),
        ),
    )
    # The entry URL is the unit's front door (its EPD proxy).
    assert first.entry_url == "http://10.0.0.5:8000"
    # Not serving (its pod is not Ready): listed, never used.
    assert (second.ready, second.node, second.entry_url) == (False, "gpu-2", "http://10.0.0.6:8000")
    # No endpoint in the units Service's slices (no IP yet): listed, not ready, no URL.
    assert (third.name, third.ready, third.entry_url, third.encoder_urls) == ("demo-actor-2", False, None, ())
    assert [e.url for e in third.engines] == [None, None, None]
    assert actor.ready_units() == (first,) and actor.unit_for("any key") == first
    assert actor.unit("demo-actor-1") == second and actor.unit("demo-actor-9") is None
    # No servedModelName: the model's name is sent.
    critic = endpoints.model("critic")
    assert critic.served_name == "critic" and critic.units[0].ready is False


def test_a_terminating_pod_is_not_a_ready_unit() -> None:
    terminating = endpoint_slice("demo-actor-units", ("demo-actor-0", "10.0.0.5", True))
    terminating["endpoints"][0]["conditions"]["terminating"] = True
    assert Endpoints.from_status(STATUS, [terminating]).model("actor").units[0].ready is False


def test_an_ipv6_unit_gets_brackets_in_its_urls() -> None:
    slices = [endpoint_slice("demo-actor-units", ("demo-actor-0", "fd00::5", True))]
    unit = Endpoints.from_status(STATUS, slices).model("actor").units[0]
    assert unit.entry_url == "http://[fd00::5]:8000" and unit.encoder_urls[0] == "http://[fd00::5]:8001"


def test_a_unit_is_chosen_for_a_key_among_thousands_building_only_that_one() -> None:
    model = model_status("actor", "big-actor", 5000, [("encoder-0", "encoder", 8001), ("regular-0", "regular", 8010)])
    pods = [(f"big-actor-{i}", f"10.1.{i // 250}.{i % 250}", i % 10 != 3) for i in range(5000)]
    slices = [endpoint_slice("big-actor-units", *pods[i : i + 100]) for i in range(0, 5000, 100)]
    actor = Endpoints.from_status({"models": [model]}, slices).model("actor")
    chosen = actor.unit_for("sample-17")
    # The same choice as among the same units built by hand.
    assert chosen.ready and chosen == ModelEndpoints("actor", actor.ready_units()).unit_for("sample-17")
    assert len(actor.units) == 5000 and len(actor.ready_units()) == 4500


def test_a_key_keeps_its_unit_across_client_releases() -> None:
    """Rollout workers on different client versions must agree on a sample's unit: the weights
    are blake2b (8 bytes) of ``key NUL unit name``, pinned here."""
    units = tuple(Unit(name=f"actor-{i}") for i in range(8))
    actor = ModelEndpoints("actor", units)
    assert [actor.unit_for(f"sample-{k}").name for k in range(6)] == [
        "actor-1",
        "actor-6",
        "actor-3",
        "actor-2",
        "actor-3",
        "actor-3",
    ]


@pytest.mark.parametrize(
    "status",
    [{"models": [{"units": []}]}, {"models": [{"name": "m", "statefulSet": "s"}]}, {"models": 3}],
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
    """Stands in for the kubernetes package: records the calls, answers ``obj`` and ``slices``
    as raw JSON (what discover asks for)."""

    def __init__(self, obj: dict | None = None, error_status: int | None = None, slices: list | None = None) -> None:
        calls: list[tuple] = []
        self.calls = calls
        collecting: list[bool] = []  # whether cyclic garbage collection ran at each answer
        self.collecting = collecting

        class ApiException(Exception):
            def __init__(self, status: int) -> None:
                self.status, self.reason = status, "Not Found"

        class ApiClient:
            def close(self) -> None:
                calls.append(("close",))

        def answer(document: object) -> types.SimpleNamespace:
            collecting.append(gc.isenabled())
            return types.SimpleNamespace(data=json.dumps(document).encode())

        class CustomObjectsApi:
            def __init__(self, api_client: ApiClient) -> None:
                assert isinstance(api_client, ApiClient)

            def get_namespaced_custom_object(self, *args: str, _preload_content: bool) -> types.SimpleNamespace:
                assert _preload_content is False
                calls.append(("get", *args))
                if error_status:
                    raise ApiException(error_status)
                return answer(obj)

        class DiscoveryV1Api:
            def __init__(self, api_client: ApiClient) -> None:
                assert isinstance(api_client, ApiClient)

            def list_namespaced_endpoint_slice(
                self, namespace: str, *, label_selector: str, _preload_content: bool
            ) -> types.SimpleNamespace:
                assert _preload_content is False
                calls.append(("list endpointslices", namespace, label_selector))
                return answer({"items": slices or []})

        def new_client_from_config(config_file: str | None = None) -> ApiClient:
            calls.append(("config", config_file))
            return ApiClient()

        self.client = types.SimpleNamespace(
            CustomObjectsApi=CustomObjectsApi, DiscoveryV1Api=DiscoveryV1Api, ApiException=ApiException
        )
        self.config = types.SimpleNamespace(
            new_client_from_config=new_client_from_config,
            ConfigException=RuntimeError,
            KUBE_CONFIG_DEFAULT_LOCATION="~/.kube/config",
        )

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        package = types.ModuleType("kubernetes")
        package.client, package.config = self.client, self.config  # type: ignore[attr-defined]  # a module made here, standing for kubernetes
        monkeypatch.setitem(sys.modules, "kubernetes", package)


def test_discover_reads_the_status_then_the_endpoint_slices_it_names(monkeypatch) -> None:
    fake = FakeKubernetes({"status": STATUS}, slices=SLICES[:2])
    fake.install(monkeypatch)
    endpoints = discover("demo", "team-a", kubeconfig="/tmp/kubeconfig")
    assert fake.calls == [
        ("config", "/tmp/kubeconfig"),
        ("get", "epd.vime.dev", "v1alpha1", "team-a", "epddeployments", "demo"),
        ("list endpointslices", "team-a", "kubernetes.io/service-name in (demo-actor-units,demo-critic-units)"),
        ("close",),
    ]
    assert endpoints == Endpoints.from_status(STATUS, SLICES[:2])


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


@pytest.mark.parametrize("fails", [False, True])
def test_discover_pauses_garbage_collection_while_it_reads_and_restores_it(monkeypatch, fails) -> None:
    fake = FakeKubernetes(None if fails else {"status": STATUS}, 404 if fails else None, slices=SLICES[:2])
    fake.install(monkeypatch)
    assert gc.isenabled()
    with contextlib.suppress(DiscoveryError):
        discover("demo", "team-a", kubeconfig="/tmp/kubeconfig")
    assert gc.isenabled()
    assert fake.collecting == ([] if fails else [False, False])


def test_discover_leaves_garbage_collection_off_when_the_caller_turned_it_off(monkeypatch) -> None:
    FakeKubernetes({"status": STATUS}, slices=SLICES[:2]).install(monkeypatch)
    gc.disable()
    try:
        discover("demo", "team-a", kubeconfig="/tmp/kubeconfig")
        assert not gc.isenabled()
    finally:
        gc.enable()


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
