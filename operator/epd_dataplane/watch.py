"""What the EPD gateway reads from the API server: a list, then a watch, of one collection at
a time (Kubernetes' list-and-watch over aiohttp, as kopf does; the credentials are kopf's own
login: the pod's service account, or a kubeconfig). Each change hands the whole current list
to the caller, which keeps no state of its own about events.

A watch that ends (the server's timeout) resumes from its last resourceVersion; one that
expired (410 Gone, or an ERROR event) lists again; a failed call is retried with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import kopf

logger = logging.getLogger("epd_dataplane")

# A watch that sends nothing for this long is cut by the server and resumed (as kopf's own).
WATCH_SECONDS = 300
# An object of a watch stream is one line: an EndpointSlice of 100 endpoints is about 30 KB.
MAX_LINE_BYTES = 4 * 1024 * 1024
BACKOFF_SECONDS = (0.5, 1, 2, 5, 10, 30)

Apply = Callable[[list[dict[str, Any]]], None]


class Expired(Exception):
    """The watch's resourceVersion is too old: list again."""


def login() -> kopf.ConnectionInfo:
    """The pod's service account in a cluster, else $KUBECONFIG (kopf's own login functions)."""
    settings = kopf.OperatorSettings()
    connection = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)
    if connection is None:
        raise RuntimeError("no Kubernetes credentials: run in a pod with a service account token, or set KUBECONFIG")
    return connection


class Api:
    """GET calls to the API server with kopf's credentials; logged in again on a 401 (a service
    account token is rotated in its file)."""

    def __init__(self, sign_in: Callable[[], kopf.ConnectionInfo] = login) -> None:
        self._sign_in = sign_in
        self._session: aiohttp.ClientSession | None = None
        self._server = ""

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connection = self._sign_in()
            self._server = connection.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                headers=connection.as_http_headers(),
                connector=aiohttp.TCPConnector(ssl=connection.as_ssl_context(), limit=4),
                read_bufsize=MAX_LINE_BYTES,
                timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=WATCH_SECONDS + 30),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _forget(self, status: int) -> None:
        if status == 401:
            await self.aclose()

    async def get(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        session = self._open()
        async with session.get(self._server + path, params=params) as response:
            if response.status != 200:
                await self._forget(response.status)
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=(await response.text())[:500]
                )
            found: dict[str, Any] = await response.json()
            return found

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[dict[str, Any]]:
        session = self._open()
        query = {**params, "watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_SECONDS)}
        async with session.get(self._server + path, params=query) as response:
            if response.status == 410:
                raise Expired
            if response.status != 200:
                await self._forget(response.status)
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=(await response.text())[:500]
                )
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)


async def follow(api: Api, path: str, params: Mapping[str, str], apply: Apply, what: str) -> None:
    """Keep ``apply`` fed with every object of the collection at ``path`` (selected by
    ``params``), now and after each change; runs until cancelled."""
    failures = 0
    while True:
        try:
            listed = await api.get(path, params)
            objects = {_uid(o): o for o in listed.get("items") or []}
            version = listed["metadata"]["resourceVersion"]
            apply(list(objects.values()))
            failures = 0
            while True:  # watch, and watch again from where it ended
                async for event in api.watch(path, {**params, "resourceVersion": version}):
                    kind, found = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise Expired
                    version = found.get("metadata", {}).get("resourceVersion", version)
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        objects.pop(_uid(found), None)
                    else:
                        objects[_uid(found)] = found
                    apply(list(objects.values()))
        except asyncio.CancelledError:
            raise
        except Expired:
            logger.info("the watch of %s expired: listing again", what)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KeyError) as error:
            delay = BACKOFF_SECONDS[min(failures, len(BACKOFF_SECONDS) - 1)]
            failures += 1
            logger.warning("watching %s failed (%s); again in %g s", what, error, delay)
            await asyncio.sleep(delay)


def _uid(found: Mapping[str, Any]) -> str:
    metadata = found.get("metadata") or {}
    return str(metadata.get("uid") or metadata.get("name"))
