"""The Reconciler: an EPDDeployment's key in; its children converged and its status written.

Level-based, as controller-runtime: every EPDDeployment event (and every change of its children
or pods) queues its key, and a worker computes the whole desired state from kopf's indexes;
nothing depends on seeing a particular event, so a restarted operator converges without
duplicates. One Reconciler is made at start (runner.py) and reaches the handlers through
kopf's memo; it holds all the operator's state: API client, work queue, plan cache, janitor
scraper.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hashlib
import json
import time
from collections.abc import Callable, Coroutine, Mapping, Set
from typing import Any, ClassVar

import kopf

from . import api
from .ec.scrape import JanitorScraper
from .kube import Kube, KubeError
from .managedfields import upgrade_to_apply
from .metrics import OperatorMetrics
from .render import ModelPlan, render
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, desired_children, is_headless
from .settings import Settings
from .status import Pod, compute_status, encoder_gates, invalid_status
from .validation import CheckedSpec, SpecError, validate
from .workqueue import WorkQueue

Key = tuple[str, str]  # (namespace, EPDDeployment name)
Warn = Callable[[Any, str, str], None]  # (body, reason, message)


def post_warning(body: Any, reason: str, message: str) -> None:
    """A Warning Event on `body` (kopf posts it in the background)."""
    kopf.warn(body, reason=reason, message=message)


def post_normal(body: Any, reason: str, message: str) -> None:
    """A Normal Event on `body`: the milestones `kubectl describe` tells (rollouts)."""
    kopf.event(body, type="Normal", reason=reason, message=message)


@dataclasses.dataclass(frozen=True, slots=True)
class IndexedDeployment:
    """What the deployments index keeps of an EPDDeployment: the fields Events and the plan
    cache read, and its spec and status as JSON text, decoded when a reconcile needs them. (The
    decoded trees, each key a string of its own, were the operator's largest memory per object;
    the reference is a plain dict, as a kopf.Body with its views is three times its size.)"""

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
    def of(cls, body: Mapping[str, Any]) -> IndexedDeployment:
        metadata = body["metadata"]
        reference = {
            "apiVersion": body["apiVersion"],
            "kind": body["kind"],
            "metadata": {f: metadata[f] for f in cls.METADATA_FIELDS if f in metadata},
        }
        return cls(reference, _compact(body.get("spec", {})), _compact(body.get("status", {})))

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self.reference["metadata"]  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return json.loads(self.status_json)  # type: ignore[no-any-return]

    def body(self) -> kopf.Body:
        return kopf.Body({**self.reference, "spec": json.loads(self.spec_json), "status": self.status()})


@dataclasses.dataclass(frozen=True)
class Indexes:
    """kopf's live indexes, each keyed by (namespace, EPDDeployment name); see handlers.py."""

    deployments: Mapping[Key, Any]  # an IndexedDeployment of each EPDDeployment
    unit_sets: Mapping[Key, Any]  # a StatefulSetSummary of each StatefulSet
    unit_services: Mapping[Key, Any]  # (name, spec hash, headless, owned by update) of each Service
    unit_pods: Mapping[Key, Any]  # a PodSummary of each unit or encoder pod
    unit_budgets: Mapping[Key, Any] = dataclasses.field(
        default_factory=dict
    )  # (name, spec hash, owned by update) of each PDB


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedGeneration:
    """What the plan cache keeps of one generation of an EPDDeployment: the spec that passed
    validation, as JSON text, and the hashes of its children's desired state (event filtering
    reads them on every child event). Not the rendered plans: 9 KB each, they were the largest
    part of the operator's memory at 5,000 objects; a reconcile renders them again (0.4 ms)."""

    spec_json: str
    vllm_minor: str
    digests: dict[tuple[str, str], str]  # (kind, name) of each child -> hash of its desired state


@dataclasses.dataclass(frozen=True)
class Planned:
    """What one generation of an EPDDeployment asks for, as one reconcile uses it."""

    spec: api.EPDDeploymentSpec
    plans: list[ModelPlan]
    digests: dict[tuple[str, str], str]


