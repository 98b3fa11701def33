"""Where a model's EPD units and engines are: plain, immutable data, parsed from explicit
URLs, a Vime args object or an EPDDeployment status."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._errors import EndpointsError, NoReadyUnitError

ENCODER = "encoder"
CONSUMER = "consumer"
ENTRY = "entry"
POOLS = "Pools"


class SupportsEncoderEndpoints(Protocol):
    """What Vime's rollout passes around: ``{model_name: (served model, [encoder URLs])}``."""

    @property
    def vllm_model_encoder_endpoints(self) -> Mapping[str, tuple[str, Sequence[str]]]: ...


def _base_url(url: str) -> str:
    return url.rstrip("/")


@dataclass(frozen=True)
class Engine:
    """One vLLM engine of a unit. The unit's router is not an engine: it holds no weights."""

    unit: str
    name: str
    """The engine's container name, e.g. ``encoder-0``, ``prefill-0``."""
    role: str
    """``encoder``, ``regular``, ``prefill`` or ``decode``; ``consumer`` when only its URL is
    known (a Unit built from URLs, or a status written before the operator listed engines);
    ``entry`` for the unit's entry (``Unit.entry``) named in an EngineError."""
    url: str | None
    """Base URL; None while the unit's pod has no IP."""

    def __post_init__(self) -> None:
        if self.url is not None:
            object.__setattr__(self, "url", _base_url(self.url))


@dataclass(frozen=True)
class Unit:
    """One EPD unit: one pod whose encoders and consumers share a node-local EC store."""

    name: str
    encoder_urls: tuple[str, ...] = ()
    router_url: str | None = None
    consumer_urls: tuple[str, ...] = ()
    ready: bool = True
    pod: str | None = None
    node: str | None = None
    engines: tuple[Engine, ...] = ()
    """Every engine as the status lists them, encoders first; empty for a status written
    before the operator listed engines and for units built from URLs (``all_engines``
    then derives them from the URLs)."""
    front_url: str | None = None
    """The unit's front door as the status names it (``entryUrl``): its EPD proxy, else its
    router, else its only consumer; None in statuses of operators before the proxy."""

    def __post_init__(self) -> None:
        # Accept any sequence and trailing slashes; paths are appended as "/v1/...".
        object.__setattr__(self, "encoder_urls", tuple(map(_base_url, self.encoder_urls)))
        object.__setattr__(self, "consumer_urls", tuple(map(_base_url, self.consumer_urls)))
        for name in ("router_url", "front_url"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _base_url(getattr(self, name)))
        object.__setattr__(self, "engines", tuple(self.engines))

    def all_engines(self) -> tuple[Engine, ...]:
        """``engines``, else one per URL: role ``encoder`` or, as only the URL is known,
        ``consumer``. Derived on each call, so a copy with other URLs lists those."""
        return self.engines or tuple(
            Engine(self.name, f"{role}-{i}", role, url)
            for role, urls in ((ENCODER, self.encoder_urls), (CONSUMER, self.consumer_urls))
            for i, url in enumerate(urls)
        )

    @property
    def entry_url(self) -> str | None:
        """Where render/generate go: the unit's front door (its EPD proxy passes them on
        unprimed), else its router, else its first consumer."""
        if self.front_url:
            return self.front_url
        if self.router_url:
            return self.router_url
        return self.consumer_urls[0] if self.consumer_urls else None

    @property
    def entry(self) -> Engine | None:
        """``entry_url`` as an Engine named and typed ``entry``, for errors to name."""
        url = self.entry_url
        return None if url is None else Engine(self.name, ENTRY, ENTRY, url)


@dataclass(frozen=True)
class ModelEndpoints:
    name: str
    units: tuple[Unit, ...]
    served_model_name: str | None = None
    placement: str = "Unit"
    """``Unit`` (each unit holds its encoders) or ``Pools``: the encoders form one encoder pool
    that primes for every unit, whose consumers pull each embedding from the encoder that
    computed it (so priming collects ``ec_transfer_params`` for render and generate)."""
    pool_engines: tuple[Engine, ...] = ()
    """With ``Pools``: the encoder pool's engines, ready or not (``Engine.unit`` is their pod)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        object.__setattr__(self, "pool_engines", tuple(self.pool_engines))

    @property
    def pooled(self) -> bool:
        return self.placement == POOLS

    @property
    def served_name(self) -> str:
        """The ``model`` field of requests sent to the engines."""
        return self.served_model_name or self.name

    @property
    def has_encoders(self) -> bool:
        """Whether the model is served with encoder disaggregation (its images get primed)."""
        return self.pooled or any(e.role == ENCODER for u in self.units for e in u.all_engines())

    def ready_units(self) -> tuple[Unit, ...]:
        ready = tuple(u for u in self.units if u.ready)
        if not ready:
            raise NoReadyUnitError(f"model {self.name!r} has no ready unit (of {len(self.units)})")
        return ready

    def engines(self, role: str | None = None) -> tuple[Engine, ...]:
        """Every engine of every unit (ready or not), or only those of ``role``; with
        ``Pools`` the encoder pool's engines first (a unit's encoder URLs are the pool's)."""
        units = (e for u in self.units for e in u.all_engines() if not (self.pooled and e.role == ENCODER))
        return tuple(e for e in (*self.pool_engines, *units) if role is None or e.role == role)


