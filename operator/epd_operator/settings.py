"""The operator's settings, built once at start from the command line and the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata

from .validation import Limits

# The Helm chart sets this to the operator's own image; each unit's EC janitor runs from it.
IMAGE_ENV = "EPD_OPERATOR_IMAGE"
# ...and this to the namespace the operator runs in: each NetworkPolicy lets it read the janitors.
NAMESPACE_ENV = "EPD_OPERATOR_NAMESPACE"


def own_namespace() -> str | None:
    return os.environ.get(NAMESPACE_ENV) or None


def own_image() -> str:
    """The operator's image: $EPD_OPERATOR_IMAGE, else the name the project's own build gives it
    (`make image`: epd-operator:<version>), never a guessed registry."""
    return os.environ.get(IMAGE_ENV) or f"epd-operator:{metadata.version('epd-operator')}"


@dataclass(frozen=True)
class Settings:
    janitor_image: str
    """Image of each unit's EC janitor container (`epd-operator janitor`): the operator's own."""
    janitor_scrape_interval: float = 30.0
    """Seconds between two rounds of scrapes of the units' janitors (0: off)."""
    janitor_scrape_rate: float = 10.0
    """Janitors scraped a second at most: bounds the scrape's CPU however many units there are
    (a round of N units takes N / rate seconds)."""
    max_concurrent_reconciles: int = 16
    """Reconciles at once, as controller-runtime's MaxConcurrentReconciles: enough to keep the
    API client's 16 connections busy."""
    retry_max_seconds: float = 60.0
    """Longest backoff of a failing reconcile."""
    status_debounce_seconds: float = 0.2
    """Pod events come in bursts (all containers of a unit flip at once): coalesce them."""
    status_seconds_per_unit: float = 0.005
    """A status that moves only counts and messages is written at most every `units` x this many
    seconds (5 s at 1,000 units, at most 30 s); one that flips a phase or condition goes at once."""
    created_settle_seconds: float = 5.0
    """How long a child this operator created counts as existing while no watch event of it has
    come (a loaded API server delivers it well within a second)."""
    operator_namespace: str | None = None
    """Where the operator runs (if it knows): the NetworkPolicies admit it to the janitors' metrics."""
    limits: Limits = field(default_factory=Limits)
    """Bounds every spec is held to beyond the CRD's (validation.Limits)."""
    plan_cache_size: int = 4096
    """Validated specs and their children's hashes kept (one per EPDDeployment generation,
    about 1.5 KB each); past it a child's event queues a reconcile that finds nothing to do."""
