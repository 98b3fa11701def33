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
from ._media import MediaItem, prime_part
from ._retry import RetryPolicy

CHAT = "/v1/chat/completions"

# vLLM's ec_transfer_params: per item hash, where a consumer pulls that item's embedding.
TransferParams = dict[str, Any]

# A request's fields vLLM keys each media item's embedding by, besides the item (and its
# uuid) and the model (vllm/multimodal/processing/inputs.py): a prime without them stores the
# embedding under another key than the one the consumer looks up, and the consumer encodes.
HASHED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")


def prime_body(item: MediaItem, model: str | None, extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Vime's prime request for one item: a user message holding only that part (prime_part),
    one token.
    ``extra_body``: more fields of the request, under those (e.g. the ``mm_processor_kwargs``
    the item is rendered with afterwards, which vLLM hashes the item with)."""
    body: dict[str, Any] = {**(extra_body or {})}
    if model is not None:
        body["model"] = model
    body.update(messages=[{"role": "user", "content": [prime_part(item)]}], max_tokens=1, stream=False)
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
    extra_body: Mapping[str, Any] | None = None,
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
                    encoders, CHAT, prime_body(item, model, extra_body), first=first + index, headers=headers
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
        merged.update(result)  # type: ignore[arg-type]  # failures were raised above: each result is TransferParams
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
        extra_body: Mapping[str, Any] | None = None,
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
        ``extra_body``: fields every prime request carries besides its own (prime_body)."""
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
            extra_body=extra_body,
        )
