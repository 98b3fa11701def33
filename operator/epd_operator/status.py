"""Observed pods -> unit readiness -> EPDDeployment status: pure functions.

A unit is Ready only while its pod is Ready AND every encoder and consumer container is ready:
the kubelet already makes an unready native-sidecar encoder unready the pod, and we check the
containers too so that a consumer is never reported Ready while its encoders are unhealthy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import api
from .ec.budget import budget_warning, effective_max_bytes
from .render import ModelPlan
from .resources import child_name

Pod = dict[str, Any]


@dataclass(frozen=True)
class Unit:
    name: str
    model: str
    exists: bool
    ready: bool
    starting: bool
    encoders_ready: bool
    reason: str
    message: str
    status: api.UnitStatus


def _condition(pod: Pod, kind: str) -> dict[str, Any]:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return {}


def _containers(pod: Pod) -> dict[str, dict[str, Any]]:
    status = pod.get("status", {})
    return {c["name"]: c for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]}


def observe_unit(plan: ModelPlan, unit_name: str, pod: Pod | None, ec_evictions: int | None = None,
                 fallback_encodes: int | None = None) -> Unit:
    """What one unit's pod says about it; `pod` is None while it does not exist yet.
    `ec_evictions`, `fallback_encodes`: its janitor's counters, as the operator last scraped them."""
    if pod is None:
        status = api.UnitStatus(name=unit_name, pod=unit_name, reason="PodMissing", message="pod not created yet")
        return Unit(unit_name, plan.name, False, False, True, False, "PodMissing", status.message or "", status)
    ip = pod.get("status", {}).get("podIP")
    containers = _containers(pod)
    encoders, consumers = plan.encoders, plan.consumers
    routed = [*consumers, *([plan.router] if plan.router else [])]

    def ready(name: str) -> bool:
        return bool(containers.get(name, {}).get("ready"))

    unready_encoders = [e.container_name for e in encoders if not ready(e.container_name)]
    unready_consumers = [c.container_name for c in routed if not ready(c.container_name)]
    # A container that has not started yet is still loading its model: progress, not damage.
    not_started = [n for n in [*unready_encoders, *unready_consumers] if not containers.get(n, {}).get("started")]
    pod_ready = _condition(pod, "Ready").get("status") == "True"
    scheduled = _condition(pod, "PodScheduled")
    if pod.get("metadata", {}).get("deletionTimestamp"):
        reason, message = "Terminating", "pod is terminating"
    elif scheduled.get("status") == "False":
        reason, message = scheduled.get("reason") or "Unschedulable", scheduled.get("message") or "pod not scheduled"
    elif unready_encoders:
        reason = "EncoderStarting" if set(unready_encoders) <= set(not_started) else "EncoderUnready"
        message = f"encoder {', '.join(unready_encoders)} not ready: consumers get no traffic"
    elif unready_consumers:
        reason = "EngineStarting" if set(unready_consumers) <= set(not_started) else "EngineUnready"
        message = f"{', '.join(unready_consumers)} not ready"
    elif not pod_ready:
        reason, message = "PodNotReady", _condition(pod, "Ready").get("message") or "pod is not Ready"
    else:
        reason, message = "Ready", ""
    is_ready = reason == "Ready"

    def url(port: int) -> str | None:
        return f"http://{ip}:{port}" if ip else None

    status = api.UnitStatus(
        name=unit_name,
        pod=unit_name,
        node=pod.get("spec", {}).get("nodeName"),
        ready=is_ready,
        reason=None if is_ready else reason,
        message=message or None,
        encoder_urls=[u for e in encoders if (u := url(e.port))],
        consumer_urls=[u for c in consumers if (u := url(c.port))],
        router_url=url(plan.router.port) if plan.router else None,
        engines=[api.EngineStatus(name=e.container_name, role=e.worker_type, url=url(e.port)) for e in plan.engines],
        ec_evictions=ec_evictions,
        fallback_encodes=fallback_encodes,
    )
    starting = reason in ("EncoderStarting", "EngineStarting", "PodNotReady") or (
        scheduled.get("status") == "False" and reason != "Unschedulable"
    )
    return Unit(unit_name, plan.name, True, is_ready, starting, not unready_encoders, reason, message, status)


def unit_names(deployment: str, plan: ModelPlan, replicas: int) -> list[str]:
    """Unit pod names are the StatefulSet's ordinal pod names."""
    return [f"{child_name(deployment, plan.name)}-{i}" for i in range(replicas)]


def _set(conditions: list[api.Condition], previous: dict[str, api.Condition], now: str, generation: int | None,
         kind: str, ok: bool, reason: str, message: str = "") -> None:
    value = "True" if ok else "False"
    before = previous.get(kind)
    since = before.last_transition_time if before and before.status == value else now
    conditions.append(
        api.Condition(type=kind, status=value, reason=reason, message=message,
                      last_transition_time=since, observed_generation=generation)
    )


