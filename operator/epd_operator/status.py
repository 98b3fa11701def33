"""Observed pods -> unit readiness -> EPDDeployment status: pure functions.

One module, though past 350 lines: every condition is computed from the same observed pods and
StatefulSets, and one function writes them all, so that none can disagree with another.

A unit is Ready only while its pod is Ready AND every encoder and consumer container is ready:
the kubelet already makes an unready native-sidecar encoder unready the pod, and we check the
containers too so that a consumer is never reported Ready while its encoders are unhealthy.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from . import api
from .ec.budget import budget_warning, effective_max_bytes
from .indexes import REVISION_LABEL, Pod, PodSummary, StatefulSetSummary
from .render import EngineCommand, ModelPlan, ProxyCommand, RouterCommand
from .resources import (
    ENCODERS_READY_GATE,
    child_name,
    encoders_scaled_object_name,
    pool_name,
    unit_pod_selector,
)


@dataclass(frozen=True, slots=True)
class ObservedPod:
    """What one pod says about itself: a unit, or (kind "encoder pod") a pod of an encoder pool."""

    name: str
    model: str
    exists: bool
    ready: bool
    starting: bool
    encoders_ready: bool
    reason: str  # "Ready" when ready
    message: str
    node: str | None = None
    kind: str = "unit"  # "encoder pod" for a pod of an encoder pool
    revision: str | None = None  # of the pod's template (None while there is no pod)

    def unready(self) -> api.UnreadyPod:
        return api.UnreadyPod(name=self.name, node=self.node, reason=self.reason, message=self.message or None)


def _condition(pod: Pod, kind: str) -> dict[str, Any]:
    conditions: list[dict[str, Any]] = pod.get("status", {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), {})


@dataclass(frozen=True, slots=True)
class Shape:
    """The containers of a model's units that status reads, named once per model (not per pod)."""

    model: str
    encoders: tuple[str, ...]
    routed: tuple[str, ...]  # what a request passes through: the consumers, the router, the EPD proxy

    @classmethod
    def of(cls, plan: ModelPlan) -> Shape:
        routed: list[EngineCommand | RouterCommand | ProxyCommand] = [
            *plan.consumers,
            *([plan.router] if plan.router else []),
            *([plan.proxy] if plan.proxy else []),
        ]
        return cls(
            plan.name, tuple(e.container_name for e in plan.unit_encoders), tuple(c.container_name for c in routed)
        )


