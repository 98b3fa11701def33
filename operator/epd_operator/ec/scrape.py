"""The operator's side of the janitors: scrape their budget evictions, tell the user.

The janitor has no API access (docs/ec-storage.md), so the operator scrapes its /metrics
(`JanitorScraper`), parses them (`parse_metrics`, pure) and turns a growing budget-eviction
counter into an `ECEvicted` Event message (`eviction_report`, pure). The count also goes into the
unit's status (`ecEvictions`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ..api import JANITOR_METRICS_PORT
from .quantity import human_bytes


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JanitorMetrics:
    """One janitor's stores, summed (a unit serves one model, so in practice one store)."""

    budget_evictions: int  # since the janitor started: the counter restarts with the container
    store_bytes: int
    budget_bytes: int


def parse_metrics(text: str) -> JanitorMetrics | None:
    """The janitor's figures from its Prometheus text; None if the text has none of them
    (something else answers on the port). Raises ValueError for text that is not Prometheus'."""
    totals = {"epd_ec_evictions_total": 0.0, "epd_ec_store_bytes": 0.0, "epd_ec_store_budget_bytes": 0.0}
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in totals or sample.labels.get("reason", "budget") != "budget":
                continue  # only the eviction counter has a reason label
            totals[sample.name] += sample.value
            found = True
    if not found:
        return None
    return JanitorMetrics(
        budget_evictions=int(totals["epd_ec_evictions_total"]),
        store_bytes=int(totals["epd_ec_store_bytes"]),
        budget_bytes=int(totals["epd_ec_store_budget_bytes"]),
    )


def eviction_report(unit: str, previous: int | None, current: JanitorMetrics) -> str | None:
    """The Event message when `unit`'s budget evictions grew since `previous`, else None.

    `previous` is the count last reported: the operator's memory, or after an operator restart
    the unit's `ecEvictions` in the status, so a restart does not repeat old Events. None means
    never reported: a unit first seen with evictions reports them all, since its counter starts
    at 0 with the janitor and the operator has not told anyone yet. A count below `previous` is
    a new janitor (a recreated pod of the same name, or a restarted container): its whole count
    is new.
    """
    count = current.budget_evictions
    restarted = previous is None or count < previous
    new = count if restarted else count - previous
    if new <= 0:
        return None
    since = "since its janitor started" if restarted else "since the last report"
    return (
        f"unit {unit}: {new} EC entries evicted for budget {since}; the store holds "
        f"{human_bytes(current.store_bytes)} of its {human_bytes(current.budget_bytes)} budget. Consumers re-encode "
        "evicted images: raise ecStorage.maxBytes (and shm.sizeLimit) if this keeps happening"
    )


Key = tuple[str, str]  # (namespace, EPDDeployment name)
Warn = Callable[[Any, str, str], None]  # (body, reason, message): posts a Warning Event


class JanitorScraper:
    """Scrapes every running unit's janitor and remembers its budget evictions by unit.

    `warn` posts an Event on an EPDDeployment; `changed` is told the key of every deployment
    whose counts changed, so its status is written again.
    """

    def __init__(self, *, warn: Warn, changed: Callable[[Key], None], port: int = JANITOR_METRICS_PORT,
                 concurrency: int = 16) -> None:
        self._warn = warn
        self._changed = changed
        self._port = port
        self._concurrency = concurrency
        self._evictions: dict[Key, dict[str, int]] = {}

    def evictions(self, key: Key) -> Mapping[str, int]:
        """Budget evictions by unit pod name, for the units of `key` scraped so far."""
        return self._evictions.get(key, {})

    async def run(self, interval: float, deployments: Mapping[Key, Any], unit_pods: Mapping[Key, Any]) -> None:
        """Scrape every `interval` seconds until cancelled; `deployments` and `unit_pods` are
        the operator's live indexes."""
        # Short: an unreachable janitor (a pod just gone, kwok's fake pod IPs) must not hold up a round.
        timeout = aiohttp.ClientTimeout(total=3, connect=1)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self.scrape(session, deployments, unit_pods)
                except Exception:  # a bug in one round must not end the reporting for good
                    logger.exception("scraping the EC janitors failed")
                await asyncio.sleep(interval)

    async def scrape(self, session: aiohttp.ClientSession, deployments: Mapping[Key, Any],
                     unit_pods: Mapping[Key, Any]) -> None:
        """One round: scrape every running unit's janitor, warn where its budget evictions grew,
        and report deployments whose counts changed. Janitors that do not answer keep their last
        count; units no longer running are forgotten."""
        targets = {
            (key, pod["name"]): ip for key, pods in unit_pods.items() for pod in pods if (ip := _janitor_ip(pod))
        }
        limit = asyncio.Semaphore(self._concurrency)

        async def scrape(ip: str) -> JanitorMetrics | None:
            async with limit:
                try:
                    async with session.get(f"http://{ip}:{self._port}/metrics") as response:
                        response.raise_for_status()
                        return parse_metrics(await response.text())
                except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                    logger.debug(f"janitor at {ip} not scraped: {error!r}")  # normal while pods come and go
                    return None

        results = await asyncio.gather(*(scrape(ip) for ip in targets.values()))
        changed = set()
        for (key, unit), current in zip(targets, results, strict=True):
            if current is None:
                continue
            counts = self._evictions.setdefault(key, {})
            previous = counts[unit] if unit in counts else _reported(deployments, key, unit)
            if message := eviction_report(unit, previous, current):
                for body in deployments.get(key, []):
                    self._warn(body, "ECEvicted", message)
            if counts.get(unit) != current.budget_evictions:
                counts[unit] = current.budget_evictions
                changed.add(key)
        for key, counts in list(self._evictions.items()):
            gone = [unit for unit in counts if (key, unit) not in targets]
            for unit in gone:
                del counts[unit]
            if gone:
                changed.add(key)
            if not counts:
                del self._evictions[key]
        for key in changed:
            self._changed(key)


def _janitor_ip(pod: dict[str, Any]) -> str | None:
    """Where to scrape the unit's janitor: only a Running pod that has one can answer."""
    status = pod.get("status", {})
    has_janitor = any(c.get("name") == "janitor" for c in status.get("containerStatuses") or [])
    return status.get("podIP") if status.get("phase") == "Running" and has_janitor else None


def _reported(deployments: Mapping[Key, Any], key: Key, unit: str) -> int | None:
    """The count the status shows for `unit`: what this or an earlier operator process reported."""
    for body in deployments.get(key, []):
        for model in body.get("status", {}).get("models") or []:
            for status in model.get("units") or []:
                if status.get("name") == unit:
                    return status.get("ecEvictions")
    return None
