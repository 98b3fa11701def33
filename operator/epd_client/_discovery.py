"""Endpoints from an EPDDeployment's status. The only module that touches Kubernetes, and
only when called: the client itself must stay importable without the kubernetes package."""

from __future__ import annotations

import os
from typing import Any

from ._endpoints import Endpoints
from ._errors import DiscoveryError

GROUP = "epd.vime.dev"
VERSION = "v1alpha1"
PLURAL = "epddeployments"


def discover(name: str, namespace: str, kubeconfig: str | None = None) -> Endpoints:
    """Read EPDDeployment ``namespace/name`` and return the endpoints in its status.

    Uses ``kubeconfig`` if given, else $KUBECONFIG or ~/.kube/config if present, else the
    pod's service account. Blocking; from async code use ``asyncio.to_thread(discover, ...)``.
    """
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ImportError(
            "epd_client.discover needs the Kubernetes client: "
            "pip install 'epd-operator[discovery]' (or pip install kubernetes)"
        ) from exc

    try:
        api = _api_client(client, config, kubeconfig)
    except config.ConfigException as exc:
        raise DiscoveryError(f"no Kubernetes configuration: {exc}") from exc
    try:
        obj = client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except client.ApiException as exc:
        raise DiscoveryError(f"cannot read EPDDeployment {namespace}/{name}: {exc.status} {exc.reason}") from exc
    finally:
        api.close()

    status = obj.get("status") if isinstance(obj, dict) else None
    endpoints = Endpoints.from_status(status or {})
    if not endpoints.models:
        raise DiscoveryError(f"EPDDeployment {namespace}/{name} lists no models in its status yet")
    return endpoints


def _api_client(client: Any, config: Any, kubeconfig: str | None) -> Any:
    # Same order as kubernetes.config.load_config, without touching the global default.
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    default = os.path.expanduser(config.KUBE_CONFIG_DEFAULT_LOCATION)
    if kubeconfig is None and not os.path.exists(default):
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    return config.new_client_from_config(config_file=kubeconfig)
