"""kopf registrations, nothing else: indexes of what the operator watches, and handlers that
only queue the key of the EPDDeployment concerned. The Reconciler (in kopf's memo, made by
runner.py) does the work.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from . import api
from .managedfields import owned_by_update
from .reconciler import IndexedDeployment, Indexes
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, LABEL_DEPLOYMENT, LABEL_MANAGED_BY, is_headless
from .status import PodSummary, StatefulSetSummary

EPD = (api.GROUP, api.VERSION, api.PLURAL)
OURS = {LABEL_MANAGED_BY: FIELD_MANAGER}


@kopf.on.login()
def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    connection = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if connection is not None:
        memo.reconciler.login(connection)
    return connection


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


@kopf.on.startup()
async def keep_indexes(
    memo: kopf.Memo,
    deployments: kopf.Index,
    unit_sets: kopf.Index,
    unit_services: kopf.Index,
    unit_pods: kopf.Index,
    unit_budgets: kopf.Index,
    **_: Any,
) -> None:
    memo.reconciler.watch(Indexes(deployments, unit_sets, unit_services, unit_pods, unit_budgets))


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.reconciler.aclose()


# Indexes keep only what status and reconcile read: every unit's whole pod (managedFields,
# container specs) and kubectl's last-applied copy of every spec would dominate memory at scale.
# Indexers are coroutines: kopf runs plain functions in a thread pool, a thread hop per event.
@kopf.index("pods", labels=OURS)
async def unit_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[LABEL_DEPLOYMENT]): PodSummary.of(body)}


@kopf.index("statefulsets", labels=OURS)
async def unit_sets(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    status, spec, meta = body.status, body.spec, body.metadata
    summary = StatefulSetSummary(
        name=meta.name,
        spec_hash=meta.annotations.get(ANNOTATION_SPEC_HASH),
        observed=status.get("observedGeneration") == meta.get("generation"),
        replicas=spec.get("replicas", 1),
        updated_replicas=status.get("updatedReplicas", 0),
        current_revision=status.get("currentRevision"),
        update_revision=status.get("updateRevision"),
        owned_by_update=_owned_by_update(meta),
    )
    return {(namespace, labels[LABEL_DEPLOYMENT]): summary}


@kopf.index("services", labels=OURS)
async def unit_services(
    namespace: str, labels: kopf.Labels, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {
        (namespace, labels[LABEL_DEPLOYMENT]): (
            meta.name,
            meta.annotations.get(ANNOTATION_SPEC_HASH),
            is_headless(body),
            _owned_by_update(meta),
        )
    }


@kopf.index("policy", "v1", "poddisruptionbudgets", labels=OURS)
async def unit_budgets(namespace: str, labels: kopf.Labels, meta: kopf.Meta, **_: Any) -> dict[Any, Any]:
    return {
        (namespace, labels[LABEL_DEPLOYMENT]): (
            meta.name,
            meta.annotations.get(ANNOTATION_SPEC_HASH),
            _owned_by_update(meta),
        )
    }


def _owned_by_update(meta: kopf.Meta) -> bool:
    return owned_by_update(meta.get("managedFields") or [], FIELD_MANAGER)


@kopf.index(*EPD)
async def deployments(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, name): IndexedDeployment.of(body)}


@kopf.on.event(*EPD)
async def epd_changed(memo: kopf.Memo, type: str, namespace: str, name: str, body: kopf.Body, **_: Any) -> None:
    if type == "DELETED":
        memo.reconciler.forget((namespace, name))
        return
    if memo.reconciler.echoes_status(body):
        return  # the echo of our own status patch
    # A spec not reconciled yet goes before status refreshes of objects already converged.
    memo.reconciler.enqueue(
        (namespace, name), urgent=body.status.get("observedGeneration") != body.metadata.get("generation")
    )


@kopf.on.event("pods", labels=OURS)
async def pod_changed(memo: kopf.Memo, namespace: str, labels: kopf.Labels, **_: Any) -> None:
    memo.reconciler.enqueue_after(
        (namespace, labels[LABEL_DEPLOYMENT]), memo.reconciler.settings.status_debounce_seconds
    )


# Children: a deleted one, or one not at the desired state of its owner's current generation,
# queues a reconcile (which re-applies it); one that only confirms what was applied does not.
@kopf.on.event("statefulsets", labels=OURS)
async def set_changed(
    memo: kopf.Memo, type: str | None, namespace: str, labels: kopf.Labels, meta: kopf.Meta, **_: Any
) -> None:
    key = (namespace, labels[LABEL_DEPLOYMENT])
    memo.reconciler.observed(key, "StatefulSet", meta.name)
    if type != "DELETED" and memo.reconciler.confirms(
        key, "StatefulSet", meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH)
    ):
        # The status reads its rollout fields: a refresh, coalesced with the pods' events.
        memo.reconciler.enqueue_after(key, memo.reconciler.settings.status_debounce_seconds)
    else:
        memo.reconciler.enqueue(key)


@kopf.on.event("services", labels=OURS)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=OURS)
async def child_changed(
    memo: kopf.Memo, type: str | None, namespace: str, labels: kopf.Labels, body: kopf.Body, meta: kopf.Meta, **_: Any
) -> None:
    key = (namespace, labels[LABEL_DEPLOYMENT])
    memo.reconciler.observed(key, body["kind"], meta.name)
    # The status reads neither Services nor budgets: a confirming event has nothing to refresh.
    if type == "DELETED" or not memo.reconciler.confirms(
        key, body["kind"], meta.name, meta.annotations.get(ANNOTATION_SPEC_HASH)
    ):
        memo.reconciler.enqueue(key)


@kopf.on.probe(id="deployments")
def count_deployments(deployments: kopf.Index, **_: Any) -> int:
    return len(deployments)
