"""The client: unit choice, priming, render and generate; pausing a model's engines."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, Self
from urllib.parse import urlencode

from ._affinity import affinity_key
from ._endpoints import Endpoints, Engine, ModelEndpoints, SupportsEncoderEndpoints, Unit
from ._errors import (
    EndpointsError,
    EngineError,
    InvalidResponseError,
    MediaFailure,
    NoReadyUnitError,
    PrimeError,
    RequestError,
)
from ._http import Connection, Transport, Verify, json_body
from ._media import KINDS, MediaItem, Message, copy_messages, keyed_items, media_items, write_keys
from ._prime import HASHED_FIELDS, TransferParams, prime_items, short
from ._retry import RetryPolicy

_RENDER = "/v1/chat/completions/render"
_GENERATE = "/inference/v1/generate"


class EPDClient:
    """Pooled, retrying access to the units of an EPD deployment.

    The client owns its connections (kept alive between calls) and lets at most
    ``max_concurrency`` requests be in flight. ``api_key`` goes with every request as
    ``Authorization: Bearer`` (the key of an EPDDeployment's ``spec.apiKey``, which its engines,
    routers and proxies check); ``headers`` too (they win over ``api_key``). ``verify`` is TLS
    verification as httpx takes it: True, False, a CA bundle's path or an SSLContext. Use it as
    ``async with EPDClient(endpoints) as client:`` or call ``aclose()``. ``endpoints`` may
    be replaced at any time (e.g. after a new ``discover``); open sessions keep their unit.

    ``weights_version`` (e.g. ``"step-42"``; set it again after each weight update) keys
    every media part by its content and that version, so embeddings computed under other
    weights are never read; None keeps vLLM's content-only keys. Either way a ``uuid`` the
    caller set is replaced by the part's key: vLLM names a part by its uuid alone, so a reused
    uuid would be answered with another picture's embedding.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        retry: RetryPolicy | None = None,
        max_concurrency: int = 64,
        api_key: str | None = None,
        headers: Mapping[str, str] | None = None,
        verify: Verify = True,
        weights_version: str | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.weights_version = weights_version
        self._transport = Transport(retry or RetryPolicy(), max_concurrency, Connection(api_key, headers, verify))
        self._outstanding: Counter[tuple[str, str]] = Counter()
        self._without_endpoint: set[str] = set()
        self._rotation = itertools.count()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    @asynccontextmanager
    async def session(self, key: str | None = None, *, model_name: str = "default") -> AsyncIterator[Session]:
        """Pick one ready unit of the model and keep it for the whole block.

        With a ``key`` (sample or conversation id) the unit is a stable function of the key
        and the set of ready units; without one, the unit with the fewest open sessions.
        Priming and generation through the yielded Session always hit the same unit,
        which they must: the EC store is node-local. The session keeps the client's
        ``weights_version`` of this moment, so a request is keyed alike from prime to generate.
        """
        model = self.endpoints.model(model_name)
        unit = self._choose(model, key)
        slot = (model.name, unit.name)
        self._outstanding[slot] += 1
        try:
            yield Session(self._transport, model, unit, self.weights_version, self._without_endpoint)
        finally:
            self._outstanding[slot] -= 1

    async def generate(self, request: Mapping[str, Any], *, key: str | None = None, model_name: str = "default") -> Any:
        """Prime the request's images, render, generate, all on one unit; returns the
        generate response JSON. Without a ``key`` the request is placed as the EPD gateway
        places it (``affinity_key``: its ``user`` field, else its first media part's key), so
        repeats of a picture go back to the unit that holds its embedding."""
        if key is None:
            messages = request.get("messages")
            items = media_items(messages) if isinstance(messages, list) else []
            key = affinity_key(items, user=request.get("user"), weights_version=self.weights_version)
        async with self.session(key, model_name=model_name) as session:
            return await session.generate(request)

    def engines(self, model: str, role: str | None = None) -> tuple[Engine, ...]:
        """Every engine of ``model`` (encoders included, router excluded) in every unit, or
        only those of ``role`` (encoder, regular, prefill, decode)."""
        return self.endpoints.engines(model, role)

    async def pause(
        self,
        model: str,
        *,
        mode: Literal["abort", "wait", "keep"] = "abort",
        clear_cache: bool = True,
    ) -> None:
        """``POST /pause`` on every engine of ``model``, encoders included, all at once (e.g.
        before a weight update). ``mode`` and ``clear_cache`` are vLLM's: in-flight requests
        are aborted, waited for or kept; caches are cleared. Engines answer only when run
        with VLLM_SERVER_DEV_MODE=1. Raises EngineError naming every engine that failed."""
        query = urlencode({"mode": mode, "clear_cache": "true" if clear_cache else "false"})
        await self._on_every_engine(model, f"/pause?{query}")

    async def resume(self, model: str) -> None:
        """``POST /resume`` on every engine of ``model``, as ``pause``."""
        await self._on_every_engine(model, "/resume")

    async def _on_every_engine(self, model: str, path: str) -> None:
        engines = self.engines(model)
        reachable = [(e, e.url) for e in engines if e.url is not None]
        if len(reachable) < len(engines):
            # Checked before any call, so no engine is left paused while another never was.
            unreachable = ", ".join(f"{e.unit}/{e.name}" for e in engines if e.url is None)
            raise EndpointsError(
                f"engines of model {model!r} without a URL (their pod has no IP yet): "
                f"{unreachable}; retry once the units are scheduled"
            )

        async def call(engine: Engine, url: str) -> tuple[Engine, RequestError] | None:
            try:
                await self._transport.post((url,), path, None)
            except RequestError as exc:
                return engine, exc
            return None

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call(e, url)) for e, url in reachable]
        failures = [f for f in (t.result() for t in tasks) if f is not None]
        if failures:
            raise EngineError(f"POST {path}", model, len(engines), failures)

    async def _prime_on(
        self, model: ModelEndpoints, items: list[MediaItem], extra_body: Mapping[str, Any] | None = None
    ) -> TransferParams:
        """Prime on the model's chosen unit, items keyed already (through its proxy, if any:
        the keys it answers are written into the parts)."""
        async with self.session(model_name=model.name) as session:
            return await session._prime_items(items, extra_body or {}, keyed=True)

    def _choose(self, model: ModelEndpoints, key: str | None) -> Unit:
        """The key's unit under this client's open sessions (bounded load: the EPD gateway's
        function); without a key the unit with the fewest, idle units taking turns."""
        loads = {unit: n for (name, unit), n in self._outstanding.items() if name == model.name and n}
        unit, _ = model.choose(key, loads, start=next(self._rotation))
        return unit


