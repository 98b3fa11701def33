"""Endpoints from an EPDDeployment's status and the EndpointSlices it names. The only module
that touches Kubernetes, and only when called: the client itself must stay importable without
the kubernetes package."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._endpoints import SERVICE_NAME_LABEL, Endpoints
from ._errors import DiscoveryError

GROUP = "epd.vime.dev"
VERSION = "v1alpha1"
PLURAL = "epddeployments"


def discover(name: str, namespace: str, kubeconfig: str | None = None) -> Endpoints:
    """Read EPDDeployment ``namespace/name`` and the EndpointSlices of the Services its status
    names, and return the endpoints they give (``Endpoints.from_status``).

    Uses ``kubeconfig`` if given, else $KUBECONFIG or ~/.kube/config if present, else the
    pod's service account, which needs ``get`` on epddeployments and ``list`` on
    endpointslices. Blocking; from async code use ``asyncio.to_thread(discover, ...)``.
    """
    try:
        import orjson  # decodes a 5,000-unit list in 60 % of json's time
        from kubernetes import client, config
    except ImportError as exc:
        raise ImportError(
            "epd_client.discover needs the Kubernetes client and orjson: "
            "pip install 'epd-operator[discovery]' (or pip install kubernetes orjson)"
        ) from exc

    try:
        api = _api_client(client, config, kubeconfig)
    except config.ConfigException as exc:
        raise DiscoveryError(f"no Kubernetes configuration: {exc}") from exc
    what = f"EPDDeployment {namespace}/{name}"
    try:
        with _collections_paused():
            endpoints = _read_endpoints(client, api, what, name, namespace, orjson.loads)
    finally:
        api.close()
    if not endpoints.models:
        raise DiscoveryError(f"{what} lists no models in its status yet")
    return endpoints


def _read_endpoints(
    client: Any, api: Any, what: str, name: str, namespace: str, loads: Callable[[bytes], Any]
) -> Endpoints:
    """The decoded documents live only in here, so that they are freed before collections
    resume."""
    # Raw JSON: the client's models would take longer to build than everything else here.
    obj = _read(
        client,
        what,
        lambda: client.CustomObjectsApi(api).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
        ),
        loads,
    )
    status = obj.get("status") or {}
    services = _services(status)
    slices = []
    if services:
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(services))})"
        slices = _read(
            client,
            f"the EndpointSlices of {what} (needs list on endpointslices.discovery.k8s.io)",
            lambda: client.DiscoveryV1Api(api).list_namespaced_endpoint_slice(
                namespace, label_selector=selector, _preload_content=False
            ),
            loads,
        )["items"]
    return Endpoints.from_status(status, slices)


@contextlib.contextmanager
def _collections_paused() -> Iterator[None]:
    """A 5,000-unit deployment decodes into tens of thousands of acyclic containers, freed by
    reference counting; a cyclic collection among them frees nothing and walks the caller's
    whole heap (an RL process's is large), which made one call in four twice as slow."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read(client: Any, what: str, call: Any, loads: Callable[[bytes], Any]) -> Any:
    try:
        response = call()
    except client.ApiException as exc:
        raise DiscoveryError(f"cannot read {what}: {exc.status} {exc.reason}") from exc
    return loads(response.data)


def _services(status: Mapping[str, Any]) -> set[str]:
    """The Services whose EndpointSlices list the units (and encoder pool pods) of the status."""
    services = set()
    for model in status.get("models") or ():
        if isinstance(model, Mapping):
            services.add(model.get("unitsService"))
            services.add((model.get("encoderPool") or {}).get("service"))
    return {s for s in services if isinstance(s, str)}


def _api_client(client: Any, config: Any, kubeconfig: str | None) -> Any:
    # Same order as kubernetes.config.load_config, without touching the global default.
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    default = os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
    if kubeconfig is None and not os.path.exists(default):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=kubeconfig)
