"""The child writer: an EPDDeployment's children brought to their desired state over kube.py.

A child neither the indexes nor the expectations show is created with a POST, the API server's
cheapest write (a StatefulSet or budget by POST costs it less than half a server-side apply
under load: docs/performance.md); one that exists is changed with server-side apply
(`fieldManager: epd-operator`, forced), after its POST's Update entry of managedFields was taken
over (managedfields.py) unless the index shows that done. Children already carrying their
desired state's hash are not written, nor even built; children of a removed model are deleted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from .expectations import Expectations
from .indexes import ChildSummary, Key, Ref, ServiceSummary
from .kube import KubeSession
from .managedfields import upgrade_to_apply
from .plans import Planned, ref
from .resources import ANNOTATION_SPEC_HASH, FIELD_MANAGER, is_headless


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
        planned: Planned,
        build: Callable[[], list[dict[str, Any]]],
        indexed: list[ChildSummary],
    ) -> bool:
        """Write the children not at their desired state (`build` makes them all, called only
        when one is stale) and delete those no model asks for; `indexed`: the children the
        watches show. True if it wrote anything."""
        unseen, lapses_in = self._expectations.unseen(key)
        if lapses_in is not None:
            self._requeue_after(key, lapses_in)
        existing = {**unseen, **{c.ref: c.spec_hash for c in indexed}}
        # Taken over by an apply already, as the watch shows it (one created again since may not be).
        applied = {c.ref for c in indexed if not c.owned_by_update} - unseen.keys()
        headless = {c.name: c.headless for c in indexed if isinstance(c, ServiceSummary)}
        stale = {r for r, digest in planned.digests.items() if existing.get(r) != digest}
        if stale:
            await asyncio.gather(
                *(self._write(key, c, existing.keys(), applied, headless) for c in build() if ref(c) in stale)
            )
        removed = existing.keys() - planned.digests.keys()
        for kind, name in removed:
            await self._session.client.delete(kind, key[0], name)
        return bool(stale or removed)

    async def _write(
        self,
        key: Key,
        child: dict[str, Any],
        existing: AbstractSet[Ref],
        applied: AbstractSet[Ref],
        headless: Mapping[str, bool],
    ) -> None:
        """POST a child not known to exist; apply one that does. An existing Service whose
        headlessness must flip is deleted, then created again (its clusterIP cannot change)."""
        kube = self._session.client
        kind, name = child_ref = ref(child)
        namespace = child["metadata"]["namespace"]
        flip = kind == "Service" and name in headless and headless[name] != is_headless(child)
        if flip:
            await kube.delete("Service", namespace, name)
        if (flip or child_ref not in existing) and await kube.create(child):
            self._expectations.created(key, child_ref, child["metadata"]["annotations"][ANNOTATION_SPEC_HASH])
            return
        if flip:
            return  # still there, going (a finalizer): its DELETED event queues the creation
        if child_ref not in applied:
            await self._own_by_apply(kind, namespace, name)
        await kube.apply(child)

    async def _own_by_apply(self, kind: str, namespace: str, name: str) -> None:
        """Before applying to a child this operator created by POST, turn its Update entry of
        managedFields into an Apply one, so the apply removes what it stops setting."""
        kube = self._session.client
        live = await kube.get(kind, namespace, name)
        if live is None:
            return
        upgraded = upgrade_to_apply(live["metadata"].get("managedFields") or [], FIELD_MANAGER)
        if upgraded is not None:
            await kube.replace_managed_fields(kind, namespace, name, live["metadata"]["resourceVersion"], upgraded)
