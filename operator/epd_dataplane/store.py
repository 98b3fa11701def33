"""Each picture encoded once per weights version: what the proxy knows of its unit's EC store
(placement Unit, ECExampleConnector), and one prime per key at a time.

Every media part the proxy forwards carries a key, ``epd_client``'s own: a hash of the weights
version, the part's kind and its content (``media_key``), which vLLM uses as the part's store
name when the request gives no hash factors (``get_mm_hashes``). So before priming a part the
proxy can look in the store, `<store>/<name>/encoder_cache.safetensors`, and skip the prime of a
part the unit already holds:

- **Leases.** Found or primed, a key is leased (ec/leases.py) until the request is done: the
  janitor evicts no entry the consumer is about to read.
- **One prime per key.** A key being primed for one request is not primed again for another:
  the others wait for that prime (a flight) and share its outcome.
- **Generations.** vLLM's encoder looks in its own memory before the EC store: an encoder that
  still holds an evicted key's embedding answers its prime without writing the file again. So a
  prime is checked: no file, and the key's next generation (``<key>-1``, a name the encoder
  does not remember) is primed instead. The proxy remembers which generation of a key it
  stored last and starts there next time; generations wrap around after GENERATIONS (an
  encoder's memory is bounded: by then it forgot the first).
- **Names that are not keys.** A model whose processor hashes on its own (vLLM's h2ovl,
  deepseek_vl2 ...) or an engine with ``media_io_kwargs`` names entries otherwise. Until a
  prime stored an entry under its key, or the store shows one, the proxy does not know which:
  when two primes in a row store nothing under new names and no entry is named by a key, the
  store is marked unverified, and from then on every part is primed, as without a store (a
  warning and ``epd_proxy_store_verified 0`` say so).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from epd_client import MediaFailure, MediaItem, PrimeError, RequestError, is_key, key_generation, key_of
from epd_operator.ec.leases import EMBEDDING_FILE, Leases

logger = logging.getLogger("epd_dataplane")

GENERATIONS = 16
# Keys whose last stored generation the proxy remembers (LRU): about 100 bytes each.
REMEMBERED_KEYS = 65_536
# How long a lookup waits for the janitor's exclusive hold before trying again.
LOCK_RETRY_SECONDS = 0.002

# Prime one item (a part keyed with the name to prime it under): raises PrimeError.
PrimeOne = Callable[[MediaItem], Awaitable[None]]


class StoreView:
    """The unit's EC store, read by the proxy: which names hold an embedding, and its leases."""

    def __init__(self, path: str, leases: Leases) -> None:
        self.path = path.rstrip("/")
        self.leases = leases
        self.verified = True
        """False once the entries proved to be named otherwise than by the keys."""
        self.named_by_keys = False
        """True once an entry named by a key was seen: a prime that stores nothing is then the
        encoder's memory, never a naming of its own."""
        self.unexplained = 0  # primes in a row that stored nothing while the naming was unknown

    def holds(self, name: str) -> bool:
        return os.path.exists(os.path.join(self.path, name, EMBEDDING_FILE))

    def names_keys(self) -> bool:
        """Whether some entry of the store is named by one of our keys (vLLM names entries by
        the uuids the proxy writes); read only when a prime stored nothing."""
        try:
            with os.scandir(self.path) as listing:
                return any(is_key(key_of(entry.name)) for entry in listing)
        except FileNotFoundError:
            return False

    def stored_name(self, key: str) -> str | None:
        """The first generation of ``key`` that holds an embedding."""
        for generation in range(GENERATIONS):
            name = key_generation(key, generation)
            if self.holds(name):
                return name
        return None

    async def lease_and_find(self, keys: Sequence[str]) -> dict[str, str | None]:
        """Lease every key (once each), then look each up: its stored name, or None. Both
        under the store's lock, so no entry found here is evicted before ``release``."""
        while not self.leases.try_shared():
            await asyncio.sleep(LOCK_RETRY_SECONDS)
        try:  # no await in here: the process's coroutines share its one lock
            found = {}
            for key in keys:
                self.leases.hold(key)
                found[key] = self.stored_name(key)
            return found
        finally:
            self.leases.unlock()

    def release(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.leases.release(key)


@dataclass
class _Flight:
    task: asyncio.Task[str]
    waiters: int = 0


@dataclass
class Outcome:
    """Where each part of a request is read from, once its media are found or primed."""

    names: list[str]
    """Per part, the store name it is forwarded with (its ``uuid``)."""
    leased: list[str]
    """The keys leased for the request: ``StoreView.release`` them once it is done."""
    stored: list[str]
    """The types of the parts the store held already: not primed."""
    waited: int = 0
    """Parts another request was priming: waited for, not primed again."""


class Flights:
    """One prime per key at a time: the first request for a key primes it (until an embedding
    is stored under one of its generations), later ones wait for that and share its outcome. A
    flight whose every waiter left (clients gone) is cancelled. ``on_prime(kind, regenerated)``
    is called for each prime that succeeded (``regenerated``: it stored nothing)."""

    def __init__(self, store: StoreView, on_prime: Callable[[str, bool], None] = lambda kind, again: None) -> None:
        self.store = store
        self.on_prime = on_prime
        self._flights: dict[str, _Flight] = {}
        self._next: collections.OrderedDict[str, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._flights)

    async def resolve(self, items: Sequence[tuple[str, MediaItem]], prime: PrimeOne, unit: str) -> Outcome:
        """Each (key, item) to the name its embedding is stored under: found, primed here, or
        primed by a flight under way. Raises PrimeError naming every part (its index in
        ``items``) that could not be primed; the keys are leased on return only."""
        keys = list(dict.fromkeys(key for key, _ in items))
        leased = self.store.verified
        found = await self.store.lease_and_find(keys) if leased else dict.fromkeys(keys)
        try:
            return await self._resolve(items, found, prime, unit, keys if leased else [])
        except BaseException:
            if leased:
                self.store.release(keys)
            raise

    async def _resolve(
        self,
        items: Sequence[tuple[str, MediaItem]],
        found: dict[str, str | None],
        prime: PrimeOne,
        unit: str,
        leased: list[str],
    ) -> Outcome:
        waits: dict[str, Awaitable[str]] = {}
        started = 0
        for key, item in items:
            if found[key] is not None or key in waits:
                continue
            flight = self._flights.get(key)
            if flight is None:
                task = asyncio.create_task(self._fly(key, item, prime))
                flight = self._flights[key] = _Flight(task)
                task.add_done_callback(functools.partial(self._landed, key))
                started += 1
            waits[key] = self._wait(flight)
        results = await asyncio.gather(*waits.values(), return_exceptions=True)
        resolved: dict[str, str | BaseException | None] = {**found, **dict(zip(waits, results, strict=True))}
        names, failures = [], []
        for index, (key, item) in enumerate(items):
            result = resolved[key]
            if isinstance(result, PrimeError):
                failure = result.failures[0]
                failures.append(MediaFailure(index, failure.url, failure.encoders, failure.error, item.kind))
            elif isinstance(result, BaseException):
                raise result
            else:
                assert result is not None
                names.append(result)
        if failures:
            raise PrimeError(unit, len(items), failures)
        stored = [item.kind for key, item in items if found[key] is not None]
        return Outcome(names, leased, stored, waited=len(waits) - started)

    def _landed(self, key: str, task: asyncio.Task[str]) -> None:
        if self._flights.get(key) is not None and self._flights[key].task is task:
            del self._flights[key]

    async def _wait(self, flight: _Flight) -> str:
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()

    async def _fly(self, key: str, item: MediaItem, prime: PrimeOne) -> str:
        """Prime ``key``'s generations until one stores an embedding (the key's lease protects
        each as it appears), from the one after the generation stored last."""
        start = self._next.get(key, 0)
        for step in range(GENERATIONS):
            generation = (start + step) % GENERATIONS
            name = key_generation(key, generation)
            await prime(MediaItem({**item.part, "uuid": name}, item.kind, item.source, item.message, item.position))
            if not self.store.verified:
                self.on_prime(item.kind, False)
                return name
            store = self.store
            if store.holds(name):
                self.on_prime(item.kind, False)
                self._remember(key, (generation + 1) % GENERATIONS)
                store.named_by_keys, store.unexplained = True, 0
                return name
            self.on_prime(item.kind, True)
            store.named_by_keys = store.named_by_keys or store.names_keys()
            store.unexplained = 0 if store.named_by_keys else store.unexplained + 1
            if store.unexplained >= 2:
                store.verified = False
                logger.warning(
                    "%s was primed and stored under another name, as is every entry of %s: this model's vLLM names "
                    "its EC store entries otherwise (a processor that hashes on its own, or the engines' "
                    "media_io_kwargs). Every part is primed from now on, without looking in the store.",
                    name,
                    self.store.path,
                )
                return name
            logger.info("the encoder answered the prime of %s and stored nothing (it held it in memory)", name)
        reason = f"the encoders answered {GENERATIONS} primes of it under new names and stored none of them"
        error = RequestError("/v1/chat/completions", (), attempts=GENERATIONS, reason=reason)
        url = item.source if len(item.source) <= 80 else item.source[:79] + "…"
        raise PrimeError("encoders", 1, [MediaFailure(0, url, (), error, item.kind)])

    def _remember(self, key: str, generation: int) -> None:
        self._next[key] = generation
        self._next.move_to_end(key)
        if len(self._next) > REMEMBERED_KEYS:
            self._next.popitem(last=False)


@dataclass
class _Grant:
    keys: list[str]
    carriers: int = 0
    expired: bool = False
    timer: asyncio.TimerHandle | None = None


class Grants:
    """Leases handed to clients that prime through the proxy and render and generate after
    (``POST /epd/v1/prime``: epd_client): their keys stay leased for the seconds asked, and as
    long as a request naming the grant (header ``X-EPD-Lease``) is under way, so the consumer
    reads what was primed however long the request queued. At most ``max_keys`` keys at once
    are held so: leases keep the janitor from evicting, and the store must stay within its
    budget."""

    def __init__(self, store: StoreView, max_keys: int) -> None:
        self.store = store
        self.max_keys = max_keys
        self._grants: dict[str, _Grant] = {}
        self._keys = 0

    def __len__(self) -> int:
        return len(self._grants)

    def room(self, keys: int) -> bool:
        return self._keys + keys <= self.max_keys

    def grant(self, keys: list[str], seconds: float) -> str:
        """Take over the leases of ``keys`` (held once each by the caller) for ``seconds``."""
        lease = os.urandom(12).hex()
        grant = self._grants[lease] = _Grant(keys)
        self._keys += len(keys)
        grant.timer = asyncio.get_running_loop().call_later(seconds, self._expire, lease)
        return lease

    def carry(self, lease: str | None) -> _Carry:
        """The block of a request naming ``lease``: the grant outlives it (unknown names: none)."""
        return _Carry(self, self._grants.get(lease) if lease else None, lease)

    def close(self) -> None:
        for lease in list(self._grants):
            self._end(lease)

    def _expire(self, lease: str) -> None:
        grant = self._grants.get(lease)
        if grant is None:
            return
        grant.expired = True
        if grant.carriers == 0:
            self._end(lease)

    def _end(self, lease: str) -> None:
        grant = self._grants.pop(lease)
        if grant.timer is not None:
            grant.timer.cancel()
        self._keys -= len(grant.keys)
        self.store.release(grant.keys)


class _Carry:
    def __init__(self, grants: Grants, grant: _Grant | None, lease: str | None) -> None:
        self.grants, self.grant, self.lease = grants, grant, lease

    def __enter__(self) -> None:
        if self.grant is not None:
            self.grant.carriers += 1

    def __exit__(self, *exc_info: object) -> None:
        grant = self.grant
        if grant is None:
            return
        grant.carriers -= 1
        if grant.expired and grant.carriers == 0 and self.lease in self.grants._grants:
            self.grants._end(self.lease)
