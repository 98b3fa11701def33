"""The EPD gateway: `epd-dataplane gateway`, the EPD proxy in front of a model's units.

Behind a front Service kube-proxy spreads connections at random: a picture primed on one unit
comes back on another, whose EC store and prefix cache never saw it, and is encoded again. The
gateway is what the model's front Service targets when `spec.gateway.enabled` is set. It reads
each request as the units' proxies do (core.plan, within the same bounds), primes nothing, and
sends it to a unit:

- **By affinity.** A request goes to the unit its key prefers (``epd_client.affinity_key``: its
  conversation, else its first media part's key), with bounded load (``choose_unit``, the
  function EPDClient uses): the unit that primed a picture gets its repeats while it is ready
  and not loaded beyond 1.25 times the mean; the others, and requests without a key, go to
  the least-loaded unit.
- **With the weights version.** Unless the client sent X-EPD-Weights-Version, the gateway adds
  the model's `spec.models[].weightsVersion`, so the unit's proxy keys every part by it.

It knows the units and the version by watching the API server: the EPDDeployment (its status
says what each unit holds, its spec the version) and the EndpointSlices of the units' headless
Service (which unit is where, and ready), with a Role that reads just those (the operator makes
it). A version patched into the EPDDeployment reaches the gateway in the time of one watch
event, well under a second. A gateway without a cluster (tests, benchmarks) takes fixed units.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from epd_client import (
    Endpoints,
    EndpointsError,
    ModelEndpoints,
    NoReadyUnitError,
    Unit,
    affinity_key,
    choose_unit,
    rank_units,
)
from epd_operator import api as api_group

from .core import Plan, ProxyError, error_body
from .keys import SESSION_HEADER, WEIGHTS_VERSION_HEADER, header, requested_version
from .metrics import ProxyMetrics
from .server import Primed, Proxy
from .watch import Api, follow

# kube-controller-manager labels each EndpointSlice with the Service it lists the pods of.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"

logger = logging.getLogger("epd_dataplane")

PRIME_PATH = "/epd/v1/prime"
PRIME_REFUSAL = (
    "POST /epd/v1/prime leases what it primes on one unit: send it to a unit's proxy (epd_client finds them in "
    "the EPDDeployment's status), not to the gateway"
)
# What the gateway keeps of a request between reading it and forwarding it: its key, its unit.
_KEY = web.RequestKey("epd_key", str)
_UNIT = web.RequestKey("epd_unit", str)


@dataclass
class UnitsView:
    """What the gateway knows of its model: its units (who is ready, where each one's EPD proxy
    listens), the weights version, and the requests it has in flight on each unit."""

    model: str
    endpoints: ModelEndpoints | None = None
    weights_version: str | None = None
    synced: bool = False
    """The first answer of each watch came (or the units were given): ready to serve."""
    loads: collections.Counter[str] = field(default_factory=collections.Counter)
    balance: float | None = None
    """The most a unit may hold, over the mean of requests in flight; None: epd_client's 1.25."""
    _turn: int = 0

    @classmethod
    def fixed(cls, model: str, units: Mapping[str, str], weights_version: str | None = None) -> UnitsView:
        """Units given by name and URL (their proxies), all ready: a gateway without a cluster."""
        found = tuple(Unit(name=name, front_url=url, encoder_urls=("fixed",)) for name, url in units.items())
        return cls(model, ModelEndpoints(model, found), weights_version, synced=True)

    def update(self, status: Mapping[str, Any], spec: Mapping[str, Any], slices: Iterable[Mapping[str, Any]]) -> None:
        """The EPDDeployment (its status and spec) and the EndpointSlices of its units, as the
        watches last saw them."""
        try:
            self.endpoints = Endpoints.from_status(status, slices).model(self.model)
        except EndpointsError as error:
            logger.warning("the EPDDeployment names no usable model %r yet: %s", self.model, error)
            self.endpoints = None
        models = spec.get("models") if isinstance(spec, Mapping) else None
        own = next((m for m in models or () if isinstance(m, Mapping) and m.get("name") == self.model), {})
        version = own.get("weightsVersion")
        if version != self.weights_version:
            logger.info("model %s: weights version %s", self.model, version)
        self.weights_version = version if isinstance(version, str) else None

    def ready(self) -> list[Unit]:
        if self.endpoints is None:
            return []
        try:
            return [u for u in self.endpoints.ready_units() if u.front_url]
        except NoReadyUnitError:
            return []

    def place(self, key: str | None) -> tuple[Unit, bool]:
        """The unit for ``key`` (rendezvous with bounded load over the ready units); whether it
        is the key's own. Raises NoReadyUnitError."""
        ranked, own = self.rank(key)
        return ranked[0], own

    def rank(
        self, key: str | None, eligible: Callable[[Unit], bool] | None = None, fallbacks: int = 0
    ) -> tuple[list[Unit], bool]:
        """The ready unit for ``key`` among those ``eligible`` allows (all by default): rendezvous
        with bounded load; then up to ``fallbacks`` more, where the key goes when the ones before
        are gone (its rendezvous order; without a key, the least loaded); whether the first is the
        key's own. Raises NoReadyUnitError when none is ready and eligible."""
        endpoints = self.endpoints
        if endpoints is None:
            raise NoReadyUnitError(f"model {self.model!r}: the gateway knows no unit yet")
        names = endpoints.ready_names()
        if eligible is not None:
            names = [n for n in names if (u := endpoints.unit(n)) is not None and eligible(u)]
        if not names:
            raise NoReadyUnitError(f"model {self.model!r} has no ready unit the request may go to")
        self._turn += 1
        loads = {name: n for name, n in self.loads.items() if n}
        bound = {} if self.balance is None else {"balance": self.balance}
        choice = choose_unit(key, names, loads, start=self._turn, **bound)
        order = [choice.unit]
        if fallbacks:
            rest = [n for n in names if n != choice.unit]
            order += (
                rank_units(key, rest, fallbacks)
                if key is not None
                else heapq.nsmallest(fallbacks, rest, key=lambda n: loads.get(n, 0))
            )
        units = [u for n in order if (u := endpoints.unit(n)) is not None and u.front_url]
        if not units or units[0].name != choice.unit:
            raise NoReadyUnitError(f"unit {choice.unit} has no address yet")
        return units, choice.preferred