def _previous(status: dict[str, Any] | None) -> dict[str, api.Condition]:
    conditions = (status or {}).get("conditions") or []
    return {c["type"]: api.Condition.model_validate(c) for c in conditions if isinstance(c, dict) and "type" in c}


def invalid_status(errors: list[str], generation: int | None, previous: dict[str, Any] | None, now: str) -> dict[str, Any]:
    """Status of a spec that is not reconciled: children (if any) are left exactly as they were."""
    before = _previous(previous)
    conditions: list[api.Condition] = []
    _set(conditions, before, now, generation, "Validated", False, "InvalidSpec", "; ".join(errors))
    kept = [c for k, c in before.items() if k != "Validated"]
    status = api.EPDDeploymentStatus(
        observed_generation=generation,
        phase="Invalid",
        ready=(previous or {}).get("ready"),
        model_count=(previous or {}).get("modelCount"),
        fallback_encodes=(previous or {}).get("fallbackEncodes"),
        conditions=conditions + kept,
        models=[api.ModelStatus.model_validate(m) for m in (previous or {}).get("models") or []],
    )
    return status.model_dump(by_alias=True, exclude_none=True)


def compute_status(
    *,
    deployment: str,
    spec: api.EPDDeploymentSpec,
    plans: list[ModelPlan],
    pods: dict[str, Pod],
    rolled_out: bool,
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
    evictions: Mapping[str, int] | None = None,
    fallback_encodes: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The full status from the pods of this deployment (by name) and whether every
    StatefulSet has finished rolling out its current revision; `evictions`, `fallback_encodes`:
    budget evictions and consumers' fallback encodes by unit name, for the units whose janitor
    the operator scraped."""
    models: list[api.ModelStatus] = []
    units: list[Unit] = []
    for plan in plans:
        observed = [observe_unit(plan, n, pods.get(n), (evictions or {}).get(n), (fallback_encodes or {}).get(n))
                    for n in unit_names(deployment, plan, spec.replicas)]
        units += observed
        models.append(
            api.ModelStatus(
                name=plan.name,
                served_model_name=plan.served_model_name,
                ec_storage_path=plan.ec_storage_path,
                ec_storage_max_bytes=effective_max_bytes(spec) if plan.ec_storage_path else None,
                ready_units=sum(u.ready for u in observed),
                fallback_encodes=_sum_known(u.status.fallback_encodes for u in observed),
                units=[u.status for u in observed],
            )
        )
    before = _previous(previous)
    conditions: list[api.Condition] = []
    _set(conditions, before, now, generation, "Validated", True, "Valid")

    encoder_models = {p.name for p in plans if p.encoders}
    has_encoders = [u for u in units if u.model in encoder_models]
    unready_encoders = [u for u in has_encoders if not u.encoders_ready]
    if not has_encoders:
        _set(conditions, before, now, generation, "EncodersReady", True, "NoEncoders", "text-only models")
    else:
        _set(conditions, before, now, generation, "EncodersReady", not unready_encoders,
             "EncodersReady" if not unready_encoders else "EncoderUnready", _describe(unready_encoders))

    unready = [u for u in units if not u.ready]
    ready_count = len(units) - len(unready)
    _set(conditions, before, now, generation, "Ready", not unready,
         "AllUnitsReady" if not unready else "UnitsNotReady",
         f"{ready_count}/{len(units)} units ready" + (f": {_describe(unready)}" if unready else ""))

    starting = [u for u in unready if u.starting]
    progressing = not rolled_out or bool(starting)
    _set(conditions, before, now, generation, "Progressing", progressing,
         ("RollingOut" if not rolled_out else "UnitsStarting") if progressing else "Complete",
         _describe(starting) if starting else "")

    broken = [u for u in unready if not u.starting]
    _set(conditions, before, now, generation, "Degraded", bool(broken),
         broken[0].reason if broken else "AsExpected", _describe(broken))

    warnings = [w for p in plans if (w := budget_warning(spec, p))]
    _set(conditions, before, now, generation, "ECBudgetSufficient", not warnings,
         "BudgetTooSmall" if warnings else "Sufficient", "; ".join(warnings))

    if not unready:
        phase = "Ready"
    elif broken:
        phase = "Degraded"
    elif not any(u.exists for u in units):
        phase = "Pending"
    else:
        phase = "Progressing"
    status = api.EPDDeploymentStatus(
        observed_generation=generation,
        phase=phase,
        ready=f"{ready_count}/{len(units)}",
        model_count=len(plans),
        fallback_encodes=_sum_known(m.fallback_encodes for m in models),
        conditions=conditions,
        models=models,
    )
    return status.model_dump(by_alias=True, exclude_none=True)


def _describe(units: list[Unit]) -> str:
    return "; ".join(f"unit {u.name}: {u.reason}" + (f" ({u.message})" if u.message else "") for u in units)


def _sum_known(counts: Iterable[int | None]) -> int | None:
    """The sum of the counts known; None (unset in the status) when none is."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None
