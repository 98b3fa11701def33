"""Prometheus metrics of the EPD proxy, served with /health on its own port (`--metrics-port`):
the proxy's main port passes every path through, the upstream's /metrics included."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector

from epd_client import MEDIA_KINDS

FAILURE_REASONS = ("client_error", "encoder_error", "no_encoder")


class ProxyMetrics:
    """The proxy's metrics, in a registry of their own (plus the usual process_* ones)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._requests = Counter(
            "epd_proxy_requests_total",
            "Requests answered, by route (chat_completions, responses, messages and the other routes that "
            "take media are primed, transcriptions and translations refused; health, the readiness probe's "
            "GET /health, and other pass through) and HTTP status code (the upstream's, or the proxy's own "
            "errors).",
            ["route", "code"],
            registry=self.registry,
        )
        # One child per (route, code) seen: labels() takes a lock and builds a key each call.
        self._request_children: dict[tuple[str, int], Counter] = {}
        self._media = Counter(
            "epd_proxy_media_primed_total",
            "Media parts primed on the encoders, by kind (image, video, audio).",
            ["kind"],
            registry=self.registry,
        )
        self._stored = Counter(
            "epd_proxy_media_stored_total",
            "Media parts not primed because the unit's EC store held their embedding already (primes "
            "skipped), by kind. With epd_proxy_media_primed_total: the unit's hit ratio.",
            ["kind"],
            registry=self.registry,
        )
        self._shared = Counter(
            "epd_proxy_prime_shared_total",
            "Media parts that waited for another request's prime of the same key instead of priming it again.",
            registry=self.registry,
        )
        # The autoscalers' signals (docs/autoscaling.md): summed over a model's proxies by Prometheus.
        self.primes_in_flight = Gauge(
            "epd_proxy_primes_in_flight",
            "Media parts being primed on the encoders now (each a prime request, waiting for its slot or under way, "
            "retries included): the encoder pool's load, which its autoscaler divides by the encoder pods.",
            registry=self.registry,
        )
        self.requests_in_flight = Gauge(
            "epd_proxy_requests_in_flight",
            "Requests the proxy is serving now (priming or forwarded; its readiness probes not counted): the "
            "unit's load, which the units' autoscaler divides by the units.",
            registry=self.registry,
        )
        self._replaced = Counter(
            "epd_proxy_client_uuids_replaced_total",
            "Media and embeddings parts whose client-chosen uuid the proxy replaced by the part's key (its "
            "content's and weights version's), by route: vLLM names a part by its uuid alone, so a uuid must never "
            "decide which embedding a part gets.",
            ["route"],
            registry=self.registry,
        )
        self._regenerated = Counter(
            "epd_proxy_prime_regenerated_total",
            "Primes an encoder answered without storing the embedding (it still held the key in its memory "
            "after the janitor evicted the file): the part was primed again under the key's next generation.",
            registry=self.registry,
        )
        self._leased = Gauge(
            "epd_proxy_leased_keys",
            "Keys the proxy leases now (the janitor evicts none of their entries): its requests' and its clients'.",
            registry=self.registry,
        )
        self._verified = Gauge(
            "epd_proxy_store_verified",
            "1 while the proxy trusts that the unit's EC store names entries by its keys (it looks before "
            "priming); 0 once a primed key was stored under another name (it primes every part).",
            registry=self.registry,
        )
        self._prime_seconds = Histogram(
            "epd_proxy_prime_duration_seconds",
            "Time to prime every media part of one request (all at once, retries included), "
            "what priming adds before the request is forwarded.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self._prime_failures = Counter(
            "epd_proxy_prime_failures_total",
            "Requests answered with an error and not forwarded because their media could not be "
            "primed: client_error (an encoder's 4xx: bad media URL, model, credentials), "
            "encoder_error (5xx, timeouts, connection errors once retries ran out), no_encoder.",
            ["reason"],
            registry=self.registry,
        )
        for reason in FAILURE_REASONS:
            self._prime_failures.labels(reason)
        self._encoders = Gauge(
            "epd_proxy_encoders",
            "Encoders the proxy primes on: its --encoder URLs, or the last DNS answer for --encoders-dns.",
            registry=self.registry,
        )
        self._ejected = Gauge(
            "epd_proxy_encoders_ejected",
            "Encoders left out of priming now, for failing prime requests in a row (outlier detection).",
            registry=self.registry,
        )
        self._ejections = Counter(
            "epd_proxy_encoder_ejections_total",
            "Times an encoder was left out of priming for failing prime requests in a row.",
            registry=self.registry,
        )
        self._dns_errors = Counter(
            "epd_proxy_encoder_dns_errors_total",
            "Failed resolutions of --encoders-dns other than 'no such name' (the last answer is kept).",
            registry=self.registry,
        )

    def observe_request(self, route: str, code: int) -> None:
        child = self._request_children.get((route, code))
        if child is None:
            child = self._request_children[(route, code)] = self._requests.labels(route, str(code))
        child.inc()

    def observe_primed(self, kinds: list[str]) -> None:
        for kind in kinds:
            self._media.labels(kind).inc()

    def observe_prime(self, part_type: str, regenerated: bool) -> None:
        """One prime of a part looked up in the store (``regenerated``: it stored nothing)."""
        self._media.labels(MEDIA_KINDS[part_type]).inc()
        if regenerated:
            self._regenerated.inc()

    def observe_replaced_uuids(self, route: str, count: int) -> None:
        self._replaced.labels(route).inc(count)

    def observe_found(self, kinds: list[str], shared: int) -> None:
        for kind in kinds:
            self._stored.labels(kind).inc()
        self._shared.inc(shared)

    def observe_prime_seconds(self, seconds: float) -> None:
        self._prime_seconds.observe(seconds)

    def watch_store(self, leased: Callable[[], float], verified: Callable[[], bool]) -> None:
        """The store gauges read ``leased()`` and ``verified()`` at each scrape."""
        self._leased.set_function(leased)
        self._verified.set_function(lambda: float(verified()))

    def observe_prime_failure(self, reason: str) -> None:
        self._prime_failures.labels(reason).inc()

    def set_encoders(self, count: int) -> None:
        self._encoders.set(count)

    def count_ejected(self, count: Callable[[], float]) -> None:
        """The ejected gauge reads ``count()`` at each scrape: an ejection ends by time alone."""
        self._ejected.set_function(count)

    def observe_ejection(self) -> None:
        self._ejections.inc()

    def observe_dns_error(self) -> None:
        self._dns_errors.inc()
