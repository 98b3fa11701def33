"""The operator's side of the janitors: scrape their counters, tell the user.

The janitor has no API access (docs/ec-storage.md), so the operator scrapes its /metrics
(`JanitorScraper`), parses them (`parse_metrics`, pure) and turns a growing counter into a Warning
Event message (pure): budget evictions into `ECEvicted` (`eviction_report`), consumers' fallback
encodes into `ECFallbackEncodes` (`fallback_report`). Their sums go into each model's status
(`ecEvictions`, `fallbackEncodes`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..api import JANITOR_METRICS_PORT
from ..events import Post
from ..indexes import Indexes, Key
from .quantity import human_bytes

logger = logging.getLogger(__name__)

# A janitor's /metrics is a few KiB; a pod answering more is not one, and is not read further.
MAX_METRICS_BYTES = 2**20


@dataclass(frozen=True)
class JanitorMetrics:
    """One janitor's stores, summed (a unit serves one model, so in practice one store).
    The counters count since the janitor started: they restart with the container."""

    budget_evictions: int
    store_bytes: int
    budget_bytes: int
    fallback_encodes: int | None = None  # None from a janitor older than this count


def parse_metrics(text: str) -> JanitorMetrics | None:
    """The janitor's figures from its Prometheus text; None if the text has none of them
    (something else answers on the port). Raises ValueError for text that is not Prometheus'."""
    wanted = {
        "epd_ec_evictions_total",
        "epd_ec_store_bytes",
        "epd_ec_store_budget_bytes",
        "epd_ec_fallback_encodes_total",
    }
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in wanted or sample.labels.get("reason", "budget") != "budget":
                continue  # only the eviction counter has a reason label
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if not totals:
        return None
    fallbacks = totals.get("epd_ec_fallback_encodes_total")
    return JanitorMetrics(
        budget_evictions=int(totals.get("epd_ec_evictions_total", 0)),
        store_bytes=int(totals.get("epd_ec_store_bytes", 0)),
        budget_bytes=int(totals.get("epd_ec_store_budget_bytes", 0)),
        fallback_encodes=None if fallbacks is None else int(fallbacks),
    )


def _growth(previous: int | None, count: int) -> tuple[int, str]:
    """How much a janitor's counter grew since `previous`, the count last reported, and since when.

    `previous` is the operator's memory, or after an operator restart the first count it scrapes
    (JanitorScraper.scrape), so a restart does not repeat old Events. None means never reported:
    a unit first seen reports its whole count, since its counter starts at 0 with the janitor and
    the operator has not told anyone yet. A count below `previous` is a new janitor (a recreated
    pod of the same name, or a restarted container): its whole count is new.
    """
    if previous is None or count < previous:
        return count, "since its janitor started"
    return count - previous, "since the last report"


def eviction_report(unit: str, previous: int | None, current: JanitorMetrics) -> str | None:
    """The `ECEvicted` message when `unit`'s budget evictions grew since `previous` (see
    `_growth`), else None."""
    new, since = _growth(previous, current.budget_evictions)
    if new <= 0:
        return None
    return (
        f"unit {unit}: {new} EC entries evicted for budget {since}; the store holds "
        f"{human_bytes(current.store_bytes)} of its {human_bytes(current.budget_bytes)} budget. Consumers re-encode "
        "evicted images: raise ecStorage.maxBytes (and shm.sizeLimit) if this keeps happening"
    )


def fallback_report(unit: str, previous: int | None, current: JanitorMetrics) -> str | None:
    """The `ECFallbackEncodes` message when `unit`'s fallback encodes grew since `previous` (see
    `_growth`), else None."""
    if current.fallback_encodes is None:
        return None
    new, since = _growth(previous, current.fallback_encodes)
    if new <= 0:
        return None
    return (
        f"unit {unit}: {new} {'image' if new == 1 else 'images'} encoded by its consumers themselves {since}: "
        "their embeddings were not in the EC store (vLLM falls back silently, only slower). Prime each image on "
        "this unit's encoder before sending the request to the same unit, with the same model and processor "
        "kwargs; the janitor's fallback_encodes log lines name the mm_hashes (docs/operations.md)"
    )


class Counts(NamedTuple):
    """A unit's janitor counters, as last reported."""

    budget_evictions: int | None
    fallback_encodes: int | None


