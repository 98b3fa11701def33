"""kopf handlers: thin. Read, call the pure core, apply by server-side apply, write status.

Reconcile is level-based: every EPDDeployment event (and every change of its children) leads
to the same function computing the whole desired state; nothing depends on seeing a particular
event, so a restarted operator converges without duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from .render import render
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

EPD = (api.GROUP, api.VERSION, api.PLURAL)
OURS = {LABEL_MANAGED_BY: FIELD_MANAGER}
# Pod events come in bursts (all containers of a unit flip at once); coalesce status writes.
STATUS_DEBOUNCE_SECONDS = 0.2
# Each unit's EC janitor runs from the operator's own image; the Helm chart sets this to it.
JANITOR_IMAGE = os.environ.get("EPD_OPERATOR_IMAGE", OPERATOR_IMAGE)

_connection: kopf.ConnectionInfo | None = None
_kube: Kube | None = None
RETRY_MAX_SECONDS = 60
_pending: dict[tuple[str, str], asyncio.Task[None]] = {}
_failures: dict[tuple[str, str], int] = {}
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


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.level = logging.WARNING  # Events are for users: only warnings, not chatter.
    settings.watching.server_timeout = 300


def kube() -> Kube:
    global _kube
    if _kube is None:
        assert _connection is not None, "kopf logs in before any handler runs"
        _kube = Kube(_connection)
    return _kube


@kopf.on.startup()
async def start_janitor_scrapes(memo: kopf.Memo, deployments: kopf.Index, unit_pods: kopf.Index,
                                unit_sets: kopf.Index, **_: Any) -> None:
    interval = memo.get("janitor_scrape_interval", DEFAULT_JANITOR_SCRAPE_INTERVAL)
    if interval > 0:
        # One operator-wide loop; the indexes are live objects that fill once watching starts.
        memo["janitor_scrapes"] = asyncio.create_task(
            _scrape_janitors_forever(interval, deployments, unit_pods, unit_sets))


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    scrapes = memo.get("janitor_scrapes")
    if scrapes is not None:
        scrapes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scrapes
    if _kube is not None:
        await _kube.aclose()


def _summary(body: kopf.Body) -> dict[str, Any]:
    return {
        "name": body.metadata.name,
        "metadata": {"deletionTimestamp": body.metadata.get("deletionTimestamp")},
        "spec": {"nodeName": body.spec.get("nodeName")},
        "status": dict(body.status),
    }


@kopf.index("pods", labels=OURS)
def unit_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): _summary(body)}


@kopf.index("statefulsets", labels=OURS)
def unit_sets(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    status, spec, meta = body.status, body.spec, body.metadata
    rolled_out = (
        status.get("observedGeneration") == meta.get("generation")
        and status.get("updatedReplicas", 0) == spec.get("replicas", 1)
        and status.get("currentRevision") == status.get("updateRevision")
    )
    return {(namespace, labels[LABEL_DEPLOYMENT]): (meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH), rolled_out)}


@kopf.index("services", labels=OURS)
def unit_services(namespace: str, labels: kopf.Labels, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): (meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH))}


@kopf.index(*EPD)
def deployments(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): body}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@kopf.on.event(*EPD)
async def epd_changed(
    type: str, body: kopf.Body, logger: logging.Logger, deployments: kopf.Index, unit_sets: kopf.Index,
    unit_services: kopf.Index, unit_pods: kopf.Index, **_: Any
) -> None:
    key = (body.metadata.namespace, body.metadata.name)
    if type == "DELETED":
        metrics.forget(*key)
        return
    try:
        await reconcile(body, unit_sets, unit_services, unit_pods)
        _failures.pop(key, None)
    except Exception as error:  # event handlers are not retried by kopf: retry ourselves
        failures = _failures[key] = _failures.get(key, 0) + 1
        delay = min(RETRY_MAX_SECONDS, 2**failures)
        logger.warning(f"reconcile failed ({error}); retrying in {delay}s")
        asyncio.get_running_loop().call_later(
            delay, lambda: _spawn(_retry(key, deployments, unit_sets, unit_services, unit_pods, logger))
        )


async def _retry(key: tuple[str, str], deployments: kopf.Index, unit_sets: kopf.Index, unit_services: kopf.Index,
                 unit_pods: kopf.Index, logger: logging.Logger) -> None:
    for body in deployments.get(key, []):  # the latest body; gone if deleted meanwhile
        await epd_changed(type="RETRY", body=body, logger=logger, deployments=deployments, unit_sets=unit_sets,
                          unit_services=unit_services, unit_pods=unit_pods)


def _spawn(coroutine: Any) -> None:
    task = asyncio.create_task(coroutine)
    _background.add(task)  # keep a reference until done, or the task may be garbage-collected
    task.add_done_callback(_background.discard)


async def reconcile(body: kopf.Body, unit_sets: kopf.Index, unit_services: kopf.Index, unit_pods: kopf.Index,
                    *, reapply: bool = False) -> None:
    if body.metadata.get("deletionTimestamp"):
        return  # children carry ownerReferences: the garbage collector removes them
    namespace, name, generation = body.metadata.namespace, body.metadata.name, body.metadata.get("generation")
    started = time.perf_counter()
    try:
        spec = validate(dict(body.spec))
        plans = render(spec, namespace=namespace, name=name, uid=body.metadata.uid)
    except SpecError as error:
        await _report_invalid(body, error, generation)
        metrics.observe_reconcile("invalid", time.perf_counter() - started)
        return
    metrics.forget_invalid(namespace, name)
    try:
        await _converge(body, spec, plans, unit_sets, unit_services, reapply=reapply)
        await _write_status(namespace, name, body, unit_pods, unit_sets)
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


async def _converge(body: kopf.Body, spec: api.EPDDeploymentSpec, plans: list[Any],
                    unit_sets: kopf.Index, unit_services: kopf.Index, *, reapply: bool) -> None:
    key = (body.metadata.namespace, body.metadata.name)
    children = desired_children(spec, body.metadata.name, plans, JANITOR_IMAGE)
    kopf.adopt(children, owner=body)
    existing = {name: digest for name, digest, *_ in [*unit_sets.get(key, []), *unit_services.get(key, [])]}
    applies = []
    for child in children:
        digest = _hash(child)
        child["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = digest
        # Level-based, but cheap: a child already carrying this exact desired state is left alone.
        if reapply or existing.get(child["metadata"]["name"]) != digest:
            applies.append(kube().apply(child))
    await asyncio.gather(*applies)
    wanted = {c["metadata"]["name"] for c in children}
    for name, *_ in unit_sets.get(key, []):
        if name not in wanted:  # a model removed from the spec
            await kube().delete("apps/v1", "StatefulSet", key[0], name)
    for name, _digest in unit_services.get(key, []):
        if name not in wanted:
            await kube().delete("v1", "Service", key[0], name)


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    return {k: v for k, v in new.items() if k != "kopf"} == {k: v for k, v in old.items() if k != "kopf"}


async def _write_status(namespace: str, name: str, body: kopf.Body, unit_pods: kopf.Index, unit_sets: kopf.Index) -> None:
    try:
        spec = validate(dict(body.spec))
    except SpecError:
        return  # reported by reconcile; pods of an earlier valid spec do not change that verdict
    plans = render(spec, namespace=namespace, name=name, uid=body.metadata.uid)
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


def _schedule_status(namespace: str, deployment: str, deployments: kopf.Index, unit_pods: kopf.Index,
                     unit_sets: kopf.Index) -> None:
    key = (namespace, deployment)
    if key in _pending and not _pending[key].done():
        return

    async def write() -> None:
        await asyncio.sleep(STATUS_DEBOUNCE_SECONDS)
        for body in deployments.get(key, []):
            if not body.metadata.get("deletionTimestamp"):
                await _write_status(namespace, deployment, body, unit_pods, unit_sets)

    _pending[key] = asyncio.create_task(write())
    _pending[key].add_done_callback(lambda _t: _pending.pop(key, None) if _pending.get(key) is _t else None)


@kopf.on.event("pods", labels=OURS)
async def pod_changed(namespace: str, labels: kopf.Labels, deployments: kopf.Index, unit_pods: kopf.Index,
                unit_sets: kopf.Index, **_: Any) -> None:
    _schedule_status(namespace, labels[LABEL_DEPLOYMENT], deployments, unit_pods, unit_sets)


@kopf.on.event("statefulsets", labels=OURS)
@kopf.on.event("services", labels=OURS)
async def child_changed(type: str, namespace: str, labels: kopf.Labels, deployments: kopf.Index,
                        unit_pods: kopf.Index, unit_sets: kopf.Index, unit_services: kopf.Index, **_: Any) -> None:
    deployment = labels[LABEL_DEPLOYMENT]
    if type == "DELETED":
        # Someone deleted a child: converge the owner again (it re-creates what is missing).
        for body in deployments.get((namespace, deployment), []):
            try:
                await reconcile(body, unit_sets, unit_services, unit_pods, reapply=True)
            except KubeError as error:
                if not error.namespace_gone:
                    raise
                # The namespace is being deleted with everything in it: nothing to restore.
        return
    _schedule_status(namespace, deployment, deployments, unit_pods, unit_sets)


@kopf.on.probe(id="deployments")
def count_deployments(deployments: kopf.Index, **_: Any) -> int:
    return len(deployments)


# --------------------------------------------------------------------------- janitor scraping
# The janitor has no API access, so the operator reads its metrics: see docs/ec-storage.md.


async def _scrape_janitors_forever(interval: float, deployments: kopf.Index, unit_pods: kopf.Index,
                                   unit_sets: kopf.Index) -> None:
    async with aiohttp.ClientSession(timeout=JANITOR_SCRAPE_TIMEOUT) as session:
        while True:
            try:
                await scrape_janitors(session, deployments, unit_pods, unit_sets)
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
                          unit_sets: kopf.Index, *, port: int = JANITOR_METRICS_PORT) -> None:
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
    for namespace, deployment in changed:
        _schedule_status(namespace, deployment, deployments, unit_pods, unit_sets)
