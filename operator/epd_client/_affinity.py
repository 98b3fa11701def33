"""Which unit serves a request: rendezvous hashing with bounded load, the one implementation
behind ``EPDClient`` and the EPD gateway (``epd-dataplane gateway``), so that the client and the
gateway send a key to the same unit.

A key (a conversation, a session, or the weights-version key of a request's first media part)
prefers the unit of highest rendezvous weight, blake2b of ``key NUL unit``: stable while that
unit stays ready, and when a unit leaves only its own keys move. So the requests whose media a
unit primed go back to it, where its EC store holds their embeddings and its consumers' prefix
cache their prompt. A hot key must not overload its unit, though: with ``loads`` (requests in
flight per unit), a unit takes another request only while it has fewer than
``ceil(balance * (in flight + 1) / units)``, else the key's next unit in rendezvous order does
(consistent hashing with bounded loads, Mirrokni, Thorup and Zadimoghaddam, 2018): no unit
holds more than ``balance`` times the mean. Without a key, the least-loaded unit.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._media import MediaItem, media_key

# A unit may hold 25 % more than the mean of requests in flight (the bound of the benchmark).
BALANCE = 1.25


@dataclass(frozen=True)
class Choice:
    unit: str
    preferred: bool
    """Whether it is the key's own unit (the highest rendezvous weight of the ready units): False
    when the bound moved the request on (an affinity miss), and for a request without a key."""


def choose(
    key: str | None,
    units: Sequence[str],
    loads: Mapping[str, int] | None = None,
    *,
    balance: float = BALANCE,
    start: int = 0,
) -> Choice:
    """The unit of ``units`` (names, non-empty) that serves ``key``, given the requests in
    flight per unit (``loads``, missing: 0). Without a key the least loaded, ties broken from
    ``start`` on (so idle units take turns)."""
    if not units:
        raise ValueError("no unit to choose from")
    load = loads or {}
    if key is None:
        order = list(units[start % len(units) :]) + list(units[: start % len(units)])
        return Choice(min(order, key=lambda u: load.get(u, 0)), False)
    weight = weigher(key)
    preferred = max(units, key=weight)  # one pass: the usual answer
    if not load:
        return Choice(preferred, True)
    capacity = math.ceil(balance * (sum(load.get(u, 0) for u in units) + 1) / len(units))
    if load.get(preferred, 0) < capacity:
        return Choice(preferred, True)
    for unit in ranked(key, units)[1:]:
        if load.get(unit, 0) < capacity:
            return Choice(unit, False)
    return Choice(min(units, key=lambda u: load.get(u, 0)), False)  # cannot happen: the mean fits


def ranked(key: str, units: Sequence[str], limit: int | None = None) -> list[str]:
    """``units`` in ``key``'s rendezvous order (the first ``limit`` of them): its own unit first,
    then where it goes when the units before are gone or full (the EPD gateway's fallbacks)."""
    if limit is not None:
        return heapq.nlargest(limit, units, key=weigher(key))
    return sorted(units, key=weigher(key), reverse=True)


def weigher(key: str) -> Callable[[str], bytes]:
    """A unit's rendezvous weight for ``key``: blake2b of ``key NUL unit``. The key's prefix is
    hashed once and copied for each unit, which halves the cost over thousands of units."""
    prefix = hashlib.blake2b(f"{key}\0".encode(), digest_size=8)

    def weight(unit: str) -> bytes:
        hashed = prefix.copy()
        hashed.update(unit.encode())
        return hashed.digest()

    return weight


def affinity_key(
    items: Sequence[MediaItem],
    *,
    user: Any = None,
    session: str | None = None,
    weights_version: str | None = None,
) -> str | None:
    """What a request is placed by: its conversation (``session``, the ``X-EPD-Session``
    header, else the OpenAI ``user`` field), else its first media part (of ``items``, the
    request's media in order): its key for ``weights_version`` (content-only without one), the
    key the EPD proxy gives it whatever ``uuid`` the client set. A multi-turn
    conversation resends its first image at every turn, and a GRPO group sends one prompt n
    times. None for a text-only request without a conversation."""
    if session:
        return f"session:{session}"
    if isinstance(user, str) and user:
        return f"session:{user}"
    if not items:
        return None
    return media_key(items[0], weights_version or "")