@dataclass(frozen=True)
class Endpoints:
    """The models of one EPD deployment and their units."""

    models: tuple[ModelEndpoints, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))

    def model(self, name: str) -> ModelEndpoints:
        for model in self.models:
            if model.name == name:
                return model
        known = ", ".join(repr(m.name) for m in self.models) or "none"
        raise EndpointsError(f"unknown model {name!r} (known: {known})")

    def engines(self, model: str, role: str | None = None) -> tuple[Engine, ...]:
        """Every engine of ``model``, or only those of ``role``, e.g. for a trainer's weight
        sync: ``Endpoints.from_status(status).engines("actor")`` needs no cluster access."""
        return self.model(model).engines(role)

    @classmethod
    def from_urls(
        cls,
        encoder_urls: Iterable[str],
        entry_url: str | None = None,
        *,
        model_name: str = "default",
        served_model_name: str | None = None,
    ) -> Endpoints:
        """One model with one unit from explicit URLs. ``entry_url`` is its router or
        consumer, needed only for generate. Build Unit objects yourself for several units."""
        unit = Unit(
            name=model_name,
            encoder_urls=tuple(encoder_urls),
            consumer_urls=(entry_url,) if entry_url else (),
        )
        return cls((ModelEndpoints(model_name, (unit,), served_model_name),))

    @classmethod
    def from_vime_args(cls, args: SupportsEncoderEndpoints) -> Endpoints:
        """Vime runs on one node, so each model's encoders form a single unit."""
        return cls(
            tuple(
                ModelEndpoints(name, (Unit(name=name, encoder_urls=tuple(urls)),), served)
                for name, (served, urls) in args.vllm_model_encoder_endpoints.items()
            )
        )

    @classmethod
    def from_status(cls, status: Mapping[str, Any]) -> Endpoints:
        """Parse ``status`` of an EPDDeployment (camelCase, as the operator writes it)."""
        try:
            return cls(tuple(_model_from_status(m) for m in status.get("models") or ()))
        except (KeyError, TypeError, AttributeError) as exc:
            raise EndpointsError(f"malformed EPDDeployment status: {exc!r}") from exc


def _model_from_status(model: Mapping[str, Any]) -> ModelEndpoints:
    pooled = model.get("placement") == POOLS
    # Pools: every unit primes on the pool's ready encoders, which the operator lists per model.
    pool_urls = tuple(model.get("encoderUrls") or ())
    units = tuple(
        Unit(
            name=unit["name"],
            encoder_urls=pool_urls if pooled else tuple(unit.get("encoderUrls") or ()),
            router_url=unit.get("routerUrl"),
            front_url=unit.get("entryUrl"),
            consumer_urls=tuple(unit.get("consumerUrls") or ()),
            # A unit the operator has not yet called ready must not receive traffic.
            ready=unit.get("ready") is True,
            pod=unit.get("pod"),
            node=unit.get("node"),
            # Older statuses have no engine list: Unit.all_engines derives one from the URLs.
            engines=tuple(Engine(unit["name"], e["name"], e["role"], e.get("url")) for e in unit.get("engines") or ()),
        )
        for unit in model.get("units") or ()
    )
    pool_engines = tuple(
        Engine(pod["name"], e["name"], e["role"], e.get("url"))
        for pod in (model.get("encoderPool") or {}).get("pods") or ()
        for e in pod.get("engines") or ()
    )
    return ModelEndpoints(
        model["name"], units, model.get("servedModelName"), model.get("placement") or "Unit", pool_engines
    )


def rendezvous(units: Sequence[Unit], key: str) -> Unit:
    """Highest-random-weight choice: stable for a key, and when a unit leaves only its own
    keys move (a modulo hash would reshuffle almost all of them)."""
    return max(
        units,
        key=lambda u: hashlib.blake2b(f"{key}\0{u.name}".encode(), digest_size=8).digest(),
    )
