"""The Reconciler: an EPDDeployment's key in; its children converged and its status written.

Level-based, as controller-runtime: every EPDDeployment event (and every change of its children
or pods) queues its key, and a worker computes the whole desired state from kopf's indexes;
nothing depends on seeing a particular event, so a restarted operator converges without
duplicates. One Reconciler is made at start (runner.py) and reaches the handlers through kopf's
memo. It only composes the objects that do the jobs, each testable alone:

- `session` (kube.py): the API client on kopf's latest credentials;
- `plans` (plans.py): validation, rendering and the children's hashes, cached per generation;
- `expectations` (expectations.py): children created and not seen by a watch yet;
- `children` (children.py): POST, take over, apply, flip or delete the children;
- `status` (status_writer.py): the status, its Events and the Pools units' readiness gates;
- `scraper` (ec/scrape.py): the units' EC janitors, read in the background;
- the work queue (workqueue.py) and `metrics`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import kopf

from .children import ChildWriter, WriteRefused
from .ec.scrape import JanitorScraper
from .events import Post, post_normal, post_warning
from .expectations import Expectations
from .indexes import Indexes, Key
from .kube import Kube, KubeError, KubeSession
from .metrics import OperatorMetrics
from .plans import PlanCache, Planned
from .settings import Settings
from .status_writer import StatusWriter
from .validation import SpecError
from .workqueue import WorkQueue


class Reconciler:
    """`kube`, `warn` and `inform` are injectable (tests record them); by default the API client
    is made from kopf's credentials at login and Events are posted through kopf."""

    def __init__(
        self, settings: Settings, *, kube: Kube | None = None, warn: Post = post_warning, inform: Post = post_normal
    ) -> None:
        self.settings = settings
        self.metrics = OperatorMetrics()
        self.session = KubeSession(kube)
        self.plans = PlanCache(
            settings.plan_cache_size, settings.janitor_image, settings.limits, settings.operator_namespace
        )
        self.expectations = Expectations(settings.created_settle_seconds)
        self.scraper = JanitorScraper(warn=warn, changed=self.enqueue, rate=settings.janitor_scrape_rate)
        self.children = ChildWriter(self.session, self.expectations, self.enqueue_after)
        self.status = StatusWriter(
            self.session,
            self.scraper,
            self.metrics,
            warn=warn,
            inform=inform,
            requeue_after=self.enqueue_after,
            seconds_per_unit=settings.status_seconds_per_unit,
        )
        self._warn = warn
        self._indexes: Indexes | None = None
        self._queue: WorkQueue[Key] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ wiring (handlers.py)

    def login(self, connection: kopf.ConnectionInfo) -> None:
        self.session.login(connection)

    def watch(self, indexes: Indexes) -> None:
        self._indexes = indexes  # live: they fill as watching starts

    @property
    def indexes(self) -> Indexes:
        if self._indexes is None:
            raise RuntimeError("Reconciler.watch(indexes) must be called before reconciling")
        return self._indexes

    def enqueue(self, key: Key, *, urgent: bool = False) -> None:
        self._work_queue().add(key, urgent=urgent)

    def enqueue_after(self, key: Key, delay: float) -> None:
        self._work_queue().add_after(key, delay)

    def workers(self) -> tuple[int, int]:
        """(running, wanted) reconcile workers: the liveness probe's figure (none before the
        first event starts the queue)."""
        if self._queue is None:
            return 0, 0
        return self._queue.alive, self._queue.workers

    def forget(self, key: Key) -> None:
        """The EPDDeployment is gone."""
        self.status.forget(key)
        self.expectations.forget(key)
        self.metrics.forget(*key)
        if self._queue is not None:
            self._queue.forget(key)

    async def aclose(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._queue is not None:
            await self._queue.aclose()
        await self.session.aclose()

    def _work_queue(self) -> WorkQueue[Key]:
        # The queue's workers (and the scrape loop) start with the first event: a task inherits
        # its creator's context, and kopf sets what posting Events needs for handlers only.
        if self._queue is None:
            self._queue = WorkQueue(
                self._reconcile_key,
                workers=self.settings.max_concurrent_reconciles,
                max_backoff=self.settings.retry_max_seconds,
            )
            if self.settings.janitor_scrape_interval > 0:
                scrape = self.scraper.run(self.settings.janitor_scrape_interval, self.indexes)
                self._spawn(scrape)
        return self._queue

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)  # keep a reference until done, or the task may be garbage-collected
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ reconcile

    async def _reconcile_key(self, key: Key) -> None:
        deployment = self.indexes.deployment(key)  # the latest state; none if deleted
        if deployment is None:
            return
        body = kopf.Body(deployment.document())  # type: ignore[arg-type]  # kopf types its RawBody as a TypedDict
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
        key: Key = (body.metadata.namespace or "", body.metadata.name or "")
        started = time.perf_counter()
        try:
            planned = self.plans.plan(body)
        except SpecError as error:
            self.metrics.mark_invalid(*key)
            await self.status.report_invalid(key, body, error)
            self.metrics.observe_reconcile("invalid", time.perf_counter() - started)
            return
        self.metrics.forget_invalid(*key)
        self.metrics.observe_stage("plan", time.perf_counter() - started)
        try:
            # The status goes out with the children, not after them: it is computed from the
            # indexes, which show none of this reconcile's writes yet either way.
            refused, _ = await asyncio.gather(
                self._converge(key, body, planned), self._write_status(key, body, planned)
            )
            if self.status.refused(key, (refused.reason, str(refused)) if refused else None):
                if refused is not None:
                    self._warn(body, refused.reason, str(refused))
                await self.status.write(key, body, planned, self.indexes)  # said until a write goes
            if refused is not None:
                raise refused
            # After the status: a refused pod patch (an older chart's RBAC) must not hide it.
            await self.status.open_gates(key, planned, self.indexes)
        except Exception:
            self.metrics.observe_reconcile("error", time.perf_counter() - started)
            raise
        self.metrics.observe_reconcile("success", time.perf_counter() - started)

    async def _converge(self, key: Key, body: kopf.Body, planned: Planned) -> WriteRefused | None:
        """The children converged, timed; a child that could not be written is returned, not raised."""
        began = time.perf_counter()
        try:
            indexed = self.indexes.children(key)
            owner = body.metadata.uid or ""
            if await self.children.converge(key, owner, planned, lambda: self.plans.desired(body, planned), indexed):
                self.metrics.observe_stage("children", time.perf_counter() - began)
        except WriteRefused as refused:
            return refused
        return None

    async def _write_status(self, key: Key, body: kopf.Body, planned: Planned) -> None:
        began = time.perf_counter()
        if await self.status.write(key, body, planned, self.indexes):
            self.metrics.observe_stage("status", time.perf_counter() - began)
