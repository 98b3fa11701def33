"""kopf's gate that holds every handler until every index is filled, made linear in the objects.

At start, kopf makes a toggle in one ToggleSet for each object it lists of an indexed kind, drops
it once the object is indexed, and has the worker of every object listed so far wait on the set.
kopf 1.45's ToggleSet wakes every waiting worker on each of those changes, though the gate opens
only once: with n objects that is n^2 wake-ups (each re-taking the set's lock), which kept an
operator restarted beside 1,000 EPDDeployments (7,000 watched objects) from reconciling anything
for over ten minutes on a 2-core machine (docs/performance.md). `install` replaces kopf's class by
one that wakes the waiters only when the set's state changes, which is all they wait for, as
long as kopf's module is the one it was written against (kopf_source.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from kopf._cogs.aiokits import aiotoggles  # kopf's own module: nothing public to hook into

from . import kopf_source

# kopf 1.45.2's aiotoggles.py (kopf_source.py).
AIOTOGGLES_SHA256 = "8308730e8c42c15fc975c4900bad8ab12589f654f699feff5a25f3032416e444"


class QuietToggleSet(aiotoggles.ToggleSet):
    """A ToggleSet whose additions and removals wake its waiters only when they turn it on or
    off. (A member toggle turned wakes them as before: toggles notify the set's condition.)"""

    async def make_toggle(self, value: bool = False, /, *, name: str | None = None) -> aiotoggles.Toggle:
        toggle = aiotoggles.Toggle(value, name=name, condition=self._condition)
        async with self._condition:
            before = self.is_on()
            self._toggles.add(toggle)
            if self.is_on() != before:
                self._condition.notify_all()
        return toggle

    async def drop_toggle(self, toggle: aiotoggles.Toggle) -> None:
        await self.drop_toggles([toggle])

    async def drop_toggles(self, toggles: Iterable[aiotoggles.Toggle]) -> None:
        async with self._condition:
            before = self.is_on()
            self._toggles.difference_update(toggles)
            if self.is_on() != before:
                self._condition.notify_all()


def install() -> bool:
    """Make kopf build its ToggleSets as QuietToggleSet (before kopf.run); False, and kopf's
    own class, if kopf's module is not the one this was written against."""
    if not kopf_source.unchanged(aiotoggles, AIOTOGGLES_SHA256, "the quiet indexing gate"):
        return False
    aiotoggles.ToggleSet = QuietToggleSet  # type: ignore[misc]  # kopf's class, replaced on purpose: its source is pinned
    return True
