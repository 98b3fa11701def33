"""The attributes Vime's rollout reads from its args, filled from an EPDDeployment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from ._endpoints import Endpoints, ModelEndpoints, Unit
from ._errors import EndpointsError, NoReadyUnitError


@dataclass
class VimeRolloutArgs:
    """What Vime's rollout code reads from ``args`` about its engines (names and types as
    Vime's ``start_rollout_servers`` sets them). Copy into Vime's own args with
    ``vars(args).update(vars(vime_rollout_args(...)))``."""

    vllm_model_encoder_endpoints: dict[str, tuple[str, list[str]]]
    """Model name -> (served model, encoder URLs), for the models that have encoders."""
    vllm_model_routers: dict[str, tuple[str, int]]
    """Model name -> (host, port) of the URL its render/generate requests go to."""
    vllm_router_ip: str
    vllm_router_port: int
    """The default model's entry in ``vllm_model_routers``."""


def vime_rollout_args(
    endpoints: Endpoints,
    *,
    default_model: str | None = None,
    units: Mapping[str, str] | None = None,
) -> VimeRolloutArgs:
    """Vime's rollout arguments for an EPDDeployment, so a Vime rollout function runs
    unchanged against it. ``endpoints``: ``discover(...)``, or ``Endpoints.from_status`` of the
    object's status and EndpointSlices.

    A Vime rollout primes and generates on one node, so the arguments name one unit per
    model: a model's only unit, or the one ``units`` names (``{"actor": "demo-actor-1"}``);
    a model with several units and no choice raises EndpointsError. Each chosen unit must
    be ready (NoReadyUnitError otherwise). Its entry URL (router, else first consumer) is
    the model's router address.

    ``default_model`` is the model whose router becomes ``vllm_router_ip``/``_port``
    (Vime renders and generates there when no model is named): by default the model named
    "default", else the first model, as in Vime.
    """
    if not endpoints.models:
        raise EndpointsError("the EPDDeployment lists no models (is its status written yet?)")
    chosen = {model.name: _unit(model, (units or {}).get(model.name)) for model in endpoints.models}
    unknown = set(units or ()) - set(chosen)
    if unknown:
        raise EndpointsError(f"units= names unknown models: {', '.join(sorted(unknown))}")
    routers = {name: _address(unit) for name, unit in chosen.items()}
    encoders = {
        model.name: (model.served_name, list(chosen[model.name].encoder_urls))
        for model in endpoints.models
        if model.has_encoders
    }
    if default_model is None:
        default_model = "default" if "default" in chosen else endpoints.models[0].name
    ip, port = routers[endpoints.model(default_model).name]
    return VimeRolloutArgs(encoders, routers, ip, port)


def _unit(model: ModelEndpoints, name: str | None) -> Unit:
    def names() -> str:
        return ", ".join(u.name for u in model.units) or "none"

    if name is not None:
        unit = model.unit(name)
        if unit is None:
            raise EndpointsError(f"model {model.name!r} has no unit {name!r} (units: {names()})")
    elif len(model.units) == 1:
        (unit,) = model.units
    elif not model.units:
        raise EndpointsError(f"model {model.name!r} has no units yet")
    else:
        raise EndpointsError(
            f"model {model.name!r} has {len(model.units)} units ({names()}); a Vime rollout "
            f"primes and generates on one node: choose one with units={{{model.name!r}: ...}}"
        )
    if not unit.ready:
        raise NoReadyUnitError(f"unit {unit.name!r} of model {model.name!r} is not ready")
    return unit


def _address(unit: Unit) -> tuple[str, int]:
    if unit.entry_url is None:
        raise EndpointsError(f"unit {unit.name!r} has no router or consumer URL")
    parts = urlsplit(unit.entry_url)
    if parts.hostname is None or parts.port is None:
        raise EndpointsError(f"unit {unit.name!r}: no host and port in {unit.entry_url!r}")
    # Vime builds f"http://{ip}:{port}": an IPv6 host needs its brackets back.
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return host, parts.port
