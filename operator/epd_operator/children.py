"""The child writer: an EPDDeployment's children brought to their desired state over kube.py.

A child neither the indexes nor the expectations show is created with a POST, the API server's
cheapest write (a StatefulSet or budget by POST costs it less than half a server-side apply
under load: docs/performance.md); one that exists is changed with server-side apply
(`fieldManager: epd-operator`, forced), after its POST's Update entry of managedFields was taken
over (managedfields.py) unless the index shows that done. Children already carrying their
desired state's hash are not written, nor even built; children of a removed model are deleted.

Only objects the EPDDeployment controls (their controller ownerReference is it) are changed or
deleted: an object of the same name that someone else made is left exactly as it is, and the
refusal is said in the status (reason ChildConflict) until it is gone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from . import api
from .expectations import Expectations
from .indexes import ChildSummary, Key, Ref, ServiceSummary, controller_uid
from .kube import KubeError, KubeSession
from .managedfields import upgrade_to_apply
from .plans import Planned, ref
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, is_headless


class WriteRefused(Exception):
    """A child the operator could not write for this generation: the status says `reason` and
    the message until a write goes through, and the reconcile is retried with backoff."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


# Children of kinds other projects define, whose CRDs a cluster may lack: the reason the status
# gives, and what to do, while the kind is not served.
OPTIONAL_KINDS = {
    "InferencePool": (
        "InferencePoolCRDMissing",
        (
            "spec.gateway.inferencePool.enabled needs the Gateway API Inference Extension's InferencePool CRD "
            "(inference.networking.k8s.io/v1), which this cluster does not serve: install it (kubectl apply -f "
            "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/v1.6.2/manifests.yaml, "
            "or the operator's chart with --set inferencePoolCRD.install=true), or set "
            "spec.gateway.inferencePool.enabled to false; the other children are applied"
        ),
    ),
    "ScaledObject": (
        "KEDANotInstalled",
        (
            "spec.autoscaling.units and spec.models[].encoderAutoscaling need KEDA (its ScaledObject CRD, "
            "keda.sh/v1alpha1), which this cluster does not serve: install KEDA 2.21 or later (helm install keda "
            "kedacore/keda -n keda --create-namespace, or its release manifests), or remove the autoscalers; the other "
            "children are applied, and the replica counts stay as they are"
        ),
    ),
}
# The CRDs whose installation should reconcile the EPDDeployments waiting for them, by name.
OPTIONAL_CRDS = {
    f"inferencepools.{api.INFERENCE_POOL_GROUP}": "InferencePool",
    f"scaledobjects.{api.KEDA_GROUP}": "ScaledObject",
}


def unserved(kind: str) -> WriteRefused:
    """A child of a kind another project defines, whose CRD this cluster lacks."""
    reason, message = OPTIONAL_KINDS.get(
        kind, ("ApplyFailed", f"the API server serves no {kind}: is its CRD installed?")
    )
    return WriteRefused(reason, message)


def conflict(kind: str, namespace: str, name: str, owner: str) -> WriteRefused:
    return WriteRefused(
        "ChildConflict",
        f"{kind} {namespace}/{name} exists and is not controlled by EPDDeployment {owner}: it is left as it is; "
        "delete or rename it, or rename the EPDDeployment or the model",
    )


