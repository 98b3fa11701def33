"""kopf handlers: thin. Read, call the pure core, apply by server-side apply, write status.

Reconcile is level-based: every EPDDeployment event (and every change of its children) queues
its key, and a worker computes the whole desired state from the indexes; nothing depends on
seeing a particular event, so a restarted operator converges without duplicates.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import time
from typing import Any

import aiohttp
import kopf

from . import api, metrics
from .evictions import JanitorMetrics, eviction_report, parse_metrics
from .kube import Kube, KubeError
from .render import ModelPlan, render
from .resources import (
    ANNOTATION_SPEC_HASH,
    FIELD_MANAGER,
    JANITOR_METRICS_PORT,
    LABEL_DEPLOYMENT,
    LABEL_MANAGED_BY,
    OPERATOR_IMAGE,
    desired_children,
)
from .status import compute_status, invalid_status
from .validation import SpecError, validate
from .workqueue import WorkQueue

EPD = (api.GROUP, api.VERSION, api.PLURAL)
OURS = {LABEL_MANAGED_BY: FIELD_MANAGER}
# Pod events come in bursts (all containers of a unit flip at once); coalesce status writes.
STATUS_DEBOUNCE_SECONDS = 0.2
# Each unit's EC janitor runs from the operator's own image; the Helm chart sets this to it.
JANITOR_IMAGE = os.environ.get("EPD_OPERATOR_IMAGE", OPERATOR_IMAGE)

_connection: kopf.ConnectionInfo | None = None
_kube: Kube | None = None
RETRY_MAX_SECONDS = 60
# At most this many reconciles at once, as controller-runtime's MaxConcurrentReconciles: enough
# to keep the API client's 16 connections busy.
MAX_CONCURRENT_RECONCILES = 16
_queue: WorkQueue | None = None
_background: set[asyncio.Task[None]] = set()

# Janitor scraping (`epd-operator run --janitor-scrape-interval`; the interval comes in the memo).
DEFAULT_JANITOR_SCRAPE_INTERVAL = 30.0
# Short: an unreachable janitor (a pod just gone, kwok's fake pod IPs) must not hold up a round.
JANITOR_SCRAPE_TIMEOUT = aiohttp.ClientTimeout(total=3, connect=1)
JANITOR_SCRAPE_CONCURRENCY = 16
# Budget evictions as last scraped: (namespace, deployment) -> unit pod name -> count.
_evictions: dict[tuple[str, str], dict[str, int]] = {}
logger = logging.getLogger(__name__)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    global _connection
    _connection = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    return _connection


class _NoDiffBase(kopf.AnnotationsDiffBaseStorage):
    """The handlers are level-based (on.event, indexes): none reads kopf's old/new/diff, so skip
    its diff base, a deep copy of every watched object on every event."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # Events are for users: only warnings, not chatter.
    settings.watching.server_timeout = 300
    settings.persistence.diffbase_storage = _NoDiffBase()
    # A worker holds its object's last event until it exits: at 1,000 EPDDeployments (5,000
    # watched objects) kopf's default 5 s keeps most of them in memory at once.
    settings.queueing.idle_timeout = 0.5


def kube() -> Kube:
    global _kube
    assert _connection is not None, "kopf logs in before any handler runs"
    if _kube is None or _kube.connection is not _connection:
        if _kube is not None:  # kopf logged in again (credentials rotated): drop the old session
            _spawn(_kube.aclose())
        _kube = Kube(_connection)
    return _kube


@dataclasses.dataclass(frozen=True)
class Indexes:
    deployments: kopf.Index
    unit_sets: kopf.Index
    unit_services: kopf.Index
    unit_pods: kopf.Index


_indexes: Indexes | None = None
_janitor_scrape_interval = DEFAULT_JANITOR_SCRAPE_INTERVAL


@kopf.on.startup()
async def keep_indexes(memo: kopf.Memo, deployments: kopf.Index, unit_sets: kopf.Index, unit_services: kopf.Index,
                       unit_pods: kopf.Index, **_: Any) -> None:
    global _indexes, _janitor_scrape_interval
    _indexes = Indexes(deployments, unit_sets, unit_services, unit_pods)  # live: they fill as watching starts
    _janitor_scrape_interval = memo.get("janitor_scrape_interval", DEFAULT_JANITOR_SCRAPE_INTERVAL)


