"""The media URL policy (spec.proxy.media): which URLs the proxy lets reach the encoders, as a
pure check, then with DNS (a scripted resolver), then through the wire with the openai SDK."""

from __future__ import annotations

import asyncio
import socket

import openai
import pytest

from epd_client import MediaItem
from epd_dataplane.core import MediaPart
from epd_dataplane.media_urls import MediaURLPolicy, check, check_addresses, screen

DEFAULT = MediaURLPolicy()
LISTED = MediaURLPolicy(frozenset({"images.example.com", "10.0.0.5"}))
PRIVATE_OK = MediaURLPolicy(allow_private_networks=True)


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;base64,AAAA",
        "DATA:image/png;base64,AAAA",  # vLLM tells a data URL case-insensitively
        "https://93.184.216.34/a.png",
        "http://[2606:2800:220:1:248:1893:25c8:1946]/a.png",
    ],
)
def test_data_urls_and_public_addresses_pass_without_dns(url):
    assert check(url, DEFAULT).reason is None and check(url, DEFAULT).resolve is None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "never served"),
        ("gopher://example.com/", "not gopher:"),
        ("ftp://example.com/a.png", "not ftp:"),
        ("//example.com/a.png", "not no scheme"),
        ("http://169.254.169.254/latest/meta-data/", "link-local"),  # cloud metadata
        ("http://127.0.0.1:8000/metrics", "loopback"),
        ("http://[::1]/", "loopback"),
        ("http://[::ffff:169.254.169.254]/", "169.254.169.254"),  # an IPv4-mapped address leads there
        ("http://[64:ff9b::a9fe:a9fe]/", "private or otherwise"),  # so does NAT64's
        ("http://10.96.0.1/", "private"),
        ("http://100.64.0.1/", "private"),  # shared address space (CGNAT)
        ("http://0.0.0.0/", "private"),
        ("http://2130706433/", "loopback"),  # 127.0.0.1, as the resolver reads it
        ("http://0x7f.1/", "loopback"),
        ("http://localhost:8000/", "cluster-internal"),
        ("http://kubernetes/", "cluster-internal"),  # a single label: the namespace's own Service
        ("http://minio.data.svc:9000/img.png", "cluster-internal"),
        ("http://minio.data.svc.cluster.local./img.png", "cluster-internal"),
        ("http://metadata.google.internal/computeMetadata/v1/", "cluster-internal"),
        ("http://printer.local/", "cluster-internal"),
        ("http://user@example.com@10.0.0.1/", "10.0.0.1"),  # the host vLLM's parser reads
    ],
)
def test_refused_urls_name_the_rule_and_the_field_that_allows_them(url, why):
    reason = check(url, DEFAULT).reason
    assert reason and why in reason
    if "scheme" not in why and "gopher" not in why and "ftp" not in why and "never" not in why:
        assert "spec.proxy.media.allowPrivateNetworks: true" in reason


def test_public_looking_names_are_resolved_first():
    assert check("https://Images.Example.com/a.png", DEFAULT).resolve == "images.example.com"  # vLLM's lower case
    assert check("https://xn--bcher-kva.example/a.png", DEFAULT).resolve == "xn--bcher-kva.example"
    # vLLM's parser (urllib3) reads example.com here, and vLLM fetches it there: so does the check.
    assert check("http://example.com\\@10.0.0.1/", DEFAULT).resolve == "example.com"


def test_allowed_domains_are_the_only_hosts_and_listed_hosts_may_be_private():
    assert check("https://images.example.com/a.png", LISTED) == check("http://10.0.0.5/a", LISTED)
    assert check("https://IMAGES.example.com/a.png", LISTED).reason is None  # as vLLM compares: lower case
    for url in ("https://cdn.example.com/a.png", "https://images.example.com./a.png", "http://127.0.0.1/"):
        reason = check(url, LISTED).reason
        assert reason and "is not one of spec.proxy.media.allowedDomains (10.0.0.5, images.example.com)" in reason
    assert check("data:image/png;base64,AAAA", LISTED).reason is None
    assert "never served" in (check("file:///x", LISTED).reason or "")


def test_private_networks_when_allowed():
    for url in ("http://10.0.0.1/a", "http://minio.data.svc/a", "http://169.254.169.254/"):
        assert check(url, PRIVATE_OK).reason is None and check(url, PRIVATE_OK).resolve is None
    assert check("file:///etc/passwd", PRIVATE_OK).reason  # never