class ChildWriter:
    """`requeue_after(key, seconds)` asks for another reconcile when an expectation lapses."""

    def __init__(
        self, session: KubeSession, expectations: Expectations, requeue_after: Callable[[Key, float], None]
    ) -> None:
        self._session = session
        self._expectations = expectations
        self._requeue_after = requeue_after

    async def converge(
        self,
        key: Key,
        owner_uid: str,
        planned: Planned,
        build: Callable[[], list[dict[str, Any]]],
        indexed: list[ChildSummary],
    ) -> bool:
        """Write the children not at their desired state (`build` makes them all, called only
        when one is stale) and delete those no model asks for; `indexed`: the children the
        watches show. True if it wrote anything. Raises WriteRefused for the first child that
        could not be written, once every other one was."""
        unseen, lapses_in = self._expectations.unseen(key)
        if lapses_in is not None:
            self._requeue_after(key, lapses_in)
        ours = [c for c in indexed if c.controller_uid == owner_uid]
        foreign = {c.ref for c in indexed if c.controller_uid != owner_uid} - unseen.keys()
        existing = {**unseen, **{c.ref: c.spec_hash for c in ours}}
        # Taken over by an apply already, as the watch shows it (one created again since may not be).
        applied = {c.ref for c in ours if not c.owned_by_update} - unseen.keys()
        headless = {c.name: c.headless for c in ours if isinstance(c, ServiceSummary)}
        stale = {r for r, digest in planned.digests.items() if existing.get(r) != digest}
        refusals: list[BaseException] = []
        if stale:
            writes = [
                self._write(key, owner_uid, c, existing.keys(), applied, headless, foreign)
                for c in build()
                if ref(c) in stale
            ]
            refusals += [r for r in await asyncio.gather(*writes, return_exceptions=True) if r is not None]
        removed = existing.keys() - planned.digests.keys()
        for kind, name in removed:
            await self._session.client.delete(kind, key[0], name)
        for refusal in refusals:
            if isinstance(refusal, KubeError) and not refusal.namespace_gone:
                raise WriteRefused("ApplyFailed", f"the spec is not applied: {refusal}") from refusal
            raise refusal
        return bool(stale or removed)

    async def _write(
        self,
        key: Key,
        owner_uid: str,
        child: dict[str, Any],
        existing: AbstractSet[Ref],
        applied: AbstractSet[Ref],
        headless: Mapping[str, bool],
        foreign: AbstractSet[Ref],
    ) -> None:
        try:
            await self._write_child(key, owner_uid, child, existing, applied, headless, foreign)
        except KubeError as error:
            if error.kind_unserved:
                raise unserved(child["kind"]) from error
            raise

    async def _write_child(
        self,
        key: Key,
        owner_uid: str,
        child: dict[str, Any],
        existing: AbstractSet[Ref],
        applied: AbstractSet[Ref],
        headless: Mapping[str, bool],
        foreign: AbstractSet[Ref],
    ) -> None:
        """POST a child not known to exist; apply one that does. An existing Service whose
        headlessness must flip is deleted, then created again (its clusterIP cannot change)."""
        kube = self._session.client
        kind, name = child_ref = ref(child)
        namespace = child["metadata"]["namespace"]
        if child_ref in foreign:
            raise conflict(kind, namespace, name, key[1])
        flip = kind == "Service" and name in headless and headless[name] != is_headless(child)
        if flip:
            await kube.delete("Service", namespace, name)
        if (flip or child_ref not in existing) and await kube.create(child):
            self._expectations.created(key, child_ref, child["metadata"]["annotations"][ANNOTATION_SPEC_HASH])
            return
        if flip:
            return  # still there, going (a finalizer): its DELETED event queues the creation
        if child_ref not in applied:
            await self._own_by_apply(key, owner_uid, kind, namespace, name)
        await kube.apply(child)

    async def _own_by_apply(self, key: Key, owner_uid: str, kind: str, namespace: str, name: str) -> None:
        """Before applying to a child this operator created by POST, turn its Update entry of
        managedFields into an Apply one, so the apply removes what it stops setting. One that
        this EPDDeployment does not control is refused: the apply would take it over."""
        kube = self._session.client
        live = await kube.get(kind, namespace, name)
        if live is None:
            return
        if controller_uid(live["metadata"]) != owner_uid:
            raise conflict(kind, namespace, name, key[1])
        upgraded = upgrade_to_apply(live["metadata"].get("managedFields") or [], FIELD_MANAGER)
        if upgraded is not None:
            await kube.replace_managed_fields(kind, namespace, name, live["metadata"]["resourceVersion"], upgraded)