def observe_unit(
    shape: Shape,
    unit_name: str,
    pod: Pod | None,
    pool: Pool | None = None,
    create_failure: str | None = None,
) -> ObservedPod:
    """What one unit's pod says about it; `pod` is None while it does not exist yet.
    `pool`: the model's encoder pool (placement Pools), whose encoders the unit's consumers need.
    `create_failure`: why its StatefulSet cannot create the pods it lacks (its FailedCreate Event)."""
    if pod is None:
        reason, message = "PodMissing", "pod not created yet"
        if create_failure:  # not progress: admission, a quota or a webhook refuses the pod
            reason, message = "FailedCreate", f"the StatefulSet cannot create the pod: {create_failure}"
        return ObservedPod(unit_name, shape.model, False, False, not create_failure, False, reason, message)
    status = pod.get("status", {})
    containers = {
        c["name"]: c for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    }
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    unready_encoders = [n for n in shape.encoders if not containers.get(n, {}).get("ready")]
    unready_consumers = [n for n in shape.routed if not containers.get(n, {}).get("ready")]
    # A container that has not started yet is still loading its model: progress, not damage.
    not_started = [n for n in [*unready_encoders, *unready_consumers] if not containers.get(n, {}).get("started")]
    ready_condition = conditions.get("Ready", {})
    scheduled = conditions.get("PodScheduled", {})
    # A pod bound to a node is scheduled whatever PodScheduled says: the scheduler can record a
    # bind error after a bind that went through (seen across an API server restart), and nothing
    # rewrites that condition afterwards.
    node = pod.get("spec", {}).get("nodeName")
    unscheduled = scheduled.get("status") == "False" and not node
    if pod.get("metadata", {}).get("deletionTimestamp"):
        reason, message = "Terminating", "pod is terminating"
    elif unscheduled:
        reason, message = scheduled.get("reason") or "Unschedulable", scheduled.get("message") or "pod not scheduled"
    elif unready_encoders:
        reason = "EncoderStarting" if set(unready_encoders) <= set(not_started) else "EncoderUnready"
        message = f"encoder {', '.join(unready_encoders)} not ready" + (
            ": consumers get no traffic" if shape.routed else ""
        )
    elif unready_consumers:
        reason = "EngineStarting" if set(unready_consumers) <= set(not_started) else "EngineUnready"
        message = f"{', '.join(unready_consumers)} not ready"
    elif pool is not None and not pool.ready_pods:
        reason, message = (
            "NoReadyEncoder",
            f"encoder pool {pool.name} has no ready encoder: its readiness gate is closed",
        )
    elif ready_condition.get("status") != "True":
        reason, message = "PodNotReady", ready_condition.get("message") or "pod is not Ready"
    else:
        reason, message = "Ready", ""
    is_ready = reason == "Ready"
    # A unit being replaced (Terminating) is progress too, as during every rollout.
    starting = (
        reason in ("EncoderStarting", "EngineStarting", "PodNotReady", "Terminating")
        or (unscheduled and reason != "Unschedulable")
        or (reason == "NoReadyEncoder" and pool is not None and pool.starting)
    )
    encoders_ready = not unready_encoders and (pool is None or pool.ready_pods > 0)
    revision = (pod.get("metadata", {}).get("labels") or {}).get(REVISION_LABEL)
    return ObservedPod(
        unit_name, shape.model, True, is_ready, starting, encoders_ready, reason, message, node, revision=revision
    )


def endpoints(engines: Iterable[EngineCommand]) -> list[api.EngineEndpoint]:
    """Name, role and port of each engine: the same in every pod of a StatefulSet."""
    return [api.EngineEndpoint(name=e.container_name, role=e.worker_type, port=e.port) for e in engines]


def unready_summary(pods: Iterable[ObservedPod]) -> tuple[dict[str, int], list[api.UnreadyPod]]:
    """The pods not ready counted by reason, and the first LISTED_PODS of them: the broken ones
    (not merely starting) first, each group in order."""
    unready = [p for p in pods if not p.ready]
    reasons = collections.Counter(p.reason for p in unready)
    listed = sorted(unready, key=lambda p: p.starting)[: api.LISTED_PODS]
    return dict(sorted(reasons.items())), [p.unready() for p in listed]


def unit_names(deployment: str, plan: ModelPlan, replicas: int) -> list[str]:
    """Unit pod names are the StatefulSet's ordinal pod names."""
    return [f"{child_name(deployment, plan.name)}-{i}" for i in range(replicas)]


# --------------------------------------------------------------------------- encoder pools


