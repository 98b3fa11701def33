"""What the operator's kopf indexes keep of each watched kind: one typed summary per kind, made
by its `of(body)` and read by the handlers, the Reconciler, the janitor scrape and the tests.

Each index is keyed by the owning EPDDeployment's (namespace, name). The summaries keep only
what reconcile and status read: every unit's whole pod (managedFields, container specs) and
kubectl's last-applied copy of every spec would dominate the operator's memory at scale.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from .managedfields import owned_by_update
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, LABEL_DEPLOYMENT, is_headless

Key = tuple[str, str]  # (namespace, EPDDeployment name)
Ref = tuple[str, str]  # (kind, name) of a child: a unit's StatefulSet and Service share a name
Pod = dict[str, Any]  # a pod-shaped tree: name, metadata, spec, status (PodSummary.tree)
# The StatefulSet controller labels each pod with the revision of the template it was made from.
REVISION_LABEL = "controller-revision-hash"


def owner_key(namespace: str | None, labels: Mapping[str, str]) -> Key:
    """The key of the EPDDeployment a child or pod belongs to (the operator labels every one)."""
    return namespace or "", labels[LABEL_DEPLOYMENT]


def controller_uid(metadata: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (its ownerReference with controller: true), if any."""
    refs = metadata.get("ownerReferences") or []
    return next((r.get("uid") for r in refs if isinstance(r, Mapping) and r.get("controller")), None)


def compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class DeploymentSummary:
    """An EPDDeployment: the fields Events and the plan cache read, and its spec and status as
    JSON text, decoded when a reconcile needs them. (The decoded trees, each key a string of its
    own, were the operator's largest memory per object; the reference is a plain dict, as a
    kopf.Body with its views is three times its size.)"""

    reference: dict[str, Any]  # apiVersion, kind and the METADATA_FIELDS of its metadata: enough for an Event
    spec_json: str
    status_json: str

    METADATA_FIELDS: ClassVar[tuple[str, ...]] = (
        "name",
        "namespace",
        "uid",
        "generation",
        "labels",
        "deletionTimestamp",
    )

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> DeploymentSummary:
        metadata = body["metadata"]
        reference = {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {f: metadata[f] for f in cls.METADATA_FIELDS if f in metadata},
        }
        return cls(reference, compact(body.get("spec", {})), compact(body.get("status", {})))

    @property
    def metadata(self) -> Mapping[str, Any]:
        metadata: Mapping[str, Any] = self.reference["metadata"]
        return metadata

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self.status_json)
        return status

    def document(self) -> dict[str, Any]:
        """The object as a reconcile reads it (a new copy each call): reference, spec and status."""
        return {**self.reference, "spec": json.loads(self.spec_json), "status": self.status()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildSummary:
    """A child the operator writes: its name, the hash of the desired state it was written from
    (the operator's annotation), whether the operator's POST still owns fields of it through an
    Update entry of managedFields (an apply must take those over first: managedfields.py), and
    the uid of its controller (anyone can put the operator's labels on an object: only one whose
    controller is the EPDDeployment is the operator's to change or delete)."""

    KIND: ClassVar[str]

    name: str
    spec_hash: str | None
    owned_by_update: bool = False
    controller_uid: str | None = None
    uid: str | None = None

    @property
    def ref(self) -> Ref:
        return self.KIND, self.name

    @staticmethod
    def _common(body: Mapping[str, Any]) -> dict[str, Any]:
        metadata = body["metadata"]
        return {
            "name": metadata["name"],
            "spec_hash": (metadata.get("annotations") or {}).get(ANNOTATION_SPEC_HASH),
            "owned_by_update": owned_by_update(metadata.get("managedFields") or [], FIELD_MANAGER),
            "controller_uid": controller_uid(metadata),
            "uid": metadata.get("uid"),
        }

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Self:
        """The summary of a kind that keeps nothing beyond what every child has."""
        return cls(**cls._common(body))


@dataclass(frozen=True, slots=True, kw_only=True)
class StatefulSetSummary(ChildSummary):
    """A StatefulSet of units or of an encoder pool, with the rollout fields status reads."""

    KIND: ClassVar[str] = "StatefulSet"

    observed: bool = True  # status.observedGeneration == metadata.generation
    replicas: int = 1
    created_replicas: int = 0  # status.replicas: its pods that exist
    updated_replicas: int = 0
    current_revision: str | None = None
    update_revision: str | None = None

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> StatefulSetSummary:
        metadata, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
        return cls(
            **cls._common(body),
            observed=status.get("observedGeneration") == metadata.get("generation"),
            replicas=spec.get("replicas", 1),
            created_replicas=status.get("replicas", 0),
            updated_replicas=status.get("updatedReplicas", 0),
            current_revision=status.get("currentRevision"),
            update_revision=status.get("updateRevision"),
        )

    @property
    def rolled_out(self) -> bool:
        return (
            self.observed and self.updated_replicas == self.replicas and self.current_revision == self.update_revision
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ServiceSummary(ChildSummary):
    KIND: ClassVar[str] = "Service"

    headless: bool = False  # clusterIP None: a flip re-creates the Service (resources.is_headless)

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ServiceSummary:
        return cls(**cls._common(body), headless=is_headless(body))


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetSummary(ChildSummary):
    KIND: ClassVar[str] = "PodDisruptionBudget"


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkPolicySummary(ChildSummary):
    KIND: ClassVar[str] = "NetworkPolicy"


@dataclass(frozen=True, slots=True, kw_only=True)
class GatewaySummary(ChildSummary):
    """A model's EPD gateway (a Deployment)."""

    KIND: ClassVar[str] = "Deployment"


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessSummary(ChildSummary):
    """The gateways' ServiceAccount, Role or RoleBinding (one summary class: `kind` says which)."""

    KIND: ClassVar[str] = "ServiceAccount"
    kind: str = "ServiceAccount"

    @property
    def ref(self) -> Ref:
        return self.kind, self.name

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> AccessSummary:
        return cls(**cls._common(body), kind=body["kind"])


@dataclass(frozen=True, slots=True, kw_only=True)
class InferencePoolSummary(ChildSummary):
    """A model's InferencePool (spec.gateway.inferencePool)."""

    KIND: ClassVar[str] = "InferencePool"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaledObjectSummary(ChildSummary):
    """A KEDA ScaledObject (spec.autoscaling, spec.models[].encoderAutoscaling)."""

    KIND: ClassVar[str] = "ScaledObject"


@dataclass(frozen=True, slots=True)
class PodSummary:
    """What status, the readiness gates and the janitor scrape read of a unit or encoder pod,
    kept as compact JSON text and decoded when read: its decoded tree (a dict per condition and
    container, each value a string of its own) took 5 KB a pod, the text 0.7 KB."""

    name: str
    summary_json: str
    controller_uid: str | None = None  # its StatefulSet's: only those the operator's are its pods

    CONDITION_FIELDS: ClassVar[tuple[str, ...]] = ("type", "status", "reason", "message")
    CONTAINER_FIELDS: ClassVar[tuple[str, ...]] = ("name", "ready", "started")

    @classmethod
    def of(cls, pod: Mapping[str, Any]) -> PodSummary:
        metadata, status = pod["metadata"], pod.get("status") or {}

        def pick(items: Any, fields: tuple[str, ...]) -> list[dict[str, Any]]:
            return [{f: item[f] for f in fields if f in item} for item in items or []]

        summary = {
            "name": metadata["name"],
            "metadata": {
                "deletionTimestamp": metadata.get("deletionTimestamp"),
                "labels": {REVISION_LABEL: (metadata.get("labels") or {}).get(REVISION_LABEL)},
            },
            "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
            "status": {
                "phase": status.get("phase"),
                "podIP": status.get("podIP"),
                "conditions": pick(status.get("conditions"), cls.CONDITION_FIELDS),
                "initContainerStatuses": pick(status.get("initContainerStatuses"), cls.CONTAINER_FIELDS),
                "containerStatuses": pick(status.get("containerStatuses"), cls.CONTAINER_FIELDS),
            },
        }
        return cls(metadata["name"], compact(summary), controller_uid(metadata))

    def tree(self) -> Pod:
        """The summary as a pod-shaped dict (name, metadata, spec, status), a new copy each call."""
        tree: Pod = json.loads(self.summary_json)
        return tree


@dataclass(frozen=True)
class Indexes:
    """kopf's live indexes (handlers.py registers them; plain dicts of lists in tests), each
    keyed by the owner's Key."""

    deployments: Mapping[Key, Collection[DeploymentSummary]]
    stateful_sets: Mapping[Key, Collection[StatefulSetSummary]]
    services: Mapping[Key, Collection[ServiceSummary]]
    budgets: Mapping[Key, Collection[BudgetSummary]]
    pods: Mapping[Key, Collection[PodSummary]]
    network_policies: Mapping[Key, Collection[NetworkPolicySummary]] = dataclasses.field(default_factory=dict)
    gateways: Mapping[Key, Collection[GatewaySummary]] = dataclasses.field(default_factory=dict)
    service_accounts: Mapping[Key, Collection[AccessSummary]] = dataclasses.field(default_factory=dict)
    roles: Mapping[Key, Collection[AccessSummary]] = dataclasses.field(default_factory=dict)
    role_bindings: Mapping[Key, Collection[AccessSummary]] = dataclasses.field(default_factory=dict)
    inference_pools: Mapping[Key, Collection[InferencePoolSummary]] = dataclasses.field(default_factory=dict)
    scaled_objects: Mapping[Key, Collection[ScaledObjectSummary]] = dataclasses.field(default_factory=dict)

    def deployment(self, key: Key) -> DeploymentSummary | None:
        """The EPDDeployment as last seen; None once deleted."""
        return next(iter(self.deployments.get(key, ())), None)

    def children(self, key: Key) -> list[ChildSummary]:
        """Every child of the EPDDeployment the watches show."""
        return [
            *self.stateful_sets.get(key, ()),
            *self.services.get(key, ()),
            *self.budgets.get(key, ()),
            *self.network_policies.get(key, ()),
            *self.gateways.get(key, ()),
            *self.service_accounts.get(key, ()),
            *self.roles.get(key, ()),
            *self.role_bindings.get(key, ()),
            *self.inference_pools.get(key, ()),
            *self.scaled_objects.get(key, ()),
        ]

    def owned_pods(self, key: Key) -> list[PodSummary]:
        """The deployment's pods whose controller is one of its own StatefulSets (anyone can
        put the operator's labels on a pod; the janitor scrape reads only these)."""
        deployment = self.deployment(key)
        owner = deployment.metadata.get("uid") if deployment is not None else None
        sets = {s.uid for s in self.stateful_sets.get(key, ()) if s.uid and s.controller_uid == owner}
        return [p for p in self.pods.get(key, ()) if p.controller_uid in sets]

    def pod_summaries(self, key: Key) -> dict[str, PodSummary]:
        """The deployment's unit and encoder pods by name, as they are now."""
        return {p.name: p for p in self.pods.get(key, ())}

    def stateful_set_summaries(self, key: Key) -> dict[str, StatefulSetSummary]:
        """The deployment's StatefulSets (units' and encoder pools') by name, as they are now."""
        return {s.name: s for s in self.stateful_sets.get(key, ())}
