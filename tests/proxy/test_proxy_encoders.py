"""The encoders a proxy primes on: fixed, or a DNS name re-resolved (a Pools model's pool)."""

from __future__ import annotations

import asyncio
import json
import socket

from epd_dataplane.core import DNSTarget
from epd_dataplane.encoders import Ejection, Encoders, Outliers, resolve_addresses
from epd_dataplane.metrics import ProxyMetrics


class Resolver:
    """Answers from a script: a list of addresses, or a gaierror to raise."""

    def __init__(self, *answers: list[str] | socket.gaierror) -> None:
        self.answers = list(answers)
        self.asked: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.asked.append(host)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, socket.gaierror):
            raise answer
        return answer


def gauge(metrics: ProxyMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name)


async def test_each_refresh_replaces_the_list_and_no_such_name_empties_it():
    metrics = ProxyMetrics()
    resolver = Resolver(
        ["10.0.0.7", "10.0.0.5"],
        ["10.0.0.5"],
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),
    )
    encoders = Encoders(metrics, dns=DNSTarget("pool.ns.svc", (8100, 8101)), resolve=resolver)
    await encoders.refresh()
    assert encoders.urls == (
        "http://10.0.0.5:8100",
        "http://10.0.0.5:8101",
        "http://10.0.0.7:8100",
        "http://10.0.0.7:8101",
    )
    assert gauge(metrics, "epd_proxy_encoders") == 4
    await encoders.refresh()
    assert encoders.urls == ("http://10.0.0.5:8100", "http://10.0.0.5:8101")
    await encoders.refresh()  # the headless Service has no ready pod: no records at all
    assert encoders.urls == () and gauge(metrics, "epd_proxy_encoders") == 0
    assert resolver.asked == ["pool.ns.svc"] * 3
    assert gauge(metrics, "epd_proxy_encoder_dns_errors_total") == 0


async def test_a_resolver_failure_keeps_the_last_answer():
    metrics = ProxyMetrics()
    resolver = Resolver(["10.0.0.5"], socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    encoders = Encoders(metrics, dns=DNSTarget("pool.ns.svc", (8100,)), resolve=resolver)
    await encoders.refresh()
    await encoders.refresh()
    assert encoders.urls == ("http://10.0.0.5:8100",)
    assert gauge(metrics, "epd_proxy_encoder_dns_errors_total") == 1


async def test_run_keeps_refreshing():
    resolver = Resolver(["10.0.0.1"], ["10.0.0.1", "10.0.0.2"])
    encoders = Encoders(ProxyMetrics(), dns=DNSTarget("pool", (1,)), refresh_seconds=0.01, resolve=resolver)
    task = asyncio.create_task(encoders.run())
    try:
        while len(encoders.urls) < 2:  # a test timeout would say it never refreshed
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    assert encoders.urls == ("http://10.0.0.1:1", "http://10.0.0.2:1")


async def test_the_system_resolver_is_asked():
    assert "127.0.0.1" in await resolve_addresses("localhost")


async def test_fixed_urls_lose_trailing_slashes():
    metrics = ProxyMetrics()
    assert Encoders(metrics, ["http://127.0.0.1:8100/"]).urls == ("http://127.0.0.1:8100",)
    assert gauge(metrics, "epd_proxy_encoders") == 1


async def test_a_proxy_primes_on_what_dns_names(server, start_proxy, http):
    """Pools: the pool's encoders, as the DNS answer lists them, with the port given."""
    encoders, upstream = [server(), server()], server()
    ports = sorted({int(e.url.rsplit(":", 1)[1]) for e in encoders})
    resolver = Resolver(["127.0.0.1"])
    proxy = await start_proxy(upstream.url, dns=f"pool.test:{ports[0]},{ports[1]}", resolve=resolver)
    request = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": f"https://i.test/{i}"}} for i in range(2)],
            }
        ]
    }
    async with http.post(proxy.url + "/v1/chat/completions", data=json.dumps(request)) as response:
        assert response.status == 200
    assert [len(e.records) for e in encoders] == [1, 1]
    assert resolver.asked[0] == "pool.test"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


A, B, C = "http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://10.0.0.3:8100"