class Session:
    """A model's unit, chosen once. Obtained from ``EPDClient.session``."""

    def __init__(
        self,
        transport: Transport,
        model: ModelEndpoints,
        unit: Unit,
        weights_version: str | None = None,
        without_endpoint: set[str] | None = None,
    ) -> None:
        self._transport = transport
        self.model = model
        self.unit = unit
        self.weights_version = weights_version
        # Proxies of operators before POST /epd/v1/prime pass it on (a 404): the client's own
        # record of them, whose units' encoders it primes itself.
        self._without_endpoint = without_endpoint if without_endpoint is not None else set()
        self.lease: str | None = None
        """The lease the unit's proxy granted on what the last ``prime`` primed or found: send it
        as the ``X-EPD-Lease`` header with your render and generate (``generate`` does), and the
        unit's janitor evicts none of it until they are done."""

    async def prime(
        self, messages: Iterable[Message], *, extra_body: Mapping[str, Any] | None = None
    ) -> TransferParams:
        """Encode every media item of ``messages`` on this unit's encoders (see
        prime_encoder). With a weights version, or through the unit's EPD proxy, writes each
        part's key into ``messages``: render them as they are afterwards. Returns the
        ``ec_transfer_params`` to send with render (a ``Pools`` model's; empty otherwise).
        ``extra_body``: as prime_encoder's."""
        return await self._prime_items(keyed_items(messages), extra_body or {})

    async def _prime_items(
        self, items: list[MediaItem], extra_body: Mapping[str, Any], *, keyed: bool = False
    ) -> TransferParams:
        """Key the items (``keyed_items``: bound to their content and the weights version, unless
        ``keyed`` already) and prime the media among them: through the unit's proxy, which
        primes only what its EC store lacks and answers the keys (written into the items'
        parts), else on the unit's encoders directly. ``extra_body``: fields every prime carries
        (the request's hashed fields)."""
        if not keyed:
            write_keys(items, self.weights_version)
        items = [item for item in items if item.kind in KINDS]
        proxy = _proxy_url(self.model, self.unit)
        if items and proxy is not None and proxy not in self._without_endpoint:
            try:
                return await self._prime_through(proxy, items, extra_body)
            except RequestError as exc:
                if exc.status_code != 404:
                    raise PrimeError(
                        self.unit.name, len(items), [_failure(i, item, exc) for i, item in enumerate(items)]
                    ) from exc
                self._without_endpoint.add(proxy)  # an older proxy: it passed the path on
        return await _prime(self._transport, self.model, self.unit, items, extra_body)

    async def _prime_through(self, proxy: str, items: list[MediaItem], extra_body: Mapping[str, Any]) -> TransferParams:
        """POST /epd/v1/prime to the unit's proxy: one message holding every item, in order."""
        body = {**extra_body, "model": self.model.served_name}
        body["messages"] = [{"role": "user", "content": [i.part for i in items]}]
        # The proxy keys every part by its content and this version (content-only without one,
        # unless the model's weights are versioned: refused).
        headers = self._version_header()
        answer = json_body(await self._transport.post((proxy,), _PRIME_THROUGH, body, headers=headers), _PRIME_THROUGH)
        keys = answer.get("keys") if isinstance(answer, dict) else None
        if not isinstance(keys, list) or len(keys) != len(items):
            raise InvalidResponseError(
                _PRIME_THROUGH, (proxy,), attempts=1, reason=f"answered no key for each of the {len(items)} part(s)"
            )
        for item, key in zip(items, keys, strict=True):
            if isinstance(key, str):
                item.part["uuid"] = key  # type: ignore[index]  # the name its embedding is stored under
        lease = answer.get("lease")
        self.lease = lease if isinstance(lease, str) else None
        params = answer.get("ec_transfer_params")
        return dict(params) if isinstance(params, Mapping) else {}

    async def generate(self, request: Mapping[str, Any]) -> Any:
        """Prime, then ``/v1/chat/completions/render`` and ``/inference/v1/generate``
        through the unit's router (or consumer). Text-only requests skip priming.
        ``request`` is not modified (with a weights version, a keyed copy is sent).

        For a ``Pools`` model both calls carry the primed items' ``ec_transfer_params``, so the
        consumer pulls each embedding from its encoder, and generate sends those items
        metadata-only (no image tensors) where the render response offers that."""
        entry = self.unit.entry
        if entry is None:
            raise EndpointsError(f"unit {self.unit.name!r} has no router or consumer URL")
        if request.get("messages"):  # keys are written into the copy, never into the caller's
            request = {**request, "messages": copy_messages(request["messages"])}
        self.lease = None
        hashed = {name: request[name] for name in HASHED_FIELDS if request.get(name)}
        params = await self._prime_items(keyed_items(request.get("messages") or ()), hashed)
        body = {"model": self.model.served_name, **request}
        if params:
            body["ec_transfer_params"] = {**params, **(request.get("ec_transfer_params") or {})}
        # The unit's proxy binds render's keys to the parts' content under this version too.
        headers = {**(self._version_header() or {}), **({_LEASE_HEADER: self.lease} if self.lease else {})} or None
        rendered = await self._call(entry, _RENDER, body, idempotent=True, headers=headers)
        if params:
            rendered = _carry_transfer_params(rendered, body["ec_transfer_params"])
        # Not idempotent: a generate that reached the entry may run though its answer was lost.
        return await self._call(entry, _GENERATE, rendered, idempotent=False, headers=headers)

    def _version_header(self) -> dict[str, str] | None:
        return {_VERSION_HEADER: self.weights_version} if self.weights_version is not None else None

    async def _call(
        self, entry: Engine, path: str, body: Any, *, idempotent: bool, headers: Mapping[str, str] | None = None
    ) -> Any:
        assert entry.url is not None
        try:
            response = await self._transport.post((entry.url,), path, body, idempotent=idempotent, headers=headers)
            return json_body(response, path)
        except InvalidResponseError as exc:
            raise EngineError(f"POST {path}", self.model.name, 1, [(entry, exc)]) from exc