class Observations:
    """The pods of one EPDDeployment as last observed, each with what its observation was made
    from: a pod is decoded and observed again only when its summary (or its pool's readiness, or
    its StatefulSet's failure to create it) changed. A status is recomputed from every pod at each
    refresh, and at thousands of units most of them did not change since the last."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[tuple[Any, ...], ObservedPod]] = {}
        self._seen: dict[str, tuple[tuple[Any, ...], ObservedPod]] = {}

    def observe(
        self,
        shape: Shape,
        name: str,
        pod: PodSummary | None,
        pool: Pool | None = None,
        create_failure: str | None = None,
        kind: str = "unit",
    ) -> ObservedPod:
        pool_state = (pool.ready_pods > 0, pool.starting, pool.name) if pool else None
        made_from = (pod.summary_json if pod else create_failure, shape, pool_state, kind)
        remembered = self._memo.get(name)
        if remembered is not None and remembered[0] == made_from:
            observed = remembered[1]
        else:
            observed = observe_unit(shape, name, pod.tree() if pod else None, pool, create_failure)
            if kind != observed.kind:
                observed = dataclasses.replace(observed, kind=kind)
        self._seen[name] = (made_from, observed)
        return observed

    def done(self) -> None:
        """Forget the pods not observed since the last call (gone, or no longer wanted)."""
        self._memo, self._seen = self._seen, {}

    def units(self) -> dict[str, ObservedPod]:
        """The units (not the encoder pool pods) as observed by the last status computed."""
        return {name: observed for name, (_, observed) in self._memo.items() if observed.kind == "unit"}


@dataclass(frozen=True)
class Pool:
    """A Pools model's encoder pool, observed: each pod observed as a unit of encoders only."""

    name: str  # its StatefulSet
    model: str
    members: list[ObservedPod]

    @property
    def ready_pods(self) -> int:
        """Its ready pods: where the model's images are primed."""
        return sum(m.ready for m in self.members)

    @property
    def starting(self) -> bool:
        """Every pod not ready yet is still starting (or there is none yet): nothing is broken."""
        return all(m.starting for m in self.members if not m.ready)

    def status(self, plan: ModelPlan, autoscaler: str | None) -> api.EncoderPoolStatus:
        reasons, unready = unready_summary(self.members)
        return api.EncoderPoolStatus(
            name=self.name,
            service=self.name,
            replicas=len(self.members),
            ready_pods=self.ready_pods,
            autoscaler=autoscaler,
            engines=endpoints(plan.encoders),
            unready_reasons=reasons,
            unready=unready,
        )


def encoders_autoscaler(deployment: str, spec: api.EPDDeploymentSpec, plan: ModelPlan) -> str | None:
    if spec.model(plan.name).encoder_autoscaling is None:
        return None
    return encoders_scaled_object_name(deployment, plan.name)


def pool_size(
    deployment: str, spec: api.EPDDeploymentSpec, plan: ModelPlan, stateful_sets: Mapping[str, StatefulSetSummary]
) -> int:
    """The encoder pods a pool should have: encoderReplicas, or with an autoscaler the size it
    gave the pool's StatefulSet (the one it owns)."""
    model = spec.model(plan.name)
    if model.encoder_autoscaling is None:
        return model.encoder_replicas
    live = stateful_sets.get(pool_name(deployment, plan.name))
    return live.replicas if live is not None else model.encoder_autoscaling.min_replicas


def observe_pool(
    deployment: str,
    size: int,
    plan: ModelPlan,
    pods: Mapping[str, PodSummary],
    observations: Observations,
    create_failure: str | None = None,
) -> Pool:
    """The encoder pool of a Pools model from its pods (by name), ``size`` of them wanted."""
    name = pool_name(deployment, plan.name)
    # A pool pod holds the model's encoders and nothing else: observed as a unit of that shape.
    encoders_only = Shape(plan.name, tuple(e.container_name for e in plan.encoders), ())
    members = [
        observations.observe(encoders_only, pod_name, pods.get(pod_name), None, create_failure, kind="encoder pod")
        for pod_name in (f"{name}-{i}" for i in range(size))
    ]
    return Pool(name, plan.name, members)


def encoder_gates(
    deployment: str,
    spec: api.EPDDeploymentSpec,
    plans: list[ModelPlan],
    pods: Mapping[str, PodSummary],
    stateful_sets: Mapping[str, StatefulSetSummary],
    now: str,
) -> dict[str, dict[str, Any]]:
    """The readiness-gate condition to write on each unit pod of a Pools model whose condition
    does not say yet what its pool says: True while the pool has a ready encoder, else False."""
    gates = {}
    for plan in plans:
        if not plan.pooled:
            continue
        pool = observe_pool(deployment, pool_size(deployment, spec, plan, stateful_sets), plan, pods, Observations())
        ready = pool.ready_pods > 0
        want = {
            "type": ENCODERS_READY_GATE,
            "status": "True" if ready else "False",
            "reason": "EncodersReady" if ready else "NoReadyEncoder",
            "message": f"encoder pool {pool.name} has {'a' if ready else 'no'} ready encoder",
        }
        for pod_name in unit_names(deployment, plan, spec.replicas):
            summary = pods.get(pod_name)
            pod = summary.tree() if summary else None
            if pod is None or pod.get("metadata", {}).get("deletionTimestamp"):
                continue
            current = _condition(pod, ENCODERS_READY_GATE)
            if any(current.get(k) != v for k, v in want.items()):
                gates[pod_name] = {**want, "lastTransitionTime": now}
    return gates