class Reconciler:
    """`kube` and `warn` are injectable (tests record them); by default the API client is made
    from kopf's credentials at login and Events are posted through kopf."""

    def __init__(
        self, settings: Settings, *, kube: Kube | None = None, warn: Warn = post_warning, inform: Warn = post_normal
    ) -> None:
        self.settings = settings
        self.metrics = OperatorMetrics()
        self._kube = kube
        self._owns_kube = kube is None
        self._connection: kopf.ConnectionInfo | None = None
        self._warn = warn
        self._inform = inform
        self._indexes: Indexes | None = None
        self._queue: WorkQueue | None = None
        self._plans: collections.OrderedDict[tuple[Any, ...], CheckedGeneration | SpecError] = collections.OrderedDict()
        self._background: set[asyncio.Task[None]] = set()
        self._written: dict[Key, str] = {}  # hash of the status last written (or found right), per key
        self._refusals: dict[Key, str] = {}  # the API server's refusal of a child, until a write goes
        # Children created and not seen by a watch yet, with their hashes and until when they count
        # (kcm's controllers' "expectations"): a reconcile in between does not create them again.
        self._created: dict[Key, dict[tuple[str, str], tuple[str, float]]] = {}
        self.scraper = JanitorScraper(warn=warn, changed=self.enqueue, rate=self.settings.janitor_scrape_rate)

    # ------------------------------------------------------------------ wiring (handlers.py)

    def login(self, connection: kopf.ConnectionInfo) -> None:
        """Use kopf's (new) credentials for the operator's own API calls (from the next call on:
        kopf runs login handlers in a thread, the API client needs the event loop)."""
        self._connection = connection

    def watch(self, indexes: Indexes) -> None:
        self._indexes = indexes  # live: they fill as watching starts

    def echoes_status(self, body: Any) -> bool:
        """An EPDDeployment event that only brings back the status this operator last wrote, for
        a generation and labels already planned: a reconcile would find nothing to do. (A status
        edited by someone else, a new generation or new labels is not an echo.)"""
        key = (body.metadata.namespace, body.metadata.name)
        status = dict(body.get("status") or {})
        return (
            key in self._written
            and status.get("observedGeneration") == body.metadata.get("generation")
            and isinstance(self._plans.get(_plan_key(body.metadata)), CheckedGeneration)
            and self._written[key] == _status_hash(status)
        )

    def confirms(self, key: Key, kind: str, name: str, digest: str | None) -> bool:
        """A child at the desired state planned for its owner's current generation and labels (so
        an event about it only confirms what was applied); False while that is not planned yet."""
        for indexed in self._require_indexes().deployments.get(key, []):
            planned = self._plans.get(_plan_key(indexed.metadata))
            return (
                isinstance(planned, CheckedGeneration)
                and digest is not None
                and planned.digests.get((kind, name)) == digest
            )
        return False

    def observed(self, key: Key, kind: str, name: str) -> None:
        """A watch event of this child came (added, changed or deleted): the indexes tell from now on."""
        created = self._created.get(key)
        if created is not None:
            created.pop((kind, name), None)
            if not created:
                del self._created[key]

    def enqueue(self, key: Key, *, urgent: bool = False) -> None:
        self._work_queue().add(key, urgent=urgent)

    def enqueue_after(self, key: Key, delay: float) -> None:
        self._work_queue().add_after(key, delay)

    def forget(self, key: Key) -> None:
        """The EPDDeployment is gone."""
        self._written.pop(key, None)
        self._refusals.pop(key, None)
        self._created.pop(key, None)
        self.metrics.forget(*key)
        if self._queue is not None:
            self._queue.forget(key)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._queue is not None:
            await self._queue.aclose()
        if self._kube is not None and self._owns_kube:
            await self._kube.aclose()

    def _work_queue(self) -> WorkQueue:
        # The queue's workers (and the scrape loop) start with the first event: a task inherits
        # its creator's context, and kopf sets what posting Events needs for handlers only.
        if self._queue is None:
            self._queue = WorkQueue(
                self._reconcile_key,
                workers=self.settings.max_concurrent_reconciles,
                max_backoff=self.settings.retry_max_seconds,
            )
            if self.settings.janitor_scrape_interval > 0:
                indexes = self._require_indexes()
                self._spawn(
                    self.scraper.run(self.settings.janitor_scrape_interval, indexes.deployments, indexes.unit_pods)
                )
        return self._queue

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)  # keep a reference until done, or the task may be garbage-collected
        task.add_done_callback(self._background.discard)

    def _require_indexes(self) -> Indexes:
        if self._indexes is None:
            raise RuntimeError("Reconciler.watch(indexes) must be called before reconciling")
        return self._indexes

    @property
    def kube(self) -> Kube:
        if (
            self._owns_kube
            and self._connection is not None
            and (self._kube is None or self._kube.connection is not self._connection)
        ):
            if self._kube is not None:  # kopf logged in again (credentials rotated): drop the old session
                self._spawn(self._kube.aclose())
            self._kube = Kube(self._connection)
        if self._kube is None:
            raise RuntimeError("no API client yet: kopf logs in before any handler runs")
        return self._kube

    # ------------------------------------------------------------------ reconcile

    async def _reconcile_key(self, key: Key) -> None:
        for indexed in self._require_indexes().deployments.get(key, []):  # the latest state; none if deleted
            body = indexed.body()
            try:
                await self.reconcile(body)
            except KubeError as error:
                if error.namespace_gone:
                    return  # deleted with everything in it: nothing to converge
                self._warn(body, "ReconcileFailed", str(error))
                raise  # the queue retries it with backoff

    async def reconcile(self, body: kopf.Body) -> None:
        if body.metadata.get("deletionTimestamp"):
            return  # children carry ownerReferences: the garbage collector removes them
        namespace, name = body.metadata.namespace, body.metadata.name
        started = time.perf_counter()
        try:
            planned = self.plan(body)
        except SpecError as error:
            await self._report_invalid(body, error)
            self.metrics.observe_reconcile("invalid", time.perf_counter() - started)
            return
        self.metrics.forget_invalid(namespace, name)
        self.metrics.observe_stage("plan", time.perf_counter() - started)
        try:
            # The status goes out with the children, not after them: it is computed from the
            # indexes, which show none of this reconcile's writes yet either way.
            refused, _ = await asyncio.gather(
                self._converge_timed(body, planned), self._write_status_timed(body, planned)
            )
            key = (namespace, name)
            refusal = str(refused) if refused else None
            if refusal != self._refusals.get(key):  # said in the status until a write goes through
                if refusal is None:
                    del self._refusals[key]
                else:
                    self._refusals[key] = refusal
                await self.write_status(body, planned)
            if refused is not None:
                raise refused
            # After the status: a refused pod patch (an older chart's RBAC) must not hide it.
            await self.open_gates(body, planned)
        except Exception:
            self.metrics.observe_reconcile("error", time.perf_counter() - started)
            raise
        self.metrics.observe_reconcile("success", time.perf_counter() - started)

    async def _converge_timed(self, body: kopf.Body, planned: Planned) -> KubeError | None:
        """converge(), timed; the API server's refusal of a child is returned, not raised."""
        began = time.perf_counter()
        try:
            if await self.converge(body, planned):
                self.metrics.observe_stage("children", time.perf_counter() - began)
        except KubeError as error:
            if error.namespace_gone:
                raise
            return error
        return None

    async def _write_status_timed(self, body: kopf.Body, planned: Planned) -> None:
        began = time.perf_counter()
        if await self.write_status(body, planned):
            self.metrics.observe_stage("status", time.perf_counter() - began)

    def plan(self, body: kopf.Body) -> Planned:
        """validate() and render() of the body's spec, and its children's hashes. What they
        depend on, (uid, generation, labels) (children carry the owner's labels), keys a cache
        of the validated spec and the hashes; the plans are rendered from it again. Raises
        SpecError for an invalid spec."""
        metadata = body.metadata
        key = _plan_key(metadata)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            if isinstance(cached, SpecError):
                raise SpecError(cached.errors)  # a fresh one: re-raising one object grows its traceback
            spec = api.EPDDeploymentSpec.model_validate(json.loads(cached.spec_json))
            checked = CheckedSpec(spec, cached.vllm_minor)
            return Planned(checked.spec, self._render(body, checked), cached.digests)
        raw = dict(body.spec)
        try:
            checked = validate(raw)
        except SpecError as error:
            self._remember(key, error)
            raise
        plans = self._render(body, checked)
        digests = {
            _ref(c): c["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
            for c in self._desired(body, checked.spec, plans)
        }
        self._remember(key, CheckedGeneration(_compact(raw), checked.vllm_minor, digests))
        return Planned(checked.spec, plans, digests)

    def _render(self, body: kopf.Body, checked: CheckedSpec) -> list[ModelPlan]:
        metadata = body.metadata
        return render(checked, namespace=metadata.namespace, name=metadata.name, uid=metadata.uid)

    def _remember(self, key: tuple[Any, ...], checked: CheckedGeneration | SpecError) -> None:
        self._plans[key] = checked
        if len(self._plans) > self.settings.plan_cache_size:
            self._plans.popitem(last=False)

    def desired(self, body: kopf.Body, planned: Planned) -> list[dict[str, Any]]:
        """The children, owned by `body`, each annotated with the hash of its desired state."""
        return self._desired(body, planned.spec, planned.plans)

    def _desired(self, body: kopf.Body, spec: api.EPDDeploymentSpec, plans: list[ModelPlan]) -> list[dict[str, Any]]:
        children = desired_children(spec, body.metadata.name, plans, self.settings.janitor_image)
        kopf.adopt(children, owner=body)
        for child in children:
            child["metadata"].setdefault("annotations", {})[ANNOTATION_SPEC_HASH] = _hash(child)
        return children

    async def converge(self, body: kopf.Body, planned: Planned) -> bool:
        """Write the children not at their desired state; delete those of removed models. True
        if it wrote anything."""
        indexes = self._require_indexes()
        key = (body.metadata.namespace, body.metadata.name)
        sets = indexes.unit_sets.get(key, [])
        services = indexes.unit_services.get(key, [])
        budgets = indexes.unit_budgets.get(key, [])
        headless = {name: flag for name, _, flag, _ in services}
        indexed = {
            **{("StatefulSet", s.name): (s.spec_hash, s.owned_by_update) for s in sets},
            **{("Service", name): (digest, updated) for name, digest, _, updated in services},
            **{("PodDisruptionBudget", name): (digest, updated) for name, digest, updated in budgets},
        }
        unseen = self._created_unseen(key)
        existing = {**unseen, **{ref: digest for ref, (digest, _) in indexed.items()}}
        # Taken over by an apply already, as the watch shows it (one created again since may not be).
        applied = {ref for ref, (_, updated) in indexed.items() if not updated} - unseen.keys()
        # Level-based, but cheap: children already carrying their exact desired state are left
        # alone, and are not even built again when the remembered hashes show that.
        stale = {ref for ref, digest in planned.digests.items() if existing.get(ref) != digest}
        if stale:
            await asyncio.gather(
                *(
                    self._write(key, c, existing.keys(), applied, headless)
                    for c in self.desired(body, planned)
                    if _ref(c) in stale
                )
            )
        removed = existing.keys() - planned.digests.keys()  # children of a model removed from the spec
        for kind, name in removed:
            await self.kube.delete(kind, key[0], name)
        return bool(stale or removed)

    def _created_unseen(self, key: Key) -> dict[tuple[str, str], str]:
        """The children this operator created whose watch event has not come, with their hashes.
        (Created again, one would be refused, yet a Service's POST allocates and frees a ClusterIP
        under the API server's one lock.) Past `created_settle_seconds` one counts as missing
        again; a reconcile is queued for then."""
        created = self._created.get(key)
        if not created:
            return {}
        now = time.monotonic()
        for ref in [ref for ref, (_, until) in created.items() if until <= now]:
            del created[ref]
        if not created:
            del self._created[key]
            return {}
        self.enqueue_after(key, max(until for _, until in created.values()) - now)
        return {ref: digest for ref, (digest, _) in created.items()}

    async def _write(
        self,
        key: Key,
        child: dict[str, Any],
        existing: Set[tuple[str, str]],
        applied: Set[tuple[str, str]],
        headless: Mapping[str, bool],
    ) -> None:
        """Create a child neither the indexes nor the expectations show (a POST: the API
        server's cheapest write); server-side apply one that exists, taking its fields over
        first unless the index shows that done (`applied`). An existing Service whose
        headlessness must flip is deleted, then created again (its clusterIP cannot change)."""
        kind, name = ref = _ref(child)
        namespace = child["metadata"]["namespace"]
        flip = kind == "Service" and name in headless and headless[name] != is_headless(child)
        if flip:
            await self.kube.delete("Service", namespace, name)
        if (flip or ref not in existing) and await self.kube.create(child):
            until = time.monotonic() + self.settings.created_settle_seconds
            self._created.setdefault(key, {})[ref] = (child["metadata"]["annotations"][ANNOTATION_SPEC_HASH], until)
            return
        if flip:
            return  # still there, going (a finalizer): its DELETED event queues the creation
        if ref not in applied:
            await self._own_by_apply(kind, namespace, name)
        await self.kube.apply(child)

    async def _own_by_apply(self, kind: str, namespace: str, name: str) -> None:
        """Before applying to a child this operator created by POST, turn its Update entry of
        managedFields into an Apply one, so the apply removes what it stops setting."""
        live = await self.kube.get(kind, namespace, name)
        if live is None:
            return
        upgraded = upgrade_to_apply(live["metadata"].get("managedFields") or [], FIELD_MANAGER)
        if upgraded is not None:
            await self.kube.replace_managed_fields(kind, namespace, name, live["metadata"]["resourceVersion"], upgraded)

    def _pods(self, key: Key) -> dict[str, Pod]:
        """The deployment's unit and encoder pods by name, decoded from the index as they are now."""
        return {p.name: p.tree() for p in self._require_indexes().unit_pods.get(key, [])}

    async def open_gates(self, body: kopf.Body, planned: Planned) -> None:
        """Pools: set the encoders-ready readiness gate of each unit pod whose condition is not
        yet what its encoder pool says (only those: an unchanged pool writes nothing)."""
        if not any(plan.pooled for plan in planned.plans):
            return
        namespace, name = body.metadata.namespace, body.metadata.name
        pods = self._pods((namespace, name))
        gates = encoder_gates(name, planned.spec, planned.plans, pods, _now())
        await asyncio.gather(
            *(self.kube.patch_pod_condition(namespace, pod, condition) for pod, condition in gates.items())
        )

    async def write_status(self, body: kopf.Body, planned: Planned) -> bool:
        """Patch the status if it changed; True if it did (a refusal said again writes nothing)."""
        indexes = self._require_indexes()
        namespace, name = body.metadata.namespace, body.metadata.name
        pods = self._pods((namespace, name))
        sets = {s.name: s for s in indexes.unit_sets.get((namespace, name), [])}
        previous = dict(body.status)
        status = compute_status(
            deployment=name,
            spec=planned.spec,
            plans=planned.plans,
            pods=pods,
            stateful_sets=sets,
            generation=body.metadata.get("generation"),
            previous=previous,
            now=_now(),
            evictions=self.scraper.evictions((namespace, name)),
            fallback_encodes=self.scraper.fallback_encodes((namespace, name)),
            write_error=self._refusals.get((namespace, name)),
        )
        self.metrics.set_ready_units(namespace, name, sum(m["readyUnits"] for m in status["models"]))
        self._written[(namespace, name)] = _status_hash(status)
        if _same(status, previous):
            return False
        budget = _condition(status, "ECBudgetSufficient")
        if (
            budget["status"] == "False"
            and _condition(previous, "ECBudgetSufficient").get("message") != budget["message"]
        ):
            self._warn(body, "ECBudgetTooSmall", budget["message"])
        self._tell_the_rollout(body, previous, status)
        await self.kube.patch_status(namespace, name, status)
        return True

    def _tell_the_rollout(self, body: kopf.Body, previous: dict[str, Any], status: dict[str, Any]) -> None:
        """Events at a rollout's milestones, so `kubectl describe` tells its story."""
        before, now = _condition(previous, "Progressing"), _condition(status, "Progressing")
        generation = body.metadata.get("generation")
        if now["reason"] == "RollingOut" and before.get("reason") != "RollingOut" and previous.get("models"):
            self._inform(body, "RolloutStarted", f"rolling out generation {generation}: {now['message']}")
        elif before.get("reason") == "RollingOut" and now["reason"] != "RollingOut":
            self._inform(body, "RolloutComplete", f"generation {generation}: every unit runs the current spec")
        degraded = _condition(status, "Degraded")
        if (
            degraded["reason"] == "RolloutStalled"
            and _condition(previous, "Degraded").get("reason") != "RolloutStalled"
        ):
            self._warn(body, "RolloutStalled", degraded["message"])

    async def _report_invalid(self, body: kopf.Body, error: SpecError) -> None:
        namespace, name = body.metadata.namespace, body.metadata.name
        self.metrics.mark_invalid(namespace, name)
        status = invalid_status(error.errors, body.metadata.get("generation"), dict(body.status), _now())
        if _same(status, dict(body.status)):
            return  # already reported for this generation
        self._warn(body, "InvalidSpec", "; ".join(error.errors))
        await self.kube.patch_status(namespace, name, status)


def _ref(child: dict[str, Any]) -> tuple[str, str]:
    return child["kind"], child["metadata"]["name"]  # a unit's StatefulSet and Service share a name


def _plan_key(metadata: Mapping[str, Any]) -> tuple[Any, ...]:
    return metadata.get("uid"), metadata.get("generation"), tuple(sorted((metadata.get("labels") or {}).items()))


def _compact(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"))


def _status_hash(status: dict[str, Any]) -> str:
    return _hash({k: v for k, v in status.items() if k != "kopf"})  # as _same: kopf's own field is not ours


def _hash(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    return {k: v for k, v in new.items() if k != "kopf"} == {k: v for k, v in old.items() if k != "kopf"}


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})
