"""kopf registrations: the indexes of what the operator watches, handlers that only queue the key
of the EPDDeployment concerned, and the event filters (controller-runtime's predicates) that
decide when an event needs no reconcile. The Reconciler (in kopf's memo, made by runner.py) does
the work.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from . import api
from .children import OPTIONAL_CRDS, OPTIONAL_KINDS
from .indexes import (
    AccessSummary,
    BudgetSummary,
    DeploymentSummary,
    GatewaySummary,
    Indexes,
    InferencePoolSummary,
    Key,
    NetworkPolicySummary,
    PodSummary,
    Ref,
    ScaledObjectSummary,
    ServiceSummary,
    StatefulSetSummary,
    owner_key,
)
from .reconciler import Reconciler
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, LABEL_MANAGED_BY

EPD = (api.GROUP, api.VERSION, api.PLURAL)
OURS = {LABEL_MANAGED_BY: FIELD_MANAGER}
# What the operator watches besides its EPDDeployments: its children and their pods, all its
# own by label.
STATEFUL_SETS = ("apps", "v1", "statefulsets")
SERVICES = ("v1", "services")
BUDGETS = ("policy", "v1", "poddisruptionbudgets")
NETWORK_POLICIES = ("networking.k8s.io", "v1", "networkpolicies")
# The EPD gateway (spec.gateway): its Deployments, and the ServiceAccount, Role and RoleBinding
# they share.
DEPLOYMENTS = ("apps", "v1", "deployments")
SERVICE_ACCOUNTS = ("v1", "serviceaccounts")
ROLES = ("rbac.authorization.k8s.io", "v1", "roles")
ROLE_BINDINGS = ("rbac.authorization.k8s.io", "v1", "rolebindings")
# spec.gateway.inferencePool: another project's kind, watched once its CRD is served (kopf
# follows CRDs appearing).
INFERENCE_POOLS = (api.INFERENCE_POOL_GROUP, api.INFERENCE_POOL_VERSION, "inferencepools")
# spec.autoscaling: KEDA's, watched once its CRD is served.
SCALED_OBJECTS = (api.KEDA_GROUP, api.KEDA_VERSION, "scaledobjects")
PODS = ("v1", "pods")
OWN_KINDS = (
    STATEFUL_SETS,
    SERVICES,
    BUDGETS,
    NETWORK_POLICIES,
    DEPLOYMENTS,
    SERVICE_ACCOUNTS,
    ROLES,
    ROLE_BINDINGS,
    INFERENCE_POOLS,
    SCALED_OBJECTS,
    PODS,
)


# ---------------------------------------------------------------------------- event filters


def echoes_status(reconciler: Reconciler, body: kopf.Body) -> bool:
    """An EPDDeployment event that only brings back the status this operator last wrote, for a
    generation and labels already planned: a reconcile would find nothing to do. (A status
    edited by someone else, a new generation or new labels is not an echo.)"""
    key = (body.metadata.namespace or "", body.metadata.name or "")
    status = dict(body.get("status") or {})
    return (
        status.get("observedGeneration") == body.metadata.get("generation")
        and reconciler.plans.checked(body.metadata) is not None
        and reconciler.status.echoes(key, status)
    )


def confirms(reconciler: Reconciler, key: Key, ref: Ref, digest: str | None) -> bool:
    """A child at the desired state planned for its owner's current generation and labels (an
    event about it only confirms what was applied); False while that is not planned yet."""
    owner = reconciler.indexes.deployment(key)
    checked = reconciler.plans.checked(owner.metadata) if owner is not None else None
    return checked is not None and digest is not None and checked.digests.get(ref) == digest


# ---------------------------------------------------------------------------- wiring


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
    # kopf filters handlers' labels client-side, after decoding each object. On a cluster shared
    # with other teams that is every pod of the cluster: the API server filters instead (as a
    # controller-runtime cache selects ByObject).
    own = ",".join(f"{k}={v}" for k, v in OURS.items())
    for kind in OWN_KINDS:
        settings.watching.label_selectors[kind] = own
    # A worker holds its object's last event until it exits: at 1,000 EPDDeployments (5,000
    # watched objects) kopf's default 5 s keeps most of them in memory at once.
    settings.queueing.idle_timeout = 0.5


@kopf.on.startup()
async def keep_indexes(memo: kopf.Memo, **indexes: Any) -> None:
    # kopf passes every index by its handler's name (below) among the keyword arguments.
    memo.reconciler.watch(
        Indexes(
            deployments=indexes["deployments"],
            stateful_sets=indexes["stateful_sets"],
            services=indexes["services"],
            budgets=indexes["budgets"],
            pods=indexes["pods"],
            network_policies=indexes["network_policies"],
            gateways=indexes["gateways"],
            service_accounts=indexes["service_accounts"],
            roles=indexes["roles"],
            role_bindings=indexes["role_bindings"],
            inference_pools=indexes["inference_pools"],
            scaled_objects=indexes["scaled_objects"],
        )
    )


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.reconciler.aclose()


# Indexers are coroutines: kopf runs plain functions in a thread pool, a thread hop per event.
@kopf.index(*EPD)
async def deployments(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Key, DeploymentSummary]:
    return {(namespace or "", name): DeploymentSummary.of(body)}


@kopf.index(*STATEFUL_SETS, labels=OURS)
async def stateful_sets(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, StatefulSetSummary]:
    return {owner_key(namespace, labels): StatefulSetSummary.of(body)}


@kopf.index(*SERVICES, labels=OURS)
async def services(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, ServiceSummary]:
    return {owner_key(namespace, labels): ServiceSummary.of(body)}


@kopf.index(*BUDGETS, labels=OURS)
async def budgets(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, BudgetSummary]:
    return {owner_key(namespace, labels): BudgetSummary.of(body)}


@kopf.index(*NETWORK_POLICIES, labels=OURS)
async def network_policies(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, NetworkPolicySummary]:
    return {owner_key(namespace, labels): NetworkPolicySummary.of(body)}


@kopf.index(*DEPLOYMENTS, labels=OURS)
async def gateways(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, GatewaySummary]:
    return {owner_key(namespace, labels): GatewaySummary.of(body)}


@kopf.index(*SERVICE_ACCOUNTS, labels=OURS)
async def service_accounts(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, AccessSummary]:
    return {owner_key(namespace, labels): AccessSummary.of(body)}


@kopf.index(*ROLES, labels=OURS)
async def roles(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, AccessSummary]:
    return {owner_key(namespace, labels): AccessSummary.of(body)}


@kopf.index(*ROLE_BINDINGS, labels=OURS)
async def role_bindings(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, AccessSummary]:
    return {owner_key(namespace, labels): AccessSummary.of(body)}


@kopf.index(*INFERENCE_POOLS, labels=OURS)
async def inference_pools(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, InferencePoolSummary]:
    return {owner_key(namespace, labels): InferencePoolSummary.of(body)}


@kopf.index(*SCALED_OBJECTS, labels=OURS)
async def scaled_objects(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Key, ScaledObjectSummary]:
    return {owner_key(namespace, labels): ScaledObjectSummary.of(body)}


@kopf.index(*PODS, labels=OURS)
async def pods(namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> dict[Key, PodSummary]:
    return {owner_key(namespace, labels): PodSummary.of(body)}


@kopf.on.event(*EPD)
async def epd_changed(memo: kopf.Memo, type: str, namespace: str | None, name: str, body: kopf.Body, **_: Any) -> None:
    key = (namespace or "", name)
    if type == "DELETED":
        memo.reconciler.forget(key)
        return
    if echoes_status(memo.reconciler, body):
        return  # the echo of our own status patch
    # A spec not reconciled yet goes before status refreshes of objects already converged.
    memo.reconciler.enqueue(key, urgent=body.status.get("observedGeneration") != body.metadata.get("generation"))


@kopf.on.event(*PODS, labels=OURS)
async def pod_changed(memo: kopf.Memo, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    memo.reconciler.enqueue_after(owner_key(namespace, labels), memo.reconciler.settings.status_debounce_seconds)


# Children: a deleted one, or one not at the desired state of its owner's current generation,
# queues a reconcile (which re-applies it); one that only confirms what was applied does not.
@kopf.on.event(*STATEFUL_SETS, labels=OURS)
async def set_changed(
    memo: kopf.Memo, type: str, namespace: str | None, labels: Mapping[str, str], meta: kopf.Meta, **_: Any
) -> None:
    key, ref = owner_key(namespace, labels), ("StatefulSet", meta.name or "")
    memo.reconciler.expectations.observed(key, ref)
    if type != "DELETED" and confirms(memo.reconciler, key, ref, meta.annotations.get(ANNOTATION_SPEC_HASH)):
        # The status reads its rollout fields: a refresh, coalesced with the pods' events.
        memo.reconciler.enqueue_after(key, memo.reconciler.settings.status_debounce_seconds)
    else:
        memo.reconciler.enqueue(key)


@kopf.on.event(*SERVICES, labels=OURS)
@kopf.on.event(*BUDGETS, labels=OURS)
@kopf.on.event(*NETWORK_POLICIES, labels=OURS)
@kopf.on.event(*DEPLOYMENTS, labels=OURS)
@kopf.on.event(*SERVICE_ACCOUNTS, labels=OURS)
@kopf.on.event(*ROLES, labels=OURS)
@kopf.on.event(*ROLE_BINDINGS, labels=OURS)
@kopf.on.event(*INFERENCE_POOLS, labels=OURS)
@kopf.on.event(*SCALED_OBJECTS, labels=OURS)
async def child_changed(
    memo: kopf.Memo,
    type: str,
    namespace: str | None,
    labels: Mapping[str, str],
    body: kopf.Body,
    meta: kopf.Meta,
    **_: Any,
) -> None:
    key, ref = owner_key(namespace, labels), (body["kind"], meta.name or "")
    memo.reconciler.expectations.observed(key, ref)
    # The status reads none of these kinds: a confirming event has nothing to refresh.
    if type == "DELETED" or not confirms(memo.reconciler, key, ref, meta.annotations.get(ANNOTATION_SPEC_HASH)):
        memo.reconciler.enqueue(key)


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions", when=lambda name, **_: name in OPTIONAL_CRDS)
async def optional_crd_changed(memo: kopf.Memo, type: str, name: str, **_: Any) -> None:
    """Another project's CRD installed (the InferencePool's, KEDA's ScaledObject's): the
    EPDDeployments waiting for it (their status says so) are reconciled now, not at their next
    backoff."""
    if type == "DELETED":
        return
    reason = OPTIONAL_KINDS[OPTIONAL_CRDS[name]][0]
    for key, found in memo.reconciler.indexes.deployments.items():
        if any(reason in summary.status_json for summary in found):
            memo.reconciler.enqueue(key)


@kopf.on.probe(id="deployments")
def count_deployments(**kwargs: Any) -> int:
    return len(kwargs["deployments"])


@kopf.on.probe(id="workers")
def workers_alive(memo: kopf.Memo, **_: Any) -> int:
    """/healthz fails (kopf answers 500) while reconcile workers are gone: nothing would converge."""
    running, wanted = memo.reconciler.workers()
    if running < wanted:
        raise kopf.PermanentError(f"{wanted - running} of {wanted} reconcile workers are gone")
    return running