def test_an_encoder_failing_in_a_row_is_left_out_for_longer_each_time_in_a_row():
    metrics, clock = ProxyMetrics(), Clock()
    outliers = Outliers(metrics, Ejection(consecutive_failures=3, base_seconds=30, max_seconds=75), clock)
    for _ in range(2):
        outliers.observe(A, failed=True)
    outliers.observe(B, failed=True)
    assert outliers.usable((A, B, C)) == (A, B, C)  # two in a row are not three
    outliers.observe(A, failed=True)
    assert outliers.usable((A, B, C)) == (B, C)
    assert (gauge(metrics, "epd_proxy_encoders_ejected"), gauge(metrics, "epd_proxy_encoder_ejections_total")) == (1, 1)
    clock.now += 30
    assert outliers.usable((A, B, C)) == (A, B, C)  # back after the base time...
    for _ in range(3):
        outliers.observe(A, failed=True)
    clock.now += 59
    assert outliers.usable((A, B, C)) == (B, C)  # ...then twice as long, the second time in a row
    clock.now += 1
    for _ in range(3):
        outliers.observe(A, failed=True)
    clock.now += 74
    assert outliers.usable((A, B, C)) == (B, C)  # the third time: 90 s, capped at 75
    clock.now += 1
    assert outliers.usable((A, B, C)) == (A, B, C)
    assert gauge(metrics, "epd_proxy_encoders_ejected") == 0


def test_one_answer_clears_an_encoders_record():
    clock = Clock()
    outliers = Outliers(ProxyMetrics(), Ejection(consecutive_failures=2, base_seconds=30), clock)
    outliers.observe(A, failed=True)
    outliers.observe(A, failed=False)
    outliers.observe(A, failed=True)
    assert outliers.usable((A, B)) == (A, B)  # not two in a row
    outliers.observe(A, failed=True)
    clock.now += 30
    outliers.observe(A, failed=False)  # it answered once back: the next ejection is the first again
    outliers.observe(A, failed=True)
    outliers.observe(A, failed=True)
    clock.now += 30
    assert outliers.usable((A, B)) == (A, B)


def test_never_every_encoder_is_left_out_and_zero_failures_never_ejects():
    outliers = Outliers(ProxyMetrics(), Ejection(consecutive_failures=1), Clock())
    outliers.observe(A, failed=True)
    outliers.observe(B, failed=True)
    assert outliers.usable((A, B)) == (A, B)  # priming on a doubtful encoder beats refusing the request
    assert outliers.usable((A, B, C)) == (C,)
    never = Outliers(ProxyMetrics(), Ejection(consecutive_failures=0), Clock())
    for _ in range(100):
        never.observe(A, failed=True)
    assert never.usable((A, B)) == (A, B)


async def test_a_pool_refresh_forgets_the_records_of_encoders_gone():
    resolver = Resolver(["10.0.0.1", "10.0.0.2"], ["10.0.0.2"], ["10.0.0.1", "10.0.0.2"])
    encoders = Encoders(ProxyMetrics(), dns=DNSTarget("pool", (8100,)), resolve=resolver, ejection=Ejection(1))
    await encoders.refresh()
    encoders.outliers.observe(A, failed=True)
    assert encoders.usable() == (B,)
    await encoders.refresh()  # A's pod went away...
    await encoders.refresh()  # ...and a new pod took its address: it starts clean
    assert encoders.usable() == (A, B)


def test_a_base_ejection_longer_than_the_max_is_the_longest_as_envoy_has_it():
    clock = Clock()
    outliers = Outliers(ProxyMetrics(), Ejection(consecutive_failures=1, base_seconds=600, max_seconds=300), clock)
    outliers.observe(A, failed=True)
    clock.now += 599
    assert outliers.usable((A, B)) == (B,)
    clock.now += 1
    outliers.observe(A, failed=True)  # the second time in a row: still 600 s, not 1,200
    clock.now += 600
    assert outliers.usable((A, B)) == (A, B)


def test_failures_arriving_while_an_encoder_is_left_out_do_not_lengthen_it():
    """Requests in flight when it was left out fail late, all at once: they were sent before."""
    clock = Clock()
    outliers = Outliers(ProxyMetrics(), Ejection(consecutive_failures=2, base_seconds=30), clock)
    for _ in range(2 + 20):
        outliers.observe(A, failed=True)
    clock.now += 30
    assert outliers.usable((A, B)) == (A, B)