def no_unit(error: NoReadyUnitError) -> ProxyError:
    """503: no ready unit may take the request (through the gateway's port or its picker)."""
    return ProxyError(503, f"no unit to send the request to: {error}; retry later")


def placement_key(found: Plan, headers: Sequence[tuple[str, str]], weights_version: str | None) -> str | None:
    """What places a request (headers lower-cased): its conversation, else its first media
    part's key for the request's weights version (its X-EPD-Weights-Version, else the model's);
    BadRequest for a malformed version header."""
    version = requested_version(headers)
    return affinity_key(
        [part.item for part in found.parts],
        user=found.body.get("user"),
        session=header(headers, SESSION_HEADER),
        weights_version=version if version is not None else weights_version,
    )


class GatewayMetrics:
    """The gateway's own metrics, besides the proxy's (requests by route and code)."""

    def __init__(self, metrics: ProxyMetrics, units: UnitsView) -> None:
        registry = metrics.registry
        self._routed = Counter(
            "epd_gateway_routed_total",
            "Requests sent to a unit, by what placed them: media (their first media part's key), session "
            "(X-EPD-Session or the user field), none (least-loaded unit).",
            ["by"],
            registry=registry,
        )
        self._misses = Counter(
            "epd_gateway_affinity_misses_total",
            "Requests with a key sent to another unit than the key's own (which held more than its share of the "
            "requests in flight): their media are primed again there.",
            registry=registry,
        )
        self._units = Counter(
            "epd_gateway_unit_requests_total", "Requests sent to each unit.", ["unit"], registry=registry
        )
        ready = Gauge("epd_gateway_units_ready", "Units the gateway sends requests to.", registry=registry)
        ready.set_function(lambda: len(units.ready()))
        in_flight = Gauge(
            "epd_gateway_requests_in_flight", "Requests under way through the gateway.", registry=registry
        )
        in_flight.set_function(lambda: sum(units.loads.values()))
        self._children: dict[str, Counter] = {}
        for by in ("media", "session", "none"):
            self._routed.labels(by)
        registry.register(_VersionInfo(units))

    def observe(self, unit: str, key: str | None, own: bool) -> None:
        by = "none" if key is None else "session" if key.startswith("session:") else "media"
        self._routed.labels(by).inc()
        if key is not None and not own:
            self._misses.inc()
        child = self._children.get(unit)
        if child is None:
            child = self._children[unit] = self._units.labels(unit)
        child.inc()


class _VersionInfo(Collector):
    """``epd_gateway_weights_version_info{version}`` 1: the version the gateway sends now (read at
    each scrape, so an old version's series goes with it)."""

    def __init__(self, units: UnitsView) -> None:
        self.units = units

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "epd_gateway_weights_version_info",
            "The model's weights version the gateway sends with requests that carry none (empty: none set).",
            labels=["version"],
        )
        family.add_metric([self.units.weights_version or ""], 1)
        yield family


