"""The few Kubernetes API calls the operator makes, over one pooled aiohttp session.

kopf watches and indexes; this module writes: children (created by POST, changed by server-side
apply), status patches, deletes (and the readiness-gate condition of Pools units' pods). It
reuses kopf's credentials and kopf's own HTTP library (aiohttp), so the heavy `kubernetes` client is never imported by
the operator (kopf's docs found it dominates a small operator's memory). aiohttp rather than
httpx: profiling 1,000 EPDDeployments showed httpcore's pool spending a third of the
operator's CPU re-scanning its queue of waiting requests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import kopf

from . import api
from .resources import FIELD_MANAGER

# The kinds of children the operator writes: their collection paths.
CHILD_KINDS = {
    "StatefulSet": "/apis/apps/v1/namespaces/{ns}/statefulsets",
    "Service": "/api/v1/namespaces/{ns}/services",
    "PodDisruptionBudget": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    "Deployment": "/apis/apps/v1/namespaces/{ns}/deployments",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "InferencePool": f"/apis/{api.INFERENCE_POOL_GROUP}/{api.INFERENCE_POOL_VERSION}/namespaces/{{ns}}/inferencepools",
    "ScaledObject": f"/apis/{api.KEDA_GROUP}/{api.KEDA_VERSION}/namespaces/{{ns}}/scaledobjects",
}


class KubeError(Exception):
    def __init__(self, method: str, path: str, status_code: int, text: str):
        self.status_code = status_code
        try:
            message = json.loads(text).get("message", text)
        except (ValueError, AttributeError):
            message = text
        # New objects are refused in a namespace being deleted, or already gone.
        self.namespace_gone = (status_code == 403 and "being terminated" in message) or (
            status_code == 404 and message.startswith("namespaces ")
        )
        # A kind the API server does not serve: another project's CRD not installed (an unknown
        # group is a plain "404 page not found", an unknown resource of a known group this).
        self.kind_unserved = status_code == 404 and (
            "page not found" in message or "could not find the requested resource" in message
        )
        super().__init__(f"{method} {path}: {status_code} {message}")


class Kube:
    def __init__(self, connection: kopf.ConnectionInfo, *, max_connections: int = 16):
        self.connection = connection
        self._server = connection.server.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers=connection.as_http_headers(),
            connector=aiohttp.TCPConnector(ssl=connection.as_ssl_context(), limit=max_connections),
            timeout=aiohttp.ClientTimeout(total=30),
        )

    async def aclose(self) -> None:
        await self._session.close()

    async def _call(
        self, method: str, path: str, body: Any, content_type: str, params: dict[str, str] | None = None
    ) -> bytes:
        async with self._session.request(
            method,
            self._server + path,
            params=params,
            data=None if body is None else json.dumps(body),
            headers={"Content-Type": content_type},
        ) as response:
            if response.status >= 400:
                raise KubeError(method, path, response.status, await response.text())
            return await response.read()  # the connection goes back to the pool only once drained

    async def create(self, obj: dict[str, Any]) -> bool:
        """POST a child with our field manager; False if it exists already. About half the API
        server's work of a server-side apply creating it (see managedfields.py for the catch)."""
        try:
            await self._call(
                "POST",
                _child_path(obj["kind"], obj["metadata"]["namespace"]),
                obj,
                "application/json",
                params={"fieldManager": FIELD_MANAGER},
            )
        except KubeError as error:
            if error.status_code == 409:
                return False
            raise
        return True

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A child as it is now, None if there is none."""
        try:
            raw = await self._call("GET", _child_path(kind, namespace, name), None, "application/json")
        except KubeError as error:
            if error.status_code == 404:
                return None
            raise
        child: dict[str, Any] = json.loads(raw)
        return child

    async def replace_managed_fields(
        self, kind: str, namespace: str, name: str, resource_version: str, entries: list[dict[str, Any]]
    ) -> None:
        """Write a child's metadata.managedFields, only if it is still at `resource_version`."""
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
            {"op": "replace", "path": "/metadata/managedFields", "value": entries},
        ]
        await self._call("PATCH", _child_path(kind, namespace, name), patch, "application/json-patch+json")

    async def apply(self, obj: dict[str, Any]) -> None:
        """Server-side apply with our field manager, forcing ownership of the fields we set."""
        metadata = obj["metadata"]
        await self._call(
            "PATCH",
            _child_path(obj["kind"], metadata["namespace"], metadata["name"]),
            obj,
            "application/apply-patch+yaml",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self._call(
                "DELETE", _child_path(kind, namespace, name), {"propagationPolicy": "Background"}, "application/json"
            )
        except KubeError as error:
            if error.status_code != 404:
                raise

    async def patch_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> None:
        """Set one condition of a pod's status (a readiness gate's): a strategic merge patch
        merges conditions by type, so the kubelet's own conditions stay as they are."""
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/status"
        try:
            await self._call(
                "PATCH", path, {"status": {"conditions": [condition]}}, "application/strategic-merge-patch+json"
            )
        except KubeError as error:
            if error.status_code != 404:  # the pod is gone: its replacement gets its own patch
                raise

    async def latest_event(self, namespace: str, kind: str, name: str, reason: str) -> str | None:
        """The message of the newest Event of `reason` about an object (e.g. a StatefulSet's
        FailedCreate: why it cannot create a pod), None if there is none."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name},reason={reason}"
        raw = await self._call(
            "GET",
            f"/api/v1/namespaces/{namespace}/events",
            None,
            "application/json",
            params={"fieldSelector": selector},
        )
        events = json.loads(raw).get("items") or []

        def when(event: dict[str, Any]) -> str:
            return str(event.get("lastTimestamp") or event.get("eventTime") or "")

        newest = max(events, key=when, default=None)
        return str(newest.get("message") or "") if newest else None

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the whole status with a merge patch (lists such as conditions are replaced)."""
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/{name}/status"
        try:
            await self._call("PATCH", path, {"status": status}, "application/merge-patch+json")
        except KubeError as error:
            if error.status_code != 404:  # deleted meanwhile: nothing left to report on
                raise


class KubeSession:
    """The API client on kopf's latest credentials. kopf logs in again when credentials rotate
    (kopf runs login handlers in a thread, the client needs the event loop): the next call then
    gets a client on the new ones, and the old one is closed in the background. A client given
    at construction (tests, benchmarks) is used as it is and never closed here."""

    def __init__(self, kube: Kube | None = None) -> None:
        self._kube = kube
        self._owned = kube is None
        self._connection: kopf.ConnectionInfo | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def login(self, connection: kopf.ConnectionInfo) -> None:
        self._connection = connection

    @property
    def client(self) -> Kube:
        connection = self._connection
        if self._owned and connection is not None and (self._kube is None or self._kube.connection is not connection):
            if self._kube is not None:
                task = asyncio.create_task(self._kube.aclose())
                self._closing.add(task)  # keep a reference until done, or it may be garbage-collected
                task.add_done_callback(self._closing.discard)
            self._kube = Kube(connection)
        if self._kube is None:
            raise RuntimeError("no API client yet: kopf logs in before any handler runs")
        return self._kube

    async def aclose(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._kube is not None and self._owned:
            await self._kube.aclose()


def _child_path(kind: str, namespace: str, name: str = "") -> str:
    """The collection of a kind of child in a namespace, or one child of it."""
    collection = CHILD_KINDS[kind].format(ns=namespace)
    return f"{collection}/{name}" if name else collection