def test_names_are_judged_by_every_address_they_resolve_to():
    assert check_addresses("cdn.example.com", ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"]) is None
    reason = check_addresses("sneaky.example.com", ["93.184.216.34", "10.1.2.3"])
    assert reason and "resolves to 10.1.2.3" in reason


def part(url: str, index: int = 0) -> MediaPart:
    return MediaPart(MediaItem({"image_url": url}, "image_url", url), f"messages[0].content[{index}]")


def resolver(answers: dict[str, list[str] | OSError]):
    asked: list[str] = []

    async def resolve(host: str) -> list[str]:
        asked.append(host)
        answer = answers[host]
        if isinstance(answer, OSError):
            raise answer
        return answer

    return resolve, asked


async def test_screen_resolves_each_name_once_and_names_the_first_refused_part():
    resolve, asked = resolver({"cdn.example.com": ["93.184.216.34"], "in.example.com": ["192.168.1.4"]})
    parts = [
        part("https://cdn.example.com/1"),
        part("https://cdn.example.com/2", 1),
        part("https://in.example.com/", 2),
    ]
    refused = await screen(parts, DEFAULT, resolve)
    assert refused is not None and (refused.status, refused.param) == (400, "messages[0].content[2]")
    assert "https://in.example.com/" in refused.message and "resolves to 192.168.1.4" in refused.message
    assert sorted(asked) == ["cdn.example.com", "in.example.com"]
    assert await screen(parts[:2], DEFAULT, resolve) is None
    # A part refused on sight costs no DNS query for the others.
    asked.clear()
    refused = await screen([*parts, part("http://10.0.0.1/", 3)], DEFAULT, resolve)
    assert refused is not None and refused.param == "messages[0].content[3]" and asked == []


async def test_a_name_that_does_not_resolve_is_a_400_and_a_resolver_failure_a_503():
    gone = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    resolve, _ = resolver(
        {"gone.example.com": gone, "flaky.example.com": socket.gaierror(socket.EAI_AGAIN, "again"), "none.example": []}
    )
    refused = await screen([part("https://gone.example.com/a")], DEFAULT, resolve)
    assert refused is not None and refused.status == 400 and "does not resolve" in refused.message
    empty = await screen([part("https://none.example/a")], DEFAULT, resolve)
    assert empty is not None and empty.status == 400 and "no address" in empty.message
    flaky = await screen([part("https://flaky.example.com/a")], DEFAULT, resolve)
    assert flaky is not None and flaky.status == 503 and "retry" in flaky.message


async def test_a_resolver_that_hangs_is_cut_short():
    async def hang(host: str) -> list[str]:
        await asyncio.sleep(60)
        return []

    refused = await screen([part("https://slow.example.com/a")], DEFAULT, hang, timeout=0.05)
    assert refused is not None and refused.status == 503


async def test_the_openai_sdk_gets_a_400_naming_the_part_and_the_rule(server, start_proxy):
    encoder, upstream = server(), server()
    resolve, _ = resolver({"rebind.example.com": ["169.254.169.254"]})
    proxy = await start_proxy(upstream.url, [encoder.url], media_resolve=resolve)
    async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-test", max_retries=0) as client:
        for url, rule in [
            ("http://169.254.169.254/latest/meta-data/iam/", "link-local"),
            ("file:///etc/passwd", "never served"),
            ("http://rebind.example.com/cat.png", "resolves to 169.254.169.254"),
        ]:
            image = {"type": "image_url", "image_url": {"url": url}}
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="served", messages=[{"role": "user", "content": [{"type": "text", "text": "?"}, image]}]
                )
            assert caught.value.body["param"] == "messages[0].content[1]"  # type: ignore[index]  # the SDK types an error's body as object; vLLM's is a dict
            assert rule in caught.value.message and url in caught.value.message
    assert encoder.records == [] and upstream.records == []


async def test_allowed_domains_through_the_wire(server, start_proxy, http):
    encoder, upstream = server(), server()
    proxy = await start_proxy(upstream.url, [encoder.url], media=LISTED)
    image = {"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [image]}]}
    async with http.post(proxy.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200
    block = {"type": "image", "source": {"type": "url", "url": "https://other.example.com/a.png"}}
    anthropic = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [block]}]}
    async with http.post(proxy.url + "/v1/messages", json=anthropic) as response:
        status, answer = response.status, await response.json()
    # The Anthropic route's error shape; the message names the block.
    assert status == 400 and answer["type"] == "error"
    assert "messages[0].content[0]" in answer["error"]["message"] and "allowedDomains" in answer["error"]["message"]
    assert len(encoder.records) == len(upstream.records) == 1
