"""Priming: one image-only chat request per media item on the encoders, all at once. The one
implementation behind ``prime_encoder``, ``Session.prime`` and ``Primer``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Self

from ._errors import MediaFailure, PrimeError, RequestError
from ._http import AttemptHook, Connection, Transport, Verify, json_body
from ._media import MediaItem
from ._retry import RetryPolicy

CHAT = "/v1/chat/completions"

# vLLM's ec_transfer_params: per item hash, where a consumer pulls that item's embedding.
TransferParams = dict[str, Any]


# Request fields vLLM hashes into an item's key with its content or uuid (``get_mm_hashes``):
# a prime must carry them, or the encoder stores the item under another key (and processes it
# otherwise) than the consumer reads.
HASH_FACTORS = ("mm_processor_kwargs", "media_io_kwargs")


def hash_factors(request: Mapping[str, Any]) -> dict[str, Any]:
    """The request's fields of HASH_FACTORS that are set: what its primes carry with them."""
    return {name: request[name] for name in HASH_FACTORS if request.get(name)}


def prime_body(item: MediaItem, model: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Vime's prime request for one item: a user message holding only that part, one token;
    with ``extra``, the request's hash factors (``hash_factors``)."""
    body: dict[str, Any] = {} if model is None else {"model": model}
    body.update(messages=[{"role": "user", "content": [item.part]}], max_tokens=1, stream=False)
    if extra:
        body.update(extra)
    return body


async def prime_items(
    transport: Transport,
    items: Sequence[MediaItem],
    encoders: Sequence[str],
    *,
    model: str | None,
    pooled: bool,
    unit: str,
    headers: Mapping[str, str] | None = None,
    first: int = 0,
    max_concurrency: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> TransferParams:
    """Prime every item at once (at most ``max_concurrency`` of them in flight, when given),
    item i on ``encoders[(first + i) % n]`` (a retry moves to the next encoder); raise
    PrimeError naming every item that failed. For a pooled model, return every item's
    ``ec_transfer_params`` entries (keyed by vLLM's item hash) merged into one dict; an answer
    without them is a failure of its item."""
    own_slots: AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency is not None else contextlib.nullcontext()
    )

    async def prime_one(index: int, item: MediaItem) -> TransferParams | MediaFailure:
        try:
            async with own_slots:
                response = await transport.post(
                    encoders, CHAT, prime_body(item, model, extra), first=first + index, headers=headers
                )
        except RequestError as exc:
            return MediaFailure(index, short(item.source), exc.urls, exc, item.kind)
        if not pooled:
            return {}
        try:
            answer = json_body(response, CHAT)
        except RequestError as exc:
            return MediaFailure(index, short(item.source), exc.urls, exc, item.kind)
        params, missing = announced(answer)
        if missing:
            encoder = str(response.request.url).removesuffix(CHAT)
            error = RequestError(CHAT, (encoder,), attempts=1, reason=missing)
            return MediaFailure(index, short(item.source), (encoder,), error, item.kind)
        return params

    # A failing item does not cancel the others, so the error can name every failure;
    # cancelling the caller cancels all requests before this returns (TaskGroup).
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(prime_one(i, item)) for i, item in enumerate(items)]
    results = [t.result() for t in tasks]
    failures = [r for r in results if isinstance(r, MediaFailure)]
    if failures:
        raise PrimeError(unit, len(items), failures)
    merged: TransferParams = {}
    for result in results:
        merged.update(result)  # type: ignore[arg-type]
    return merged


def announced(answer: Any) -> tuple[TransferParams, str]:
    """An encoder answer's ``ec_transfer_params`` and, if they cannot carry the embedding to
    a consumer on another node, why: absent, or an entry without the encoder's address (vLLM
    announces none for an embedding it did not keep, and the consumer would encode locally)."""
    params = answer.get("ec_transfer_params") if isinstance(answer, Mapping) else None
    if not isinstance(params, Mapping) or not params:
        return {}, "answered without ec_transfer_params (is its EC connector ECCPUConnector with NIXL?)"
    unaddressed = [
        key
        for key, entry in params.items()
        if not (isinstance(entry, Mapping) and entry.get("peer_host") and entry.get("peer_port"))
    ]
    if unaddressed:
        return {}, f"announced no peer address for {', '.join(map(str, unaddressed))} (not saved, or evicted)"
    return dict(params), ""


def short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[: limit - 1] + "…"


class Primer:
    """Primes media items on encoders the caller names, under a retry policy: what
    ``prime_encoder`` does for a unit, for callers that keep their own list of encoders and
    send headers per call (the EPD proxy in front of a unit's router).

    It owns a connection pool: ``async with Primer() as primer:`` or ``await primer.aclose()``.
    At most ``max_concurrency`` prime requests are in flight at once. ``api_key``, ``headers``
    and ``verify`` are as EPDClient's; ``prime``'s own headers go with one call.
    ``on_attempt(encoder, failed)`` is called as each prime request ends, retries included:
    ``failed`` when the encoder gave no answer in time, no connection, a 5xx or a cut-off
    answer (a 4xx, 408 or 429 is an answer), so a caller can leave failing encoders out.
    """

    def __init__(
        self,
        *,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 64,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        verify: Verify = True,
        on_attempt: AttemptHook | None = None,
    ) -> None:
        connection = Connection(api_key, headers, verify)
        self._transport = Transport(retry or RetryPolicy(), max_concurrency, connection, on_attempt)

    @property
    def retry(self) -> RetryPolicy:
        return self._transport.policy

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def prime(
        self,
        items: Sequence[MediaItem],
        encoders: Sequence[str],
        *,
        model: str | None,
        pooled: bool = False,
        headers: Mapping[str, str] | None = None,
        first: int = 0,
        unit: str = "encoders",
        max_concurrency: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TransferParams:
        """One single-part ``/v1/chat/completions`` request per item (``model`` its ``model``
        field, left out when None), all at once: item i goes to ``encoders[(first + i) % n]``
        and a retry to the next encoder. ``headers`` go with every request (an ``x-request-id``
        becomes the prefix of each attempt's own). Raises PrimeError (``unit`` names where)
        listing every item that failed once retries ran out; ValueError when there are items
        but no encoders. ``pooled``: the encoders form a ``Pools`` model's pool, so each answer
        must announce its ``ec_transfer_params``, which are returned merged. ``max_concurrency``:
        at most that many of this call's requests in flight at once (the Primer's own limit
        holds for all calls together), so one call with many items leaves room for others.
        ``extra``: fields every prime request carries besides (``hash_factors`` of the request)."""
        if not items:
            return {}
        if not encoders:
            raise ValueError("no encoder to prime on")
        return await prime_items(
            self._transport,
            items,
            tuple(encoders),
            model=model,
            pooled=pooled,
            unit=unit,
            headers=headers,
            first=first,
            max_concurrency=max_concurrency,
            extra=extra,
        )
