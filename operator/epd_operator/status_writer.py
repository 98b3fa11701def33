"""The status writer: what the pods and StatefulSets say, written to the EPDDeployment's status
(only when it changes), the Events of its milestones, and the readiness gates of Pools units
(the operator's only write to a pod: `pods/status`).

It remembers, per EPDDeployment, the hash of the status it last wrote (or found right), so the
event filter can tell the echo of its own patch, and the API server's refusal of a child, which
the status says until a write goes through; and its pods as last observed (status.Observations),
so that a refresh observes again only the pods that changed.

A status that only moves counts and messages (units starting, one by one) is written at most
every `units x status_seconds_per_unit` seconds (at most STATUS_SPACING_MAX): a status write costs
the same whatever the number of units, so at thousands of units this keeps the writes to a few
per hundred units during a scale-up, while one a phase or a condition flips, or a new generation,
goes at once (Ready is reported as soon as it is true).
"""

from __future__ import annotations

import asyncio
import datetime
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from .ec.scrape import JanitorScraper
from .events import Post
from .indexes import Indexes, Key
from .kube import KubeSession
from .metrics import OperatorMetrics
from .plans import Planned
from .resources import digest
from .status import Observations, ObservedPod, compute_status, encoder_gates, invalid_status, unit_readiness_events
from .validation import SpecError

KOPF_FIELD = "kopf"  # kopf's own bookkeeping in the status: not the operator's
# A StatefulSet lacking pods for this long (a scale-up creates them within seconds) has its
# FailedCreate Events read, again every CREATE_FAILURE_RECHECK seconds while it lacks them.
CREATE_FAILURE_GRACE = 10.0
CREATE_FAILURE_RECHECK = 10.0
STATUS_SPACING_MAX = 30.0


