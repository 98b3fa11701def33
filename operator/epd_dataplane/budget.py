"""The memory the proxy lets primed requests take at once (``--max-buffered-bytes``): each
reserves what its body will cost before reading it, waiting in line for room, so any number of
clients sending large bodies at once cannot take the proxy past its container's memory limit."""

from __future__ import annotations

import asyncio
from collections import deque


class Budget:
    """A byte budget shared first come, first served: ``reserve`` waits until the bytes fit and
    no earlier reservation waits (a large request is not passed over for ever by small ones)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def try_reserve(self, size: int) -> Reservation | None:
        """Hold ``size`` bytes (at most ``total``) if they fit now and no one waits, else None."""
        size = min(size, self.total)
        if self._waiting or size > self.free:
            return None
        self.free -= size
        return Reservation(self, size)

    async def reserve(self, size: int) -> Reservation:
        """Hold ``size`` bytes (at most ``total``) once they fit; cancelling the wait gives up."""
        if (reservation := self.try_reserve(size)) is not None:
            return reservation
        size = min(size, self.total)
        waiter = asyncio.get_running_loop().create_future()
        entry = (size, waiter)
        self._waiting.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled
                self._give_back(size)
            else:
                if entry in self._waiting:
                    self._waiting.remove(entry)
                self._wake()
            raise
        return Reservation(self, size)

    def _give_back(self, size: int) -> None:
        self.free += size
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            size, waiter = self._waiting.popleft()
            if waiter.done():  # cancelled: its reserve() takes it out of line
                continue
            self.free -= size
            waiter.set_result(None)


class Reservation:
    """Bytes held from a Budget until ``release`` (``resize`` changes them in place)."""

    __slots__ = ("_budget", "size")

    def __init__(self, budget: Budget, size: int) -> None:
        self._budget = budget
        self.size = size

    def resize(self, size: int) -> bool:
        """Hold ``size`` bytes instead, at once: False (nothing changed) when more do not fit now,
        since waiting while holding could deadlock with other growing requests."""
        budget = self._budget
        if size > self.size and (size - self.size > budget.free or budget._waiting):
            return False
        budget.free += self.size - size
        self.size = size
        budget._wake()
        return True

    def release(self) -> None:
        if self.size:
            self._budget._give_back(self.size)
            self.size = 0
