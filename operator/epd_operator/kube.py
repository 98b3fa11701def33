"""The few Kubernetes API calls the operator makes, over one pooled async httpx client.

kopf watches and indexes; this module writes: server-side apply of children, status patches,
deletes. It reuses kopf's credentials, so the heavy `kubernetes` client is never imported by the
operator (kopf's docs found it dominates a small operator's memory).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import kopf

from . import api
from .resources import FIELD_MANAGER

_PATHS = {
    ("apps/v1", "StatefulSet"): "/apis/apps/v1/namespaces/{ns}/statefulsets",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
}


class KubeError(Exception):
    def __init__(self, response: httpx.Response):
        self.status_code = response.status_code
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        # New objects are refused in a namespace being deleted, or already gone.
        self.namespace_gone = (response.status_code == 403 and "being terminated" in message) or (
            response.status_code == 404 and message.startswith("namespaces ")
        )
        super().__init__(f"{response.request.method} {response.request.url.path}: {response.status_code} {message}")


class Kube:
    def __init__(self, connection: kopf.ConnectionInfo, *, max_connections: int = 32):
        headers = dict(connection.as_http_headers())
        self._client = httpx.AsyncClient(
            base_url=connection.server,
            verify=connection.as_ssl_context(),
            headers=headers,
            timeout=httpx.Timeout(30.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = await self._client.request(method, path, **kwargs)
        if response.status_code >= 400:
            raise KubeError(response)
        return response.json()

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with our field manager, forcing ownership of the fields we set."""
        collection = _PATHS[(obj["apiVersion"], obj["kind"])].format(ns=obj["metadata"]["namespace"])
        return await self._call(
            "PATCH",
            f"{collection}/{obj['metadata']['name']}",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        collection = _PATHS[(api_version, kind)].format(ns=namespace)
        try:
            await self._call("DELETE", f"{collection}/{name}", json={"propagationPolicy": "Background"})
        except KubeError as error:
            if error.status_code != 404:
                raise

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Replace the whole status with a merge patch (lists such as conditions are replaced)."""
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/{name}/status"
        try:
            await self._call(
                "PATCH",
                path,
                content=json.dumps({"status": status}),
                headers={"Content-Type": "application/merge-patch+json"},
            )
        except KubeError as error:
            if error.status_code != 404:  # deleted meanwhile: nothing left to report on
                raise