async def prime_encoder(
    target: SupportsEncoderEndpoints | Endpoints | EPDClient,
    messages: Iterable[Message],
    *,
    model_name: str = "default",
    weights_version: str | None = None,
    api_key: str | None = None,
    headers: Mapping[str, str] | None = None,
    verify: Verify = True,
    extra_body: Mapping[str, Any] | None = None,
) -> TransferParams:
    """Encode every media item of ``messages`` on the encoders before render/generate.

    Media items are the content parts vLLM would load as an image, a video or audio
    (``media_items``): those of type ``image_url`` (Vime's rule: a string ``image_url.url``),
    ``input_image``, ``video_url``, ``audio_url`` and ``input_audio``, and the same media
    spelled without ``type`` (``{"image_url": "https://..."}``) or read by key because the
    part has a ``uuid``. One single-part ``/v1/chat/completions`` request per item, all at
    once, spread round-robin over the unit's encoders by item index (a retry moves to the
    next encoder). Raises PrimeError naming the failed items and encoders once retries run
    out, and MediaPartError, before sending anything, for a part vLLM would read as media that
    no prime can stand for (a ``uuid`` without data, an empty URL, ``image_pil``).

    ``extra_body``: fields every prime request carries too. Pass the ``mm_processor_kwargs``
    and ``media_io_kwargs`` you render with: vLLM keys an item's embedding by them too.

    The model is chosen as Vime's ``prime_encoder`` chooses it, among the models that have
    encoders: the one named ``model_name``; else, for ``"default"``, the only one. With a
    Vime args object that is all: anything else is a no-op, as in Vime. Endpoints and
    EPDClient know every model of the deployment, so there a model without encoders is a
    no-op and a name that is no model at all (``"default"`` included, when zero or several
    models have encoders) raises EndpointsError. Text-only messages are always a no-op.

    With ``weights_version`` (for an EPDClient, default: its ``weights_version``) each
    media part gets a ``uuid`` derived from its content and the version, written into
    ``messages`` in place: render those same messages afterwards, so the consumers read the
    embeddings of this version. A ``uuid`` the caller set is replaced by the part's key (its
    content's, content-only without a version), with or without a version: vLLM names a part
    by its uuid alone, so a reused uuid would read another picture's embedding. The client's
    own embeddings parts (image_embeds, ...) are keyed alike, and never primed.

    Endpoints and EPDClient must give the model exactly one unit, or priming and generation
    could land on different units: with several, use ``EPDClient.session`` or
    ``EPDClient.generate``. Endpoints and Vime args get a client for this call only; pass
    an EPDClient to keep connections across calls; ``api_key``, ``headers`` and ``verify``
    are that client's (see EPDClient). An EPDClient uses its own: passing them with one is a
    TypeError, as they would be ignored.

    Returns the ``ec_transfer_params`` to send with render for a ``Pools`` model (its encoders
    run on other nodes: the consumer pulls each embedding from the address its encoder
    announced); for any other model an empty dict, which Vime ignores as it ignores None.
    For a ``Pools`` model an encoder answer without transfer params for its item is a
    PrimeError naming the item and the encoder, never a silent local encode.
    """
    connection = Connection(api_key, headers, verify)
    if isinstance(target, EPDClient) and connection.options():
        raise TypeError("prime_encoder(client, ...) uses the client's api_key, headers and verify: set them there")
    items = keyed_items(messages)
    if not items:
        return {}
    if isinstance(target, EPDClient):
        if weights_version is None:
            weights_version = target.weights_version
        model = _primed_model(target.endpoints, model_name)
    elif isinstance(target, Endpoints):
        model = _primed_model(target, model_name)
    else:
        model = _vime_model(target, model_name)
    # Keys go on every media part, primed or not: a model without encoders caches
    # embeddings by the same key in its own engines.
    write_keys(items, weights_version)
    items = [item for item in items if item.kind in KINDS]
    if model is None or not items:
        return {}
    if len(model.units) > 1:
        raise EndpointsError(
            f"model {model.name!r} has {len(model.units)} units; prime and generate inside "
            "`async with client.session(key) as s` so both use the same unit"
        )
    if isinstance(target, EPDClient):
        return await target._prime_on(model, items, extra_body)
    async with EPDClient(Endpoints((model,)), **connection.options()) as client:
        return await client._prime_on(model, items, extra_body)