def _set(
    conditions: list[api.Condition],
    previous: dict[str, api.Condition],
    now: str,
    generation: int | None,
    kind: str,
    ok: bool,
    reason: str,
    message: str = "",
) -> None:
    value = "True" if ok else "False"
    before = previous.get(kind)
    since = before.last_transition_time if before and before.status == value else now
    conditions.append(
        api.Condition(
            type=kind,
            status=value,
            reason=reason,
            message=message,
            last_transition_time=since,
            observed_generation=generation,
        )
    )


def unit_readiness_events(
    before: Mapping[str, ObservedPod], now: Mapping[str, ObservedPod], rolling: bool, fallen: frozenset[str]
) -> tuple[list[tuple[bool, str, str]], frozenset[str]]:
    """Events for the units that stopped being ready since `before` (the units at the last status
    written: a warning each, with the unit's reason) and for those of `fallen` (units that stopped
    being ready before) ready again; and the units fallen now. A unit's first readiness is no
    event: every unit starts unready; nor is a unit going down while a rollout replaces it
    (`rolling`): the rollout's own Events tell that."""
    events: list[tuple[bool, str, str]] = []
    down = set(fallen) & set(now)
    for name, unit in now.items():
        if unit.ready and name in down:
            down.discard(name)
            events.append((False, "UnitReady", f"unit {name} is ready again"))
        elif not unit.ready and name in before and before[name].ready and not rolling:
            down.add(name)
            events.append((True, "UnitUnready", f"unit {name}: {unit.reason}: {unit.message}"))
    return events, frozenset(down)


def _previous(status: dict[str, Any] | None) -> dict[str, api.Condition]:
    conditions = (status or {}).get("conditions") or []
    return {c["type"]: api.Condition.model_validate(c) for c in conditions if isinstance(c, dict) and "type" in c}


def invalid_status(
    errors: list[str], generation: int | None, previous: dict[str, Any] | None, now: str
) -> dict[str, Any]:
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
        models=_previous_models(previous),
    )
    return status.model_dump(by_alias=True, exclude_none=True)