def queue() -> WorkQueue:
    """The reconcile queue; its workers (and the janitor scrape loop) start with the first event:
    a task inherits its creator's context, and kopf sets what posting Events (kopf.warn) needs
    for handlers, not for startup handlers."""
    global _queue
    if _queue is None:
        _queue = WorkQueue(_reconcile_key, workers=MAX_CONCURRENT_RECONCILES, max_backoff=RETRY_MAX_SECONDS)
        if _janitor_scrape_interval > 0:
            _spawn(_scrape_janitors_forever(_janitor_scrape_interval))
    return _queue


async def _reconcile_key(key: tuple[str, str]) -> None:
    assert _indexes is not None, "kept at startup"
    for body in _indexes.deployments.get(key, []):  # the latest state; none if deleted meanwhile
        try:
            await reconcile(body, _indexes.unit_sets, _indexes.unit_services, _indexes.unit_pods)
        except KubeError as error:
            if error.namespace_gone:
                return  # deleted with everything in it: nothing to converge
            kopf.warn(body, reason="ReconcileFailed", message=str(error))
            raise  # the queue retries it with backoff


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    for task in list(_background):
        task.cancel()
    await asyncio.gather(*_background, return_exceptions=True)
    if _queue is not None:
        await _queue.aclose()
    if _kube is not None:
        await _kube.aclose()


# Indexes keep only what status and reconcile read: every unit's whole pod (managedFields,
# container specs) and kubectl's last-applied copy of every spec would dominate memory at scale.
_POD_CONDITION_FIELDS = ("type", "status", "reason", "message")
_CONTAINER_FIELDS = ("name", "ready", "started")
_EPD_METADATA_FIELDS = ("name", "namespace", "uid", "generation", "labels", "deletionTimestamp")


def _summary(body: kopf.Body) -> dict[str, Any]:
    status = body.status

    def pick(items: Any, fields: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{f: item[f] for f in fields if f in item} for item in items or []]

    return {
        "name": body.metadata.name,
        "metadata": {"deletionTimestamp": body.metadata.get("deletionTimestamp")},
        "spec": {"nodeName": body.spec.get("nodeName")},
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": pick(status.get("conditions"), _POD_CONDITION_FIELDS),
            "initContainerStatuses": pick(status.get("initContainerStatuses"), _CONTAINER_FIELDS),
            "containerStatuses": pick(status.get("containerStatuses"), _CONTAINER_FIELDS),
        },
    }


# Indexers are coroutines: kopf runs plain functions in a thread pool, a thread hop per event.
@kopf.index("pods", labels=OURS)
async def unit_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): _summary(body)}


@kopf.index("statefulsets", labels=OURS)
async def unit_sets(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    status, spec, meta = body.status, body.spec, body.metadata
    rolled_out = (
        status.get("observedGeneration") == meta.get("generation")
        and status.get("updatedReplicas", 0) == spec.get("replicas", 1)
        and status.get("currentRevision") == status.get("updateRevision")
    )
    return {(namespace, labels[LABEL_DEPLOYMENT]): (meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH), rolled_out)}


@kopf.index("services", labels=OURS)
async def unit_services(namespace: str, labels: kopf.Labels, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): (meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH))}


@kopf.index(*EPD)
async def deployments(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    metadata = {f: body.metadata[f] for f in _EPD_METADATA_FIELDS if f in body.metadata}
    trimmed = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": metadata,
               "spec": body.get("spec", {}), "status": body.get("status", {})}
    return {(namespace, name): kopf.Body(trimmed)}


@dataclasses.dataclass
class Planned:
    spec: api.EPDDeploymentSpec
    plans: list[ModelPlan]
    digests: dict[tuple[str, str], str] | None = None  # (kind, name) -> hash of its desired state, once built


# Validated spec, rendered plans and children's hashes per (uid, generation, labels): every
# event of an EPDDeployment and of its children needs them, and they change only with the
# generation (the spec) or the labels (children carry the owner's). Bounded LRU.
PLAN_CACHE_SIZE = 4096
_plans: collections.OrderedDict[tuple[Any, ...], Planned | SpecError] = collections.OrderedDict()


