"""The data plane's processes, built from their flags (cli.py) and served until SIGTERM or
SIGINT: the EPD proxy of a unit, and a model's EPD gateway with its endpoint picker."""

from __future__ import annotations

import ctypes
import gc
import logging
from collections.abc import Mapping, Sequence

from epd_client import Primer, RetryPolicy
from epd_operator.loop import event_loop, stop_on_signals
from epd_operator.proxy_limits import Limits

from .core import DNSTarget
from .encoders import Ejection, Encoders
from .epp import EPPConfig, EPPServer, picker_of
from .gateway import Gateway, UnitsView, watch_units
from .media_urls import MediaURLPolicy
from .metrics import ProxyMetrics
from .server import Proxy, ProxyConfig, serve
from .watch import Api

# glibc's M_MMAP_THRESHOLD: blocks from this size up are mapped apart and unmapped when freed.
_MMAP_THRESHOLD = -3
_MAPPED_FROM_BYTES = 128 * 1024


def _give_large_blocks_back() -> None:
    """Fix glibc's mmap threshold at 128 KiB: by default it rises to the size of each large
    block freed, so after one large body every later one comes from the heap, which is not given
    back, and the proxy's RSS creeps up wave after wave of large bodies (measured: 776 MiB between
    waves of 64 MiB bodies that each took 250 MiB). A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_MMAP_THRESHOLD, _MAPPED_FROM_BYTES)
    except (OSError, AttributeError):
        pass


def run_proxy(
    *,
    host: str,
    port: int,
    upstream: str,
    encoder_urls: Sequence[str],
    encoders_dns: str | None,
    dns_refresh_seconds: float,
    metrics_port: int,
    request_timeout_seconds: float,
    prime_timeout_seconds: float,
    prime_attempt_timeout_seconds: float | None,
    prime_max_attempts: int,
    prime_concurrency: int,
    ejection: Ejection,
    limits: Limits,
    pooled: bool,
    shutdown_timeout_seconds: float,
    log_level: str,
    media: MediaURLPolicy,
    ec_store: str | None = None,
    require_weights_version: bool = False,
) -> None:
    """`epd-dataplane proxy`: build the proxy from its flags and serve until SIGTERM or SIGINT."""
    _give_large_blocks_back()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per prime at INFO
    config = ProxyConfig(
        upstream,
        request_timeout_seconds,
        pooled,
        limits,
        media=media,
        ec_store=ec_store,
        require_weights_version=require_weights_version,
    )
    retry = RetryPolicy(
        max_attempts=prime_max_attempts,
        deadline=prime_timeout_seconds,
        attempt_timeout=min(prime_attempt_timeout_seconds or RetryPolicy.attempt_timeout, prime_timeout_seconds),
    )
    dns = DNSTarget.parse(encoders_dns) if encoders_dns else None

    async def main() -> None:
        metrics = ProxyMetrics()
        stop = stop_on_signals()
        encoders = Encoders(metrics, encoder_urls, dns, refresh_seconds=dns_refresh_seconds, ejection=ejection)
        primer = Primer(retry=retry, max_concurrency=prime_concurrency, on_attempt=encoders.outliers.observe)
        async with primer, Proxy(config, encoders, primer, metrics) as proxy:
            # What the process holds from here on (modules, the app) is never garbage: out of the
            # collector's reach, a full collection scans requests' objects only, not 50,000 more.
            gc.freeze()
            await serve(
                proxy,
                host=host,
                port=port,
                metrics_port=metrics_port,
                shutdown_timeout=shutdown_timeout_seconds,
                stop=stop,
            )

    with event_loop() as runner:
        runner.run(main())


def run_gateway(
    *,
    host: str,
    port: int,
    metrics_port: int,
    model: str,
    units: Mapping[str, str],
    weights_version: str | None,
    namespace: str | None,
    deployment: str | None,
    units_service: str | None,
    request_timeout_seconds: float,
    balance: float | None = None,
    limits: Limits,
    shutdown_timeout_seconds: float,
    log_level: str,
    media: MediaURLPolicy | None = None,
    epp: EPPConfig | None = None,
    epp_names: Sequence[str] = ("localhost",),
) -> None:
    """`epd-dataplane gateway`: watch the model's units (or take ``units``) and serve until
    SIGTERM or SIGINT; with ``epp``, its endpoint picker too (``epp_names``: the names its
    self-signed certificate is for)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The units' media URL policy: a media URL they would refuse is refused here, a hop earlier.
    config = ProxyConfig(_NO_UPSTREAM, request_timeout_seconds, limits=limits, media=media or MediaURLPolicy())
    view = UnitsView.fixed(model, units, weights_version) if units else UnitsView(model)
    view.balance = balance

    async def main() -> None:
        metrics = ProxyMetrics()
        stop = stop_on_signals()
        api = Api()
        watches = []
        if not units:
            assert namespace and deployment and units_service
            watches.append(
                watch_units(api, view, namespace=namespace, deployment=deployment, units_service=units_service)
            )
        async with Primer() as primer, Gateway(config, Encoders(metrics), primer, metrics, units=view) as gateway:
            picker = EPPServer(picker_of(gateway, epp.fallbacks), epp, epp_names) if epp is not None else None
            if picker is not None:
                await picker.start()
                watches.append(picker.ready_once(view))
            try:
                await serve(
                    gateway,
                    host=host,
                    port=port,
                    metrics_port=metrics_port,
                    shutdown_timeout=shutdown_timeout_seconds,
                    stop=stop,
                    tasks=watches,
                )
            finally:
                if picker is not None:
                    await picker.stop(shutdown_timeout_seconds)
                await api.aclose()

    with event_loop() as runner:
        runner.run(main())


# The gateway has no upstream of its own: each request goes to a unit (upstream_for).
_NO_UPSTREAM = "http://gateway.invalid"