def compute_status(
    *,
    deployment: str,
    spec: api.EPDDeploymentSpec,
    plans: list[ModelPlan],
    pods: Mapping[str, PodSummary],
    stateful_sets: Mapping[str, StatefulSetSummary],
    generation: int | None,
    previous: dict[str, Any] | None,
    now: str,
    evictions: Mapping[str, int] | None = None,
    fallback_encodes: Mapping[str, int] | None = None,
    write_failure: tuple[str, str] | None = None,
    create_failures: Mapping[str, str] | None = None,
    observations: Observations | None = None,
) -> dict[str, Any]:
    """The full status from the pods and StatefulSets of this deployment (each by name);
    `evictions`, `fallback_encodes`: budget evictions and consumers' fallback encodes by unit
    name, for the units whose janitor the operator scraped; `write_failure`: (reason, message)
    of a child this reconcile could not write (the spec is not applied until it goes);
    `create_failures`: by StatefulSet name, why it cannot create the pods it lacks."""
    observations = observations or Observations()
    models: list[api.ModelStatus] = []
    units: list[ObservedPod] = []
    pools: list[Pool] = []
    stalled: list[ObservedPod] = []  # updated pods that will not become Ready: their rollout waits on them
    updated_total = 0
    rolled_out = True  # every StatefulSet observed, all its pods on its current template
    new_revision = False  # a template change in flight (a scale changes no revision)
    existing_per_model = []
    before_models = {m.name: m for m in _previous_models(previous)}
    for plan in plans:
        failures = create_failures or {}
        pool_failure = failures.get(pool_name(deployment, plan.name))
        pool = (
            observe_pool(
                deployment, pool_size(deployment, spec, plan, stateful_sets), plan, pods, observations, pool_failure
            )
            if plan.pooled
            else None
        )
        unit_failure = failures.get(child_name(deployment, plan.name))
        pools += [pool] if pool else []
        names = unit_names(deployment, plan, spec.replicas)
        shape = Shape.of(plan)
        observed = [observations.observe(shape, n, pods.get(n), pool, unit_failure) for n in names]
        units += observed
        existing_per_model.append(sum(u.exists for u in observed))
        # Until the StatefulSet controller has seen the current template, its counts are the old one's;
        # its count may also lag behind the pods it made, which carry their revision themselves.
        unit_set = _current(stateful_sets.get(child_name(deployment, plan.name)))
        updated = 0
        if unit_set:
            updated = max(unit_set.updated_replicas, sum(_updated(unit_set, u) for u in observed))
        updated_total += min(updated, spec.replicas)
        sets = [(unit_set, observed)] + ([(_current(stateful_sets.get(pool.name)), pool.members)] if pool else [])
        for current, members in sets:
            if current is None or not current.rolled_out:
                rolled_out = False
            if current and current.update_revision != current.current_revision:
                new_revision = True
                stalled += [u for u in members if _updated(current, u) and not u.ready and not u.starting]
        reasons, listed = unready_summary(observed)
        earlier = before_models.get(plan.name)
        routed = bool(plan.consumers or plan.router or plan.proxy)
        models.append(
            api.ModelStatus(
                name=plan.name,
                served_model_name=plan.served_model_name,
                ec_storage_path=plan.ec_storage_path,
                ec_storage_max_bytes=effective_max_bytes(spec) if plan.ec_storage_path else None,
                placement=plan.placement,
                stateful_set=child_name(deployment, plan.name),
                units_service=child_name(deployment, plan.name, "units", limit=63),
                desired_units=spec.replicas,
                ready_units=sum(u.ready for u in observed),
                updated_units=updated,
                engines=endpoints(plan.unit_engines),
                entry_port=plan.front_port if routed else None,
                router_port=plan.router.port if plan.router and plan.proxy is None else None,
                unready_reasons=reasons,
                unready=listed,
                ec_evictions=_model_sum(names, evictions, earlier.ec_evictions if earlier else None),
                fallback_encodes=_model_sum(names, fallback_encodes, earlier.fallback_encodes if earlier else None),
                encoder_pool=pool.status(plan, encoders_autoscaler(deployment, spec, plan)) if pool else None,
            )
        )
    observations.done()
    pool_members = [m for pool in pools for m in pool.members]
    before = _previous(previous)
    conditions: list[api.Condition] = []
    _set(conditions, before, now, generation, "Validated", True, "Valid")

    encoder_models = {p.name for p in plans if p.unit_encoders}
    has_encoders = [u for u in units if u.model in encoder_models] + pool_members
    unready_encoders = [u for u in has_encoders if not u.encoders_ready]
    # Pools: the condition names every pool left without a ready encoder first.
    empty = [f"encoder pool {p.name} of model {p.model} has no ready encoder" for p in pools if not p.ready_pods]
    if not has_encoders and not pools:
        _set(conditions, before, now, generation, "EncodersReady", True, "NoEncoders", "text-only models")
    else:
        _set(
            conditions,
            before,
            now,
            generation,
            "EncodersReady",
            not unready_encoders and not empty,
            "NoReadyEncoder" if empty else "EncoderUnready" if unready_encoders else "EncodersReady",
            "; ".join([*empty, *([_describe(unready_encoders)] if unready_encoders else [])]),
        )

    # A deployment is Ready only with every unit and every encoder pool pod ready.
    unready = [u for u in [*units, *pool_members] if not u.ready]
    ready_count = sum(u.ready for u in units)
    _set(
        conditions,
        before,
        now,
        generation,
        "Ready",
        not unready,
        "AllUnitsReady" if not unready else "UnitsNotReady",
        f"{ready_count}/{len(units)} units ready" + (f": {_describe(unready)}" if unready else ""),
    )

    starting = [u for u in unready if u.starting]
    progressing = not rolled_out or bool(starting)
    units_updated = f"{updated_total}/{len(units)} units updated"
    if new_revision:
        progress_reason, progress_message = (
            "RollingOut",
            units_updated + (f"; {_describe(starting)}" if starting else ""),
        )
    elif starting or not rolled_out:
        progress_reason, progress_message = "UnitsStarting", _describe(starting)
    else:
        progress_reason, progress_message = "Complete", ""
    _set(conditions, before, now, generation, "Progressing", progressing, progress_reason, progress_message)

    broken = [u for u in unready if not u.starting]
    if write_failure:
        reason, message = write_failure
        _set(conditions, before, now, generation, "Degraded", True, reason, f"{message}; retrying with backoff")
    elif stalled:
        # The StatefulSet replaces no further pod while one is unavailable: say which and why.
        _set(
            conditions,
            before,
            now,
            generation,
            "Degraded",
            True,
            "RolloutStalled",
            f"rollout stopped at {units_updated}: {_describe(stalled)}; no further pod is replaced until it is "
            "Ready: fix the spec (or revert it) to go on",
        )
    else:
        _set(
            conditions,
            before,
            now,
            generation,
            "Degraded",
            bool(broken),
            broken[0].reason if broken else "AsExpected",
            _describe(broken),
        )

    warnings = [w for p in plans if (w := budget_warning(spec, spec.model(p.name)))]
    _set(
        conditions,
        before,
        now,
        generation,
        "ECBudgetSufficient",
        not warnings,
        "BudgetTooSmall" if warnings else "Sufficient",
        "; ".join(warnings),
    )

    if write_failure:
        phase = "Degraded"  # even with every unit Ready: they do not run the current spec
    elif not unready:
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
        updated=f"{updated_total}/{len(units)}",
        replicas=min(existing_per_model, default=0),
        selector=unit_pod_selector(deployment),
        model_count=len(plans),
        fallback_encodes=_sum_known(m.fallback_encodes for m in models),
        conditions=conditions,
        models=models,
    )
    return status.model_dump(by_alias=True, exclude_none=True)