class StatusWriter:
    def __init__(
        self,
        session: KubeSession,
        scraper: JanitorScraper,
        metrics: OperatorMetrics,
        *,
        warn: Post,
        inform: Post,
        requeue_after: Callable[[Key, float], None] = lambda _key, _delay: None,
        clock: Callable[[], float] = time.monotonic,
        seconds_per_unit: float = 0.0,
    ) -> None:
        self._session = session
        self._scraper = scraper
        self._metrics = metrics
        self._warn = warn
        self._inform = inform
        self._requeue_after = requeue_after
        self._clock = clock
        self._seconds_per_unit = seconds_per_unit
        self._observations: dict[Key, Observations] = {}
        self._last_write: dict[Key, float] = {}  # when the status was last patched (clock)
        # Per (key, StatefulSet) lacking pods: since when, and its FailedCreate Event as last read.
        self._lacking: dict[tuple[Key, str], float] = {}
        self._create_failures: dict[tuple[Key, str], tuple[float, str | None]] = {}
        self._written: dict[Key, str] = {}  # hash of the status last written (or found right)
        self._refusals: dict[Key, tuple[str, str]] = {}  # (reason, message) of a refused child, until a write goes
        self._fallen: dict[Key, frozenset[str]] = {}  # units that stopped being ready, until they are again
        self._units_written: dict[Key, dict[str, ObservedPod]] = {}  # the units as the last status written saw them

    def echoes(self, key: Key, status: Mapping[str, Any]) -> bool:
        """Whether `status` is exactly what this operator last wrote (or found right) for the key."""
        return key in self._written and self._written[key] == status_hash(status)

    def refused(self, key: Key, refusal: tuple[str, str] | None) -> bool:
        """Record (reason, message) of a child this reconcile could not write (None: every write
        went through); True if that changes what the status must say."""
        if refusal == self._refusals.get(key):
            return False
        if refusal is None:
            del self._refusals[key]
        else:
            self._refusals[key] = refusal
        return True

    def forget(self, key: Key) -> None:
        self._written.pop(key, None)
        self._refusals.pop(key, None)
        self._fallen.pop(key, None)
        self._units_written.pop(key, None)
        self._observations.pop(key, None)
        self._last_write.pop(key, None)
        for entries in (self._lacking, self._create_failures):
            for ref in [ref for ref in entries if ref[0] == key]:
                del entries[ref]

    async def write(self, key: Key, body: kopf.Body, planned: Planned, indexes: Indexes) -> bool:
        """Patch the status computed from the pods and StatefulSets the indexes show, if it
        changed and may be written now (else a reconcile is queued for when it may); True if it
        was (a refusal said again writes nothing)."""
        namespace, name = key
        previous = dict(body.status)
        failures = await self._read_create_failures(key, body, indexes)
        status = compute_status(
            deployment=name,
            spec=planned.spec,
            plans=planned.plans,
            pods=indexes.pod_summaries(key),
            stateful_sets=indexes.stateful_set_summaries(key),
            generation=body.metadata.get("generation"),
            previous=previous,
            now=now(),
            evictions=self._scraper.evictions(key),
            fallback_encodes=self._scraper.fallback_encodes(key),
            write_failure=self._refusals.get(key),
            create_failures=failures,
            observations=(observations := self._observations.setdefault(key, Observations())),
        )
        self._metrics.set_units(
            namespace,
            name,
            ready=sum(m["readyUnits"] for m in status["models"]),
            desired=sum(m["desiredUnits"] for m in status["models"]),
        )
        if _same(status, previous):
            self._written[key] = status_hash(status)
            self._units_written[key] = observations.units()  # what the status found in place says
            return False
        wait = self._spacing(status) - (self._clock() - self._last_write.get(key, -math.inf))
        if wait > 0 and not flips(status, previous):
            self._requeue_after(key, wait)
            return False
        self._written[key] = status_hash(status)
        self._last_write[key] = self._clock()
        budget = _condition(status, "ECBudgetSufficient")
        if (
            budget["status"] == "False"
            and _condition(previous, "ECBudgetSufficient").get("message") != budget["message"]
        ):
            self._warn(body, "ECBudgetTooSmall", budget["message"])
        self._tell_the_rollout(body, previous, status)
        units = observations.units()
        events, self._fallen[key] = unit_readiness_events(
            self._units_written.get(key, {}),
            units,
            _condition(status, "Progressing").get("reason") == "RollingOut",
            self._fallen.get(key, frozenset()),
        )
        self._units_written[key] = units
        for warning, reason, message in events:
            (self._warn if warning else self._inform)(body, reason, message)
        await self._session.client.patch_status(namespace, name, status)
        return True

    def _spacing(self, status: Mapping[str, Any]) -> float:
        units = sum(m.get("desiredUnits", 0) for m in status.get("models") or [])
        return min(STATUS_SPACING_MAX, units * self._seconds_per_unit)

    async def _read_create_failures(self, key: Key, body: kopf.Body, indexes: Indexes) -> dict[str, str]:
        """Why each StatefulSet that has lacked pods for CREATE_FAILURE_GRACE seconds cannot create
        them (its newest FailedCreate Event: admission, a quota, a webhook), by StatefulSet name.
        The StatefulSet controller says it nowhere else; a Warning Event on the EPDDeployment
        repeats each new reason."""
        now, found = self._clock(), {}
        for stateful_set in indexes.stateful_sets.get(key, ()):
            ref = (key, stateful_set.name)
            if not stateful_set.observed or stateful_set.created_replicas >= stateful_set.replicas:
                self._lacking.pop(ref, None)
                self._create_failures.pop(ref, None)
                continue
            waited = now - self._lacking.setdefault(ref, now)
            if waited < CREATE_FAILURE_GRACE:
                self._requeue_after(key, CREATE_FAILURE_GRACE - waited)
                continue
            checked_at, message = self._create_failures.get(ref, (None, None))
            if checked_at is None or now - checked_at >= CREATE_FAILURE_RECHECK:
                latest = await self._session.client.latest_event(
                    key[0], "StatefulSet", stateful_set.name, "FailedCreate"
                )
                if latest and latest != message:
                    self._warn(body, "FailedCreate", f"StatefulSet {stateful_set.name}: {latest}")
                self._create_failures[ref] = (now, latest)
                message = latest
                self._requeue_after(key, CREATE_FAILURE_RECHECK)
            if message:
                found[stateful_set.name] = message
        return found

    async def report_invalid(self, key: Key, body: kopf.Body, error: SpecError) -> None:
        """Validated=False with every rule's message, and one InvalidSpec Event per generation."""
        status = invalid_status(error.errors, body.metadata.get("generation"), dict(body.status), now())
        if _same(status, dict(body.status)):
            return  # already reported for this generation
        self._warn(body, "InvalidSpec", "; ".join(error.errors))
        await self._session.client.patch_status(key[0], key[1], status)

    async def open_gates(self, key: Key, planned: Planned, indexes: Indexes) -> None:
        """Pools: set the encoders-ready readiness gate of each unit pod whose condition is not
        yet what its encoder pool says (only those: an unchanged pool writes nothing)."""
        if not any(plan.pooled for plan in planned.plans):
            return
        namespace, name = key
        sets = indexes.stateful_set_summaries(key)
        gates = encoder_gates(name, planned.spec, planned.plans, indexes.pod_summaries(key), sets, now())
        kube = self._session.client
        await asyncio.gather(*(kube.patch_pod_condition(namespace, pod, c) for pod, c in gates.items()))

    def _tell_the_rollout(self, body: kopf.Body, previous: dict[str, Any], status: dict[str, Any]) -> None:
        """Events at a rollout's milestones, so `kubectl describe` tells its story."""
        before, current = _condition(previous, "Progressing"), _condition(status, "Progressing")
        generation = body.metadata.get("generation")
        if current["reason"] == "RollingOut" and before.get("reason") != "RollingOut" and previous.get("models"):
            self._inform(body, "RolloutStarted", f"rolling out generation {generation}: {current['message']}")
        elif before.get("reason") == "RollingOut" and current["reason"] != "RollingOut":
            self._inform(body, "RolloutComplete", f"generation {generation}: every unit runs the current spec")
        degraded = _condition(status, "Degraded")
        if (
            degraded["reason"] == "RolloutStalled"
            and _condition(previous, "Degraded").get("reason") != "RolloutStalled"
        ):
            self._warn(body, "RolloutStalled", degraded["message"])


def flips(status: Mapping[str, Any], previous: Mapping[str, Any]) -> bool:
    """Whether `status` says more than how far its units are: another generation, phase, or the
    value of a condition."""

    def values(s: Mapping[str, Any]) -> dict[str, Any]:
        return {c.get("type"): c.get("status") for c in s.get("conditions") or []}

    return (
        status.get("observedGeneration") != previous.get("observedGeneration")
        or status.get("phase") != previous.get("phase")
        or values(status) != values(previous)
    )


def status_hash(status: Mapping[str, Any]) -> str:
    return digest(_ours(status))


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ours(status: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k != KOPF_FIELD}


def _same(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    return _ours(new) == _ours(old)


def _condition(status: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})
