"""Children this operator created whose watch event has not come yet, as kube-controller-manager's
controllers keep "expectations".

Until its event comes the indexes do not show a new child, so a reconcile in between (a pod
event, a status refresh) would POST it again: refused, yet a Service's second POST allocates and
frees a ClusterIP under the API server's one allocation lock. Each expectation lapses after
`settle_seconds` (a loaded API server delivers the event well within a second); the child then
counts as missing again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .indexes import Key, Ref


class Expectations:
    def __init__(self, settle_seconds: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._settle = settle_seconds
        self._clock = clock
        self._created: dict[Key, dict[Ref, tuple[str, float]]] = {}  # -> (hash, lapses at)

    def created(self, key: Key, ref: Ref, digest: str) -> None:
        self._created.setdefault(key, {})[ref] = (digest, self._clock() + self._settle)

    def observed(self, key: Key, ref: Ref) -> None:
        """A watch event of this child came (added, changed or deleted): the indexes tell from now on."""
        created = self._created.get(key)
        if created is not None:
            created.pop(ref, None)
            if not created:
                del self._created[key]

    def unseen(self, key: Key) -> tuple[dict[Ref, str], float | None]:
        """The children still expected, with their hashes, and the seconds until the last of
        them lapses (None when none is expected): the caller looks again then."""
        created = self._created.get(key)
        if not created:
            return {}, None
        now = self._clock()
        for ref in [ref for ref, (_, until) in created.items() if until <= now]:
            del created[ref]
        if not created:
            del self._created[key]
            return {}, None
        return {ref: digest for ref, (digest, _) in created.items()}, max(u for _, u in created.values()) - now

    def forget(self, key: Key) -> None:
        self._created.pop(key, None)
