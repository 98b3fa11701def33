"""The client: unit choice, priming, render and generate."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from ._endpoints import Endpoints, ModelEndpoints, Unit, VimeArgs, rendezvous
from ._errors import EndpointsError, ImageFailure, PrimeError, RequestError
from ._http import Transport
from ._retry import RetryPolicy

Message = Mapping[str, Any]
_CHAT = "/v1/chat/completions"
_RENDER = "/v1/chat/completions/render"
_GENERATE = "/inference/v1/generate"


class EPDClient:
    """Pooled, retrying access to the units of an EPD deployment.

    The client owns its connections (kept alive between calls) and lets at most
    ``max_concurrency`` requests be in flight. ``headers`` go with every request (e.g.
    ``Authorization`` for engines run with ``--api-key``). Use it as
    ``async with EPDClient(endpoints) as client:`` or call ``aclose()``. ``endpoints`` may
    be replaced at any time (e.g. after a new ``discover``); open sessions keep their unit.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 64,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self._transport = Transport(retry or RetryPolicy(), max_concurrency, headers)
        self._outstanding: Counter[tuple[str, str]] = Counter()
        self._rotation = itertools.count()

    async def __aenter__(self) -> EPDClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    @asynccontextmanager
    async def session(
        self, key: str | None = None, *, model_name: str = "default"
    ) -> AsyncIterator[Session]:
        """Pick one ready unit of the model and keep it for the whole block.

        With a ``key`` (sample or conversation id) the unit is a stable function of the key
        and the set of ready units; without one, the unit with the fewest open sessions.
        Priming and generation through the yielded Session always hit the same unit,
        which they must: the EC store is node-local.
        """
        model = self.endpoints.model(model_name)
        unit = self._choose(model, key)
        slot = (model.name, unit.name)
        self._outstanding[slot] += 1
        try:
            yield Session(self._transport, model, unit)
        finally:
            self._outstanding[slot] -= 1

    async def generate(
        self, request: Mapping[str, Any], *, key: str | None = None, model_name: str = "default"
    ) -> Any:
        """Prime the request's images, render, generate, all on one unit; returns the
        generate response JSON."""
        async with self.session(key, model_name=model_name) as session:
            return await session.generate(request)

    def _choose(self, model: ModelEndpoints, key: str | None) -> Unit:
        ready = model.ready_units()
        if key is not None:
            return rendezvous(ready, key)
        # Least open sessions; the rotating start breaks ties so idle units take turns.
        start = next(self._rotation) % len(ready)
        order = ready[start:] + ready[:start]
        return min(order, key=lambda u: self._outstanding[(model.name, u.name)])


class Session:
    """A model's unit, chosen once. Obtained from ``EPDClient.session``."""

    def __init__(self, transport: Transport, model: ModelEndpoints, unit: Unit) -> None:
        self._transport = transport
        self.model = model
        self.unit = unit

    async def prime(self, messages: Iterable[Message]) -> None:
        """Encode every image of ``messages`` on this unit's encoders (see prime_encoder)."""
        await self._prime_parts(_image_parts(messages))

    async def _prime_parts(self, images: list[Message]) -> None:
        await _prime(self._transport, self.model.served_name, self.unit, images)

    async def generate(self, request: Mapping[str, Any]) -> Any:
        """Prime, then ``/v1/chat/completions/render`` and ``/inference/v1/generate``
        through the unit's router (or consumer). Text-only requests skip priming."""
        entry = self.unit.entry_url
        if entry is None:
            raise EndpointsError(f"unit {self.unit.name!r} has no router or consumer URL")
        await self.prime(request.get("messages") or ())
        body = {"model": self.model.served_name, **request}
        rendered = await self._transport.post((entry,), _RENDER, body)
        generated = await self._transport.post((entry,), _GENERATE, rendered.json())
        return generated.json()


async def prime_encoder(
    target: VimeArgs | Endpoints | EPDClient,
    messages: Iterable[Message],
    *,
    model_name: str = "default",
) -> None:
    """Encode every image of ``messages`` on the encoders before render/generate.

    One image-only ``/v1/chat/completions`` request per ``image_url`` part, all at once,
    spread round-robin over the unit's encoders by image index (a retry moves to the next
    encoder). Raises PrimeError naming the failed images and encoders once retries run out.
    A no-op for text-only messages and for models without encoders.

    ``target`` is a Vime args object (a model missing from it is a no-op, as in Vime), an
    Endpoints or an EPDClient. Endpoints and EPDClient must give the model exactly one
    unit, or priming and generation could land on different units: with several, use
    ``EPDClient.session`` or ``EPDClient.generate``. Endpoints and Vime args get a
    client for this call only; pass an EPDClient to keep connections across calls.
    """
    images = _image_parts(messages)
    if not images:
        return
    if isinstance(target, EPDClient):
        await _prime_single_unit(target, model_name, images)
        return
    if isinstance(target, Endpoints):
        endpoints = target
    else:
        entry = target.vllm_model_encoder_endpoints.get(model_name)
        if not entry or not entry[1]:
            return
        endpoints = Endpoints.from_vime_args(target)
    async with EPDClient(endpoints) as client:
        await _prime_single_unit(client, model_name, images)


async def _prime_single_unit(client: EPDClient, model_name: str, images: list[Message]) -> None:
    model = client.endpoints.model(model_name)
    if not any(unit.encoder_urls for unit in model.units):
        return  # not an EPD model
    if len(model.units) > 1:
        raise EndpointsError(
            f"model {model_name!r} has {len(model.units)} units; prime and generate inside "
            "`async with client.session(key) as s` so both use the same unit"
        )
    async with client.session(model_name=model_name) as session:
        await session._prime_parts(images)


def _image_parts(messages: Iterable[Message]) -> list[Message]:
    """Vime's rule: content parts of type image_url whose image_url.url is a string."""
    images: list[Message] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "image_url":
                continue
            image_url = part.get("image_url")
            if isinstance(image_url, Mapping) and isinstance(image_url.get("url"), str):
                images.append(part)
    return images


async def _prime(transport: Transport, served_name: str, unit: Unit, images: list[Message]) -> None:
    encoders = unit.encoder_urls
    if not images or not encoders:
        return

    async def prime_one(index: int, part: Message) -> ImageFailure | None:
        body = {
            "model": served_name,
            "messages": [{"role": "user", "content": [part]}],
            "max_tokens": 1,
            "stream": False,
        }
        try:
            await transport.post(encoders, _CHAT, body, first=index)
        except RequestError as exc:
            return ImageFailure(index, _short(part["image_url"]["url"]), exc.urls, exc)
        return None

    # A failing image does not cancel the others, so the error can name every failure;
    # cancelling the caller cancels all requests before this returns (TaskGroup).
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(prime_one(i, part)) for i, part in enumerate(images)]
    failures = [f for f in (t.result() for t in tasks) if f is not None]
    if failures:
        raise PrimeError(unit.name, len(images), failures)


def _short(url: str, limit: int = 80) -> str:
    return url if len(url) <= limit else url[: limit - 1] + "…"
