"""What a unit's janitor says about budget evictions, and what to tell the user: pure.

The janitor has no API access (docs/ec-storage.md), so the operator scrapes its /metrics
(controller.scrape_janitors), parses them here and turns a growing budget-eviction counter into
an `ECEvicted` Event message. The count also goes into the unit's status (`ecEvictions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from .janitor import _human


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
        f"{_human(current.store_bytes)} of its {_human(current.budget_bytes)} budget. Consumers re-encode "
        "evicted images: raise ecStorage.maxBytes (and shm.sizeLimit) if this keeps happening"
    )