def plan(body: kopf.Body) -> Planned:
    """validate() and render() of the body's spec, cached; raises SpecError for an invalid one."""
    metadata = body.metadata
    key = (metadata.uid, metadata.get("generation"), tuple(sorted((metadata.labels or {}).items())))
    if key in _plans:
        _plans.move_to_end(key)
    else:
        try:
            spec = validate(dict(body.spec))
            _plans[key] = Planned(spec, render(spec, namespace=metadata.namespace, name=metadata.name,
                                               uid=metadata.uid))
        except SpecError as error:
            _plans[key] = error
        if len(_plans) > PLAN_CACHE_SIZE:
            _plans.popitem(last=False)
    cached = _plans[key]
    if isinstance(cached, SpecError):
        raise SpecError(cached.errors)  # a fresh one: re-raising one object grows its traceback
    return cached


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# Handlers only queue the key of the EPDDeployment concerned; the queue's workers reconcile it
# from the indexes (level-based: which event it was does not matter).
@kopf.on.event(*EPD)
async def epd_changed(type: str, namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    if type == "DELETED":
        metrics.forget(namespace, name)
        queue().forget((namespace, name))
        return
    # A spec not reconciled yet goes before status refreshes of objects already converged.
    queue().add((namespace, name), urgent=body.status.get("observedGeneration") != body.metadata.get("generation"))


@kopf.on.event("pods", labels=OURS)
async def pod_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    queue().add_after((namespace, labels[LABEL_DEPLOYMENT]), STATUS_DEBOUNCE_SECONDS)


@kopf.on.event("statefulsets", labels=OURS)
@kopf.on.event("services", labels=OURS)
async def child_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
    # Also when one was deleted: the reconcile finds it missing from the index and re-creates it.
    queue().add((namespace, labels[LABEL_DEPLOYMENT]))


def _spawn(coroutine: Any) -> None:
    task = asyncio.create_task(coroutine)
    _background.add(task)  # keep a reference until done, or the task may be garbage-collected
    task.add_done_callback(_background.discard)


async def reconcile(body: kopf.Body, unit_sets: kopf.Index, unit_services: kopf.Index, unit_pods: kopf.Index) -> None:
    if body.metadata.get("deletionTimestamp"):
        return  # children carry ownerReferences: the garbage collector removes them
    namespace, name, generation = body.metadata.namespace, body.metadata.name, body.metadata.get("generation")
    started = time.perf_counter()
    try:
        planned = plan(body)
    except SpecError as error:
        await _report_invalid(body, error, generation)
        metrics.observe_reconcile("invalid", time.perf_counter() - started)
        return
    metrics.forget_invalid(namespace, name)
    try:
        await _converge(body, planned, unit_sets, unit_services)
        await _write_status(body, planned, unit_pods, unit_sets)
    except Exception:
        metrics.observe_reconcile("error", time.perf_counter() - started)
        raise
    metrics.observe_reconcile("success", time.perf_counter() - started)


async def _report_invalid(body: kopf.Body, error: SpecError, generation: int | None) -> None:
    namespace, name = body.metadata.namespace, body.metadata.name
    metrics.mark_invalid(namespace, name)
    status = invalid_status(error.errors, generation, dict(body.status), _now())
    if _same(status, dict(body.status)):
        return  # already reported for this generation
    kopf.warn(body, reason="InvalidSpec", message="; ".join(error.errors))
    await kube().patch_status(namespace, name, status)


def _desired(body: kopf.Body, planned: Planned) -> list[dict[str, Any]]:
    """The children, each annotated with the hash of its desired state (remembered in `planned`)."""
    children = desired_children(planned.spec, body.metadata.name, planned.plans, JANITOR_IMAGE)
    kopf.adopt(children, owner=body)
    for child in children:
        child["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = _hash(child)
    planned.digests = {_ref(c): c["metadata"]["annotations"][ANNOTATION_SPEC_HASH] for c in children}
    return children


def _ref(child: dict[str, Any]) -> tuple[str, str]:
    return child["kind"], child["metadata"]["name"]  # a unit's StatefulSet and Service share a name


async def _converge(body: kopf.Body, planned: Planned, unit_sets: kopf.Index, unit_services: kopf.Index) -> None:
    key = (body.metadata.namespace, body.metadata.name)
    existing = {
        **{("StatefulSet", name): digest for name, digest, _rolled_out in unit_sets.get(key, [])},
        **{("Service", name): digest for name, digest in unit_services.get(key, [])},
    }
    # Level-based, but cheap: children already carrying their exact desired state are left alone,
    # and are not even built again when the remembered hashes show that.
    if planned.digests is None or any(existing.get(ref) != d for ref, d in planned.digests.items()):
        children = _desired(body, planned)
        await asyncio.gather(*(kube().apply(c) for c in children if existing.get(_ref(c)) != planned.digests[_ref(c)]))
    assert planned.digests is not None  # set by _desired on the first pass
    for kind, name in existing.keys() - planned.digests.keys():  # a model removed from the spec
        await kube().delete("apps/v1" if kind == "StatefulSet" else "v1", kind, key[0], name)


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    return {k: v for k, v in new.items() if k != "kopf"} == {k: v for k, v in old.items() if k != "kopf"}


async def _write_status(body: kopf.Body, planned: Planned, unit_pods: kopf.Index, unit_sets: kopf.Index) -> None:
    namespace, name = body.metadata.namespace, body.metadata.name
    spec, plans = planned.spec, planned.plans
    pods = {p["name"]: p for p in unit_pods.get((namespace, name), [])}
    sets = list(unit_sets.get((namespace, name), []))
    rolled_out = len(sets) >= len(plans) and all(done for _n, _d, done in sets)
    previous = dict(body.status)
    status = compute_status(
        deployment=name, spec=spec, plans=plans, pods=pods, rolled_out=rolled_out,
        generation=body.metadata.get("generation"), previous=previous, now=_now(),
        evictions=_evictions.get((namespace, name)),
    )
    metrics.set_ready_units(namespace, name, sum(m["readyUnits"] for m in status["models"]))
    if _same(status, previous):
        return
    budget = _condition(status, "ECBudgetSufficient")
    if budget["status"] == "False" and _condition(previous, "ECBudgetSufficient").get("message") != budget["message"]:
        kopf.warn(body, reason="ECBudgetTooSmall", message=budget["message"])
    await kube().patch_status(namespace, name, status)


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


@kopf.on.probe(id="deployments")
def count_deployments(deployments: kopf.Index, **_: Any) -> int:
    return len(deployments)


# --------------------------------------------------------------------------- janitor scraping
# The janitor has no API access, so the operator reads its metrics: see docs/ec-storage.md.


async def _scrape_janitors_forever(interval: float) -> None:
    assert _indexes is not None, "kept at startup"
    async with aiohttp.ClientSession(timeout=JANITOR_SCRAPE_TIMEOUT) as session:
        while True:
            try:
                await scrape_janitors(session, _indexes.deployments, _indexes.unit_pods)
            except Exception:  # a bug in one round must not end the reporting for good
                logger.exception("scraping the EC janitors failed")
            await asyncio.sleep(interval)


def _janitor_ip(pod: dict[str, Any]) -> str | None:
    """Where to scrape the unit's janitor: only a Running pod that has one can answer."""
    status = pod.get("status", {})
    has_janitor = any(c.get("name") == "janitor" for c in status.get("containerStatuses") or [])
    return status.get("podIP") if status.get("phase") == "Running" and has_janitor else None


def _reported(deployments: kopf.Index, key: tuple[str, str], unit: str) -> int | None:
    """The count the status shows for `unit`: what this or an earlier operator process reported."""
    for body in deployments.get(key, []):
        for model in body.status.get("models") or []:
            for status in model.get("units") or []:
                if status.get("name") == unit:
                    return status.get("ecEvictions")
    return None


async def scrape_janitors(session: aiohttp.ClientSession, deployments: kopf.Index, unit_pods: kopf.Index,
                          *, port: int = JANITOR_METRICS_PORT) -> None:
    """One round: scrape every running unit's janitor, warn where its budget evictions grew, and
    rewrite the status of deployments whose counts changed. Janitors that do not answer keep
    their last count; units no longer running are forgotten."""
    targets = {
        (key, pod["name"]): ip for key, pods in unit_pods.items() for pod in pods if (ip := _janitor_ip(pod))
    }
    limit = asyncio.Semaphore(JANITOR_SCRAPE_CONCURRENCY)

    async def scrape(ip: str) -> JanitorMetrics | None:
        async with limit:
            try:
                async with session.get(f"http://{ip}:{port}/metrics") as response:
                    response.raise_for_status()
                    return parse_metrics(await response.text())
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                logger.debug(f"janitor at {ip} not scraped: {error!r}")  # normal while pods come and go
                return None

    results = await asyncio.gather(*(scrape(ip) for ip in targets.values()))
    changed = set()
    for (key, unit), current in zip(targets, results, strict=True):
        if current is None:
            continue
        counts = _evictions.setdefault(key, {})
        previous = counts[unit] if unit in counts else _reported(deployments, key, unit)
        if message := eviction_report(unit, previous, current):
            for body in deployments.get(key, []):
                kopf.warn(body, reason="ECEvicted", message=message)
        if counts.get(unit) != current.budget_evictions:
            counts[unit] = current.budget_evictions
            changed.add(key)
    for key, counts in list(_evictions.items()):
        gone = [unit for unit in counts if (key, unit) not in targets]
        for unit in gone:
            del counts[unit]
        if gone:
            changed.add(key)
        if not counts:
            del _evictions[key]
    for key in changed:
        queue().add(key)