class JanitorScraper:
    """Scrapes every running unit's janitor and remembers its counters by unit.

    `warn` posts an Event on an EPDDeployment; `changed` is told the key of every deployment
    whose counts changed, so its status is written again. At most `rate` janitors are scraped a
    second: a scrape costs the operator 0.2 to 0.8 ms of CPU (measured on the 2-core development
    machine), so at 5,000 units a round every 30 s would keep it 3 to 13 % busy for good; at 10 a
    second it costs under 1 % whatever the number of units, and a round of N units takes N / rate
    seconds (500 s at 5,000).
    """

    def __init__(
        self, *, warn: Post, changed: Callable[[Key], None], port: int = JANITOR_METRICS_PORT, rate: float = 10.0
    ) -> None:
        if rate <= 0:
            raise ValueError("rate (janitors scraped per second) must be positive")
        self._warn = warn
        self._changed = changed
        self._port = port
        self._rate = rate
        self._counts: dict[Key, dict[str, Counts]] = {}

    def evictions(self, key: Key) -> Mapping[str, int]:
        """Budget evictions by unit pod name, for the units of `key` scraped so far."""
        return {
            unit: c.budget_evictions for unit, c in self._counts.get(key, {}).items() if c.budget_evictions is not None
        }

    def fallback_encodes(self, key: Key) -> Mapping[str, int]:
        """Consumers' fallback encodes by unit pod name, for the units of `key` scraped so far."""
        return {
            unit: c.fallback_encodes for unit, c in self._counts.get(key, {}).items() if c.fallback_encodes is not None
        }

    async def run(self, interval: float, indexes: Indexes) -> None:
        """Scrape every `interval` seconds until cancelled; `indexes` are the operator's live ones."""
        # Short: an unreachable janitor (a pod just gone, kwok's fake pod IPs) must not hold up a round.
        timeout = aiohttp.ClientTimeout(total=3, connect=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self.scrape(session, indexes)
                except Exception:  # a bug in one round must not end the reporting for good
                    logger.exception("scraping the EC janitors failed")
                await asyncio.sleep(interval)

    async def scrape(self, session: aiohttp.ClientSession, indexes: Indexes) -> None:
        """One round: scrape every running unit's janitor, warn where its budget evictions or
        fallback encodes grew, and report deployments whose counts changed. Janitors that do not
        answer keep their last counts; units no longer running are forgotten."""
        targets = {
            (key, pod.name): ip
            for key in list(indexes.pods)
            for pod in indexes.owned_pods(key)
            if (ip := _janitor_ip(pod.tree()))
        }

        async def scrape(ip: str) -> JanitorMetrics | None:
            try:
                async with session.get(f"http://{ip}:{self._port}/metrics") as response:
                    response.raise_for_status()
                    body = await response.content.read(MAX_METRICS_BYTES + 1)
                    if len(body) > MAX_METRICS_BYTES:
                        raise ValueError(f"more than {MAX_METRICS_BYTES} bytes: not a janitor's few metrics")
                    return parse_metrics(body.decode("utf-8", errors="replace"))
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                logger.debug("janitor at %s not scraped: %r", ip, error)  # normal while pods come and go
                return None

        scrapes: list[asyncio.Task[JanitorMetrics | None]] = []
        async with asyncio.TaskGroup() as group:  # cancelled with the round: no scrape outlives it
            for ip in targets.values():
                if scrapes:
                    await asyncio.sleep(1 / self._rate)
                scrapes.append(group.create_task(scrape(ip)))
        results = [done.result() for done in scrapes]
        changed = set()
        # A deployment whose status has counts but that this process has not scraped yet: an
        # earlier process reported them, so this first round is the baseline, not news.
        reported = {key: _reported(indexes, key) for key, _ in targets if key not in self._counts}
        for (key, unit), current in zip(targets, results, strict=True):
            if current is None:
                continue
            counts = self._counts.setdefault(key, {})
            if unit in counts:
                previous = counts[unit]
            else:
                evictions, fallbacks = reported.get(key, (False, False))
                previous = Counts(
                    current.budget_evictions if evictions else None, current.fallback_encodes if fallbacks else None
                )
            for reason, message in (
                ("ECEvicted", eviction_report(unit, previous.budget_evictions, current)),
                ("ECFallbackEncodes", fallback_report(unit, previous.fallback_encodes, current)),
            ):
                deployment = indexes.deployment(key)
                if message and deployment is not None:
                    self._warn(deployment.reference, reason, message)
            now = Counts(current.budget_evictions, current.fallback_encodes)
            if counts.get(unit) != now:
                counts[unit] = now
                changed.add(key)
        for key, counts in list(self._counts.items()):
            gone = [unit for unit in counts if (key, unit) not in targets]
            for unit in gone:
                del counts[unit]
            if gone:
                changed.add(key)
            if not counts:
                del self._counts[key]
        for key in changed:
            self._changed(key)


def _janitor_ip(pod: dict[str, Any]) -> str | None:
    """Where to scrape the unit's janitor: only a Running pod that has one can answer."""
    status = pod.get("status", {})
    has_janitor = any(c.get("name") == "janitor" for c in status.get("containerStatuses") or [])
    return status.get("podIP") if status.get("phase") == "Running" and has_janitor else None


def _reported(indexes: Indexes, key: Key) -> tuple[bool, bool]:
    """Whether the deployment's status shows (budget evictions, fallback encodes): an operator
    process reported them."""
    deployment = indexes.deployment(key)
    models = (deployment.status() if deployment else {}).get("models") or []
    return (
        any(m.get("ecEvictions") is not None for m in models),
        any(m.get("fallbackEncodes") is not None for m in models),
    )
