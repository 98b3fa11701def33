"""Where each engine of a model sits: its pod, its index and container name there, and its ports.
The one place the port layout is worked out: render assigns these ports, validation checks the
blocks each pod reserves (pure functions of the spec).

Engines share their pod's network namespace, so each needs its own ports: HTTP ports count up
from `ports.engineBase` (encoders first: they start first, as sidecars), NIXL side channels of
prefill/decode engines from `ports.nixlSideChannelBase` and ECCPUConnector side channels of
encoders from `ports.ecSideChannelBase`, each at the engine's index in its pod. A pod reserves
each block whole, from its base for as many engines as the pod holds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .api import JANITOR_METRICS_PORT, PROXY_METRICS_PORT, EPDDeploymentSpec, ModelSpec, WorkerType
from .ec.regions import uses_cpu_regions

Block = tuple[int, int]  # the lowest and highest port of a range


@dataclass(frozen=True)
class Slot:
    """One engine: which group it comes from and where it sits in its pod."""

    group_index: int  # of its server group in the model
    worker_type: WorkerType
    engine_index: int  # within its pod, encoders first
    container_name: str  # encoder-0, regular-1, prefill-0, ...
    port: int  # HTTP
    nixl_port: int | None  # prefill/decode engines
    ec_side_channel_port: int | None  # ECCPUConnector encoders (placement Pools)


def slots(spec: EPDDeploymentSpec, model: ModelSpec) -> list[Slot]:
    """Every engine of the model, encoders first, then the consumers in group order. With Pools
    the encoders (in the pool's pods) and the consumers (in the units) are numbered from 0 each."""
    groups = list(enumerate(model.server_groups))
    ordered = [g for g in groups if g[1].worker_type.is_encoder] + [
        g for g in groups if not g[1].worker_type.is_encoder
    ]
    pool_size = model.encoder_engines if model.pooled else 0
    cpu_regions = uses_cpu_regions(model)
    names: Counter[WorkerType] = Counter()
    placed: list[Slot] = []
    for g_index, group in ordered:
        worker_type = group.worker_type
        for _ in range(group.engines):
            index = len(placed) - (0 if worker_type.is_encoder else pool_size)
            placed.append(
                Slot(
                    group_index=g_index,
                    worker_type=worker_type,
                    engine_index=index,
                    container_name=f"{worker_type.value}-{names[worker_type]}",
                    port=spec.ports.engine_base + index,
                    nixl_port=spec.ports.nixl_side_channel_base + index if worker_type.is_pd else None,
                    ec_side_channel_port=(
                        spec.ports.ec_side_channel_base + index if cpu_regions and worker_type.is_encoder else None
                    ),
                )
            )
            names[worker_type] += 1
    return placed


def proxied(spec: EPDDeploymentSpec, model: ModelSpec) -> bool:
    """Whether the model's units run the EPD proxy: when enabled, for a model with encoders to
    prime on (one without encodes on its consumers by design, and its proxy would have none)."""
    return spec.proxy.enabled and model.has_encoders


def unit_ports(spec: EPDDeploymentSpec, model: ModelSpec) -> dict[str, Block]:
    """The port blocks a unit pod reserves, named after the spec field that moves each (or what
    takes it, for a fixed port): its engines' HTTP ports, the front port (the EPD proxy's or the
    router's) and the router's behind the proxy, the proxy's metrics port (with Pools, the consumers only), the router's,
    prefill/decode NIXL side channels, and the EC janitor's metrics port (units with encoders)."""
    engines = model.consumer_engines if model.pooled else model.encoder_engines + model.consumer_engines
    blocks = {"ports.engineBase": _block(spec.ports.engine_base, engines)}
    proxy = proxied(spec, model)
    if model.needs_router or proxy:
        blocks["ports.router"] = _block(spec.ports.router, 1)
    if model.needs_router and proxy:
        blocks["ports.routerLoopback"] = _block(spec.ports.router_loopback, 1)
    if proxy:
        blocks["the EPD proxy's metrics port"] = _block(PROXY_METRICS_PORT, 1)
    if model.is_pd:
        blocks["ports.nixlSideChannelBase"] = _block(spec.ports.nixl_side_channel_base, engines)
    if model.has_encoders and not model.pooled:
        blocks["the EC janitor's metrics port"] = _block(JANITOR_METRICS_PORT, 1)
    return blocks


def pool_ports(spec: EPDDeploymentSpec, model: ModelSpec) -> dict[str, Block]:
    """The port blocks an encoder pool pod (placement Pools) reserves: its encoders' HTTP ports
    and EC side channels."""
    blocks = {"ports.engineBase": _block(spec.ports.engine_base, model.encoder_engines)}
    if uses_cpu_regions(model):
        blocks["ports.ecSideChannelBase"] = _block(spec.ports.ec_side_channel_base, model.encoder_engines)
    return blocks


def pod_gpus(model: ModelSpec) -> dict[str, int]:
    """The GPUs each kind of pod of the model requests: a unit (with Pools, its consumers only),
    and with Pools an encoder pool pod."""
    encoders = sum(g.num_gpus for g in model.server_groups if g.worker_type.is_encoder)
    consumers = sum(g.num_gpus for g in model.server_groups if not g.worker_type.is_encoder)
    if model.pooled:
        return {"a unit": consumers, "an encoder pool pod": encoders}
    return {"a unit": encoders + consumers}


def _block(base: int, count: int) -> Block:
    return base, base + count - 1