class Gateway(Proxy):
    """The EPD proxy in gateway mode: places each request on a unit instead of priming it."""

    def __init__(self, *args: Any, units: UnitsView, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.units = units
        self.gateway_metrics = GatewayMetrics(self.metrics, units)

    def admin_app(self) -> web.Application:
        app = super().admin_app()
        app.router.add_get("/ready", self._ready)
        return app

    async def _ready(self, request: web.Request) -> web.Response:
        """Ready once the watches answered: the gateway knows the units (none ready is a 503
        per request, not an unready gateway: clients get the reason)."""
        return web.Response(text="ok") if self.units.synced else web.Response(status=503, text="watching")

    async def _serve(self, request: web.BaseRequest, name: str) -> web.StreamResponse:
        if request.path == PRIME_PATH:
            return _error(request, ProxyError(400, PRIME_REFUSAL), True)
        return await super()._serve(request, name)

    def _plan(self, request: web.BaseRequest, raw: bytes) -> Plan:
        """The request read as the proxy reads it, and its key: from its conversation or media."""
        found = super()._plan(request, raw)
        headers = [(name.lower(), value) for name, value in request.headers.items()]
        placed_by = placement_key(found, headers, self.units.weights_version)  # BadRequest: a 400
        if placed_by is not None:
            request[_KEY] = placed_by
        return found

    async def _prime(self, request: web.BaseRequest, found: Plan) -> Primed | web.StreamResponse:
        """No priming here: the unit's proxy primes what its EC store lacks."""
        return Primed({}, [], keyed=False)

    async def forward(
        self, request: web.BaseRequest, body: bytes | None, reservation: Any = None
    ) -> web.StreamResponse:
        key = request.get(_KEY)
        if key is None:
            key = affinity_key((), session=request.headers.get(SESSION_HEADER))
        try:
            unit, own = self.units.place(key)
        except NoReadyUnitError as error:
            if reservation is not None:
                reservation.release()
            return _error(request, no_unit(error))
        assert unit.front_url is not None  # place() gives only units with an address
        request[_UNIT] = unit.front_url
        self.gateway_metrics.observe(unit.name, key, own)
        self.units.loads[unit.name] += 1
        try:
            return await super().forward(request, body, reservation)
        finally:
            self.units.loads[unit.name] -= 1

    def upstream_for(self, request: web.BaseRequest) -> str:
        return request[_UNIT]

    def added_headers(self, request: web.BaseRequest, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        version = self.units.weights_version
        if version is None or any(name == WEIGHTS_VERSION_HEADER for name, _ in headers):
            return []
        return [(WEIGHTS_VERSION_HEADER, version)]


def _error(request: web.BaseRequest, error: ProxyError, close: bool = False) -> web.Response:
    """The gateway's own answer, in the route's error shape (as the proxy's)."""
    response = web.json_response(error_body(error, request.path), status=error.status)
    if close:
        response.force_close()
    return response


# --------------------------------------------------------------------------- watching


def parse_units(given: Sequence[str]) -> dict[str, str]:
    """``--unit NAME=URL`` flags."""
    units = {}
    for text in given:
        name, sep, url = text.partition("=")
        if not sep or not name or not url.startswith("http://"):
            raise ValueError(f"expected NAME=http://HOST:PORT, e.g. demo-actor-0=http://10.0.0.5:8000, not {text!r}")
        units[name] = url.rstrip("/")
    return units


async def watch_units(api: Api, view: UnitsView, *, namespace: str, deployment: str, units_service: str) -> None:
    """Keep ``view`` up to date with the EPDDeployment and its units' EndpointSlices."""
    seen: dict[str, list[dict[str, Any]] | None] = {"deployment": None, "slices": None}

    def refresh() -> None:
        deployments, slices = seen["deployment"], seen["slices"]
        if deployments is None or slices is None:
            return
        found = deployments[0] if deployments else {}
        view.update(found.get("status") or {}, found.get("spec") or {}, slices)
        view.synced = True

    def deployments(items: list[dict[str, Any]]) -> None:
        seen["deployment"] = items
        refresh()

    def endpoint_slices(items: list[dict[str, Any]]) -> None:
        seen["slices"] = items
        refresh()

    await asyncio.gather(
        follow(
            api,
            f"/apis/{api_group.GROUP}/{api_group.VERSION}/namespaces/{namespace}/{api_group.PLURAL}",
            {"fieldSelector": f"metadata.name={deployment}"},
            deployments,
            f"epddeployment {namespace}/{deployment}",
        ),
        follow(
            api,
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            {"labelSelector": f"{SERVICE_NAME_LABEL}={units_service}"},
            endpoint_slices,
            f"the endpointslices of {namespace}/{units_service}",
        ),
    )