def _previous_models(status: Mapping[str, Any] | None) -> list[api.ModelStatus]:
    """The models of a previous status; one an older operator wrote in another shape is left out
    (the next status computed says it anew)."""
    models = []
    for model in (status or {}).get("models") or []:
        try:
            models.append(api.ModelStatus.model_validate(model))
        except pydantic.ValidationError:
            continue
    return models


def _model_sum(units: Iterable[str], counts: Mapping[str, int] | None, before: int | None) -> int | None:
    """A model's sum of its units' scraped `counts`; while none of them is known (a restarted
    operator has not scraped them yet) what the status said before."""
    known = [counts[u] for u in units if u in counts] if counts else []
    return sum(known) if known else before


def _updated(stateful_set: StatefulSetSummary, unit: ObservedPod) -> bool:
    """Whether the unit's pod is of the StatefulSet's update revision (a unit without a pod is not)."""
    return unit.revision is not None and unit.revision == stateful_set.update_revision


def _current(stateful_set: StatefulSetSummary | None) -> StatefulSetSummary | None:
    return stateful_set if stateful_set and stateful_set.observed else None


def _describe(units: list[ObservedPod]) -> str:
    """The first LISTED_PODS pods and why each is not ready; how many more there are."""
    listed = "; ".join(
        f"{u.kind} {u.name}: {u.reason}" + (f" ({u.message})" if u.message else "") for u in units[: api.LISTED_PODS]
    )
    more = len(units) - api.LISTED_PODS
    return listed + (f"; and {more} more" if more > 0 else "")


def _sum_known(counts: Iterable[int | None]) -> int | None:
    """The sum of the counts known; None (unset in the status) when none is."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None
