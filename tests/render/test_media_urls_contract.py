"""The media URL policy, the same in the proxy and the engines (docs/security.md): for each
spec.proxy.media, every engine is rendered, and vLLM 0.32 and 0.33's own media loading
(MediaConnector and HTTPConnection, built from the engine args the rendered argv parses to, with
the rendered environment; only the HTTP client records instead of sending) decides on a corpus
of URLs; the proxy decides with the flags it is rendered with. What an engine refuses, the proxy
refuses; what the proxy lets through, the engine fetches, from the same host, following no
redirect unless allowed; and the only URLs an engine fetches that the proxy refuses are those
of private networks (which vLLM cannot tell apart) and URLs that name no host."""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

import pytest
from urllib3.util import parse_url
from yarl import URL

from epd_dataplane.cli import build_parser
from epd_dataplane.media_urls import PRIVATE_FIELD, MediaURLPolicy, check
from epd_dev.vllm.cli_parser import VllmParser
from epd_operator.render import render
from epd_operator.resources import proxy_container
from epd_operator.validation import validate

from .cases import CASES, OBJECT, raw_spec

URLS = [
    "data:image/png;base64,iVBORw0KGgo=",
    "DATA:image/png;base64,iVBORw0KGgo=",
    "https://images.example.com/a.png",
    "https://IMAGES.Example.com/a.png",
    "https://images.example.com./a.png",
    "https://images.example.com:8443/a.png?x=1#y",
    "https://cdn.example.com/a.png",
    "https://93.184.216.34/a.png",
    "http://10.0.0.5/a.png",
    "http://169.254.169.254/latest/meta-data/",
    "http://127.0.0.1:8000/metrics",
    "http://[::1]/",
    "http://[::ffff:169.254.169.254]/",
    "http://10.96.0.1/",
    "http://2130706433/",
    "http://0x7f.1/",
    "http://localhost:8000/",
    "http://kubernetes/",
    "http://minio.data.svc:9000/img.png",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://images.example.com@10.0.0.1/",
    "http://user@images.example.com@10.0.0.1/",
    "http://10.0.0.1\\@images.example.com/",
    "http:///a.png",
    "file:///etc/passwd",
    "file://images.example.com/etc/passwd",
    "gopher://images.example.com/",
    "ftp://images.example.com/a.png",
    "httpx://images.example.com/a.png",
    "//images.example.com/a.png",
    "images.example.com/a.png",
]
POLICIES = {
    "default": {},
    "listed": {"allowedDomains": ["images.example.com", "10.0.0.5"]},
    "private": {"allowPrivateNetworks": True},
    "redirects": {"allowRedirects": True, "allowedDomains": ["images.example.com"]},
}
# Why the proxy may refuse a URL an engine would fetch: vLLM has no rule for these.
PROXY_ONLY = (PRIVATE_FIELD, "names no host")


def engines_and_proxy(media: dict[str, Any], version: str) -> tuple[list[Any], MediaURLPolicy]:
    """Every engine rendered for the spec with ``media``, and the policy its proxy runs with."""
    raw = raw_spec("encoder-regular", version)
    raw["proxy"] = {"media": copy.deepcopy(media)}
    checked = validate(raw)
    (plan,) = render(checked, **OBJECT)
    args = build_parser().parse_args(["proxy", *proxy_container(checked.spec, OBJECT["name"], plan, "img")["args"]])
    return plan.engines, MediaURLPolicy(frozenset(args.allowed_media_domains), args.media_allow_private_networks)


def test_the_proxy_refuses_what_engines_refuse_and_engines_fetch_what_it_lets_through(vllm_parser: VllmParser):
    assert "encoder-regular" in CASES
    problems = []
    for name, media in POLICIES.items():
        engines, policy = engines_and_proxy(media, vllm_parser.version)
        decided = vllm_parser.media_urls([{"argv": e.args, "env": e.env, "urls": URLS} for e in engines])
        for engine, results in zip(engines, decided, strict=True):
            for url, engine_did in zip(URLS, results, strict=True):
                problem = _disagreement(url, engine_did, check(url, policy).reason, media)
                if problem:
                    problems.append(f"{name} {engine.container_name} {url}: {problem}")
    assert not problems, f"vLLM {vllm_parser.version}'s engines and the proxy disagree:\n" + "\n".join(problems)


def _disagreement(url: str, engine: dict[str, Any], refusal: str | None, media: dict[str, Any]) -> str:
    if "refused" in engine:
        return "" if refusal else f"the engine refuses it ({engine['refused']}), the proxy lets it through"
    if "fetch" in engine:
        if refusal:
            proxy_only = any(reason in refusal for reason in PROXY_ONLY) and not media.get("allowedDomains")
            return "" if proxy_only else f"the engine fetches it, the proxy refuses it: {refusal}"
        # The host the proxy judged (urllib3's reading, vLLM's own) is the one aiohttp connects to.
        if _host(URL(engine["fetch"]).host or "") != _host(parse_url(url).hostname or ""):
            return f"the engine fetches another host: {engine['fetch']}"
        if engine["allow_redirects"] != bool(media.get("allowRedirects")):
            return f"the engine follows redirects: {engine['allow_redirects']}"
        return ""
    return "" if engine.get("data") and not refusal else f"the engine loads it as {engine}, the proxy: {refusal}"


def _host(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_file_urls_are_never_read_by_an_engine(vllm_parser: VllmParser, name: str):
    engines, _ = engines_and_proxy(POLICIES[name], vllm_parser.version)
    files = ["file:///etc/passwd", "file:///dev/shm/x"]
    for results in vllm_parser.media_urls([{"argv": e.args, "env": e.env, "urls": files} for e in engines]):
        assert all("allowed-local-media-path" in r.get("refused", "") for r in results), results


def test_the_corpus_holds_every_outcome(vllm_parser: VllmParser):
    engines, _ = engines_and_proxy(POLICIES["listed"], vllm_parser.version)
    (results, *_) = vllm_parser.media_urls([{"argv": engines[0].args, "env": engines[0].env, "urls": URLS}])
    kinds = {next(iter(r)) for r in results}
    assert kinds == {"data", "fetch", "refused"}
    assert any("allowed domains" in r.get("refused", "") for r in results)  # vLLM's own domain check bites
