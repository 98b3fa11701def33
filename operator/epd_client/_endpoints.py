"""Where a model's EPD units and engines are: plain, immutable data, parsed from explicit
URLs, a Vime args object, or an EPDDeployment status and the EndpointSlices it names."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

from ._affinity import BALANCE, Choice, choose
from ._errors import EndpointsError, NoReadyUnitError

ENCODER = "encoder"
CONSUMER = "consumer"
ENTRY = "entry"
POOLS = "Pools"
# kube-controller-manager labels each EndpointSlice with the Service it lists the pods of.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


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
    units: Sequence[Unit]
    """Every unit, ready or not. A tuple when built by hand; from ``Endpoints.from_status``
    a sequence that builds each ``Unit`` when first read (a model may have thousands)."""
    served_model_name: str | None = None
    placement: str = "Unit"
    """``Unit`` (each unit holds its encoders) or ``Pools``: the encoders form one encoder pool
    that primes for every unit, whose consumers pull each embedding from the encoder that
    computed it (so priming collects ``ec_transfer_params`` for render and generate)."""
    pool_engines: tuple[Engine, ...] = ()
    """With ``Pools``: the encoder pool's engines, ready or not (``Engine.unit`` is their pod)."""

    def __post_init__(self) -> None:
        if not isinstance(self.units, UnitTable):
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
        if isinstance(self.units, UnitTable):
            return self.pooled or self.units.has_encoders
        return self.pooled or any(e.role == ENCODER for u in self.units for e in u.all_engines())

    def unit(self, name: str) -> Unit | None:
        """The unit of that name (its pod's), if the model has it."""
        if isinstance(self.units, UnitTable):
            return self.units.named(name)
        return next((u for u in self.units if u.name == name), None)

    def ready_units(self) -> tuple[Unit, ...]:
        ready = tuple(u for u in self.units if u.ready)
        if not ready:
            raise NoReadyUnitError(f"model {self.name!r} has no ready unit (of {len(self.units)})")
        return ready

    def ready_names(self) -> list[str]:
        """The names of the ready units, in the status' order (no Unit is built for them)."""
        if isinstance(self.units, UnitTable):
            return self.units.ready_names()
        return [u.name for u in self.units if u.ready]

    def unit_for(self, key: str, loads: Mapping[str, int] | None = None) -> Unit:
        """The ready unit that serves ``key`` (a sample, session or conversation id, or a media
        key), as ``EPDClient`` and the EPD gateway choose it: stable for a key while its unit
        stays ready (rendezvous hashing); with ``loads`` (requests in flight by unit name), the
        next unit in the key's order while its own holds more than its share (bounded load,
        ``epd_client._affinity``)."""
        return self.choose(key, loads)[0]

    def choose(
        self, key: str | None, loads: Mapping[str, int] | None = None, *, start: int = 0, balance: float = BALANCE
    ) -> tuple[Unit, Choice]:
        """``unit_for``, and whether the unit is the key's own (``Choice``); without a key the
        least loaded ready unit, ties broken from ``start`` on. ``balance``: the most a unit
        may hold, over the mean of requests in flight."""
        names = self.ready_names()
        if not names:
            raise NoReadyUnitError(f"model {self.name!r} has no ready unit (of {len(self.units)})")
        choice = choose(key, names, loads, start=start, balance=balance)
        unit = self.unit(choice.unit)
        assert unit is not None  # one of its own names
        return unit, choice

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
    def from_status(cls, status: Mapping[str, Any], endpoint_slices: Iterable[Mapping[str, Any]] = ()) -> Endpoints:
        """Parse ``status`` of an EPDDeployment (camelCase, as the operator writes it) and the
        EndpointSlices of the Services it names (``unitsService``, ``encoderPool.service``; as
        the API server lists them, e.g. the ``items`` of a list): the status says what each unit
        holds, the EndpointSlices where each unit is and whether it is ready. A unit without an
        endpoint (its pod has no IP yet) is listed, not ready, with no URL."""
        try:
            found = _slice_endpoints(endpoint_slices)
            return cls(tuple(_model_from_status(m, found) for m in status.get("models") or ()))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise EndpointsError(f"malformed EPDDeployment status or EndpointSlice: {exc!r}") from exc


# An endpoint of an EndpointSlice, as this library reads it: its pod's IP, node and readiness.
Found = tuple[str, str | None, bool]