def _vime_model(args: SupportsEncoderEndpoints, model_name: str) -> ModelEndpoints | None:
    """Vime's own choice (vime/rollout/vllm_rollout.py, prime_encoder): the named entry of
    ``vllm_model_encoder_endpoints``, else for "default" its only entry, else nothing."""
    configured = getattr(args, "vllm_model_encoder_endpoints", None) or {}
    name, entry = model_name, configured.get(model_name)
    if entry is None and model_name == "default" and len(configured) == 1:
        ((name, entry),) = configured.items()
    if entry is None or not entry[1]:
        return None
    served, urls = entry
    # Vime runs a model's encoders on one node: they form a single unit.
    return ModelEndpoints(name, (Unit(name=name, encoder_urls=tuple(urls)),), served)


def _primed_model(endpoints: Endpoints, model_name: str) -> ModelEndpoints | None:
    """Vime's choice over the models that have encoders; None: a model without encoders."""
    with_encoders = [m for m in endpoints.models if m.has_encoders]
    for model in with_encoders:
        if model.name == model_name:
            return model
    if model_name == "default" and len(with_encoders) == 1:
        return with_encoders[0]
    endpoints.model(model_name)  # raises for a name that is no model of the deployment
    return None


async def _prime(
    transport: Transport,
    model: ModelEndpoints,
    unit: Unit,
    items: list[MediaItem],
    extra_body: Mapping[str, Any] | None = None,
) -> TransferParams:
    """Prime the items on the unit's encoders (``extra_body``: fields every prime carries);
    for a Pools model, return every item's ``ec_transfer_params`` entries merged into one dict."""
    encoders = unit.encoder_urls
    if items and not encoders and model.pooled:
        raise NoReadyUnitError(f"model {model.name!r}: its encoder pool has no ready encoder to prime on")
    if not items or not encoders:
        return {}
    return await prime_items(
        transport, items, encoders, model=model.served_name, pooled=model.pooled, unit=unit.name, extra_body=extra_body
    )


