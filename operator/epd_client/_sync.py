"""Blocking wrappers for scripts and notebooks; each call runs its own event loop and
connection pool, so prefer the async API where one is running."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from ._client import EPDClient, prime_encoder
from ._endpoints import Endpoints, SupportsEncoderEndpoints
from ._http import Verify
from ._media import Message
from ._retry import RetryPolicy

T = TypeVar("T")


def prime_encoder_sync(
    target: SupportsEncoderEndpoints | Endpoints,
    messages: Iterable[Message],
    *,
    model_name: str = "default",
    weights_version: str | None = None,
    api_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    verify: Verify = True,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Blocking ``prime_encoder``."""
    return _run(
        lambda: prime_encoder(
            target,
            messages,
            model_name=model_name,
            weights_version=weights_version,
            api_key=api_key,
            headers=headers,
            verify=verify,
            extra_body=extra_body,
        )
    )


def generate_sync(
    endpoints: Endpoints,
    request: Mapping[str, Any],
    *,
    key: str | None = None,
    model_name: str = "default",
    retry: RetryPolicy | None = None,
    api_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    verify: Verify = True,
) -> Any:
    """Blocking ``EPDClient.generate``; ``retry``, ``api_key``, ``headers`` and ``verify`` are
    the EPDClient's."""

    async def run() -> Any:
        async with EPDClient(endpoints, retry=retry, api_key=api_key, headers=headers, verify=verify) as client:
            return await client.generate(request, key=key, model_name=model_name)

    return _run(run)


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    # Check first: asyncio.run would fail only after the coroutine exists, and warn about it.
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    raise RuntimeError("an event loop is running here: await the async API instead")