def _slice_endpoints(slices: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Found]]:
    """Service name -> pod name -> (IP, node, ready), from EndpointSlices. Ready is the pod's
    readiness (``serving``; a Service with publishNotReadyAddresses says ``ready`` of every
    pod), never a terminating pod."""
    found: dict[str, dict[str, Found]] = {}
    for endpoint_slice in slices:
        service = endpoint_slice["metadata"]["labels"][SERVICE_NAME_LABEL]
        pods = found.setdefault(service, {})
        for endpoint in endpoint_slice.get("endpoints") or ():
            addresses, target = endpoint.get("addresses"), endpoint.get("targetRef")
            if not addresses or not target:
                continue
            conditions = endpoint.get("conditions") or {}
            serving = conditions.get("serving", conditions.get("ready"))
            ready = serving is True and conditions.get("terminating") is not True
            pods[target["name"]] = (addresses[0], endpoint.get("nodeName"), ready)
    return found


@dataclass(frozen=True, slots=True)
class _Template:
    """What every unit of a model holds, from the status: its engines' names, roles and ports."""

    engines: tuple[tuple[str, str, int], ...]  # (container name, role, port), encoders first
    entry_port: int | None
    router_port: int | None
    pool_urls: tuple[str, ...] | None  # Pools: the pool's ready encoders, where every unit primes


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


class UnitTable(Sequence[Unit]):
    """A model's units as the status and the EndpointSlices give them: a name and, where the
    unit's pod has an endpoint, its IP, node and readiness; each ``Unit`` is built when first
    read, so that choosing one of thousands builds one."""

    def __init__(self, names: Sequence[str], found: Mapping[str, Found], template: _Template) -> None:
        self._names = names
        self._index = {name: i for i, name in enumerate(names)}
        self._found = found
        self._template = template
        self._built: dict[int, Unit] = {}

    @property
    def has_encoders(self) -> bool:
        return any(role == ENCODER for _, role, _ in self._template.engines)

    def ready_names(self) -> list[str]:
        return [name for name in self._names if (f := self._found.get(name)) is not None and f[2]]

    def named(self, name: str) -> Unit | None:
        i = self._index.get(name)
        return None if i is None else self[i]

    def __len__(self) -> int:
        return len(self._names)

    @overload
    def __getitem__(self, index: int) -> Unit: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Unit, ...]: ...

    def __getitem__(self, index: int | slice) -> Unit | tuple[Unit, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        i = range(len(self))[index]  # negative indexes, and IndexError past the end
        unit = self._built.get(i)
        if unit is None:
            unit = self._built[i] = self._build(self._names[i])
        return unit

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, which hash otherwise

    def _build(self, name: str) -> Unit:
        template = self._template
        ip, node, ready = self._found.get(name) or (None, None, False)

        def url(port: int | None) -> str | None:
            return _url(ip, port) if ip is not None and port is not None else None

        engines = tuple(Engine(name, container, role, url(port)) for container, role, port in template.engines)
        own_encoders = tuple(e.url for e in engines if e.role == ENCODER and e.url is not None)
        return Unit(
            name=name,
            encoder_urls=template.pool_urls if template.pool_urls is not None else own_encoders,
            router_url=url(template.router_port),
            consumer_urls=tuple(e.url for e in engines if e.role != ENCODER and e.url is not None),
            ready=ready,
            pod=name,
            node=node,
            engines=engines,
            front_url=url(template.entry_port),
        )


def _pod_names(stateful_set: str, count: int) -> list[str]:
    """A StatefulSet's pods are named by ordinal."""
    return [f"{stateful_set}-{i}" for i in range(count)]


def _model_from_status(model: Mapping[str, Any], found: Mapping[str, Mapping[str, Found]]) -> ModelEndpoints:
    pooled = model.get("placement") == POOLS
    pool = model.get("encoderPool") or {}
    pool_engines: tuple[Engine, ...] = ()
    pool_urls = None
    if pooled:
        pool_pods = found.get(pool["service"], {})
        engines = [(e["name"], e["role"], int(e["port"])) for e in pool.get("engines") or ()]
        pool_engines = tuple(
            Engine(pod, name, role, _url(f[0], port) if (f := pool_pods.get(pod)) else None)
            for pod in _pod_names(pool["name"], int(pool["replicas"]))
            for name, role, port in engines
        )
        # Every unit primes on the pool's ready encoders.
        pool_urls = tuple(
            _url(f[0], port)
            for pod in _pod_names(pool["name"], int(pool["replicas"]))
            if (f := pool_pods.get(pod)) is not None and f[2]
            for _, role, port in engines
            if role == ENCODER
        )
    template = _Template(
        engines=tuple((e["name"], e["role"], int(e["port"])) for e in model.get("engines") or ()),
        entry_port=model.get("entryPort"),
        router_port=model.get("routerPort"),
        pool_urls=pool_urls,
    )
    names = _pod_names(model["statefulSet"], int(model.get("desiredUnits", 0)))
    units = UnitTable(names, found.get(model["unitsService"], {}), template)
    return ModelEndpoints(
        model["name"], units, model.get("servedModelName"), model.get("placement") or "Unit", pool_engines
    )