_PRIME_THROUGH = "/epd/v1/prime"
_VERSION_HEADER = "X-EPD-Weights-Version"
_LEASE_HEADER = "X-EPD-Lease"


def _proxy_url(model: ModelEndpoints, unit: Unit) -> str | None:
    """The unit's EPD proxy, if it has one: its front door when that is neither its router nor a
    consumer. A Pools model's units are primed on the pool directly (as before)."""
    front = unit.front_url
    if model.pooled or not unit.encoder_urls or front is None:
        return None
    return None if front == unit.router_url or front in unit.consumer_urls else front


def _failure(index: int, item: MediaItem, error: RequestError) -> MediaFailure:
    return MediaFailure(index, short(item.source), error.urls, error, item.kind)


def _carry_transfer_params(rendered: Any, params: TransferParams) -> Any:
    """The render response as generate's body: with the transfer params (vLLM's render copies
    them; set them if it did not), and every announced item metadata-only where the response
    carries its metadata, so the image tensors are not sent again."""
    if not isinstance(rendered, dict):
        return rendered
    rendered = {**rendered, "ec_transfer_params": rendered.get("ec_transfer_params") or params}
    features = rendered.get("features")
    if not isinstance(features, Mapping):
        return rendered
    hashes, kwargs, metadata = (features.get(k) for k in ("mm_hashes", "kwargs_data", "mm_metadata"))
    if not (isinstance(hashes, Mapping) and isinstance(kwargs, Mapping) and isinstance(metadata, Mapping)):
        return rendered
    announced = rendered["ec_transfer_params"]
    slim = {}
    for modality, items in kwargs.items():
        names = hashes.get(modality) or ()
        metas = metadata.get(modality) or ()
        if not (isinstance(items, list) and len(names) == len(items) == len(metas)):
            return rendered  # not vLLM's parallel lists: send the response as it came
        slim[modality] = [
            None if name in announced and meta is not None else item for name, item, meta in zip(names, items, metas)
        ]
    return {**rendered, "features": {**features, "kwargs_data": slim}}
