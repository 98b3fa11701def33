"""Which media URLs the EPD proxy lets reach the encoders (spec.proxy.media, docs/security.md):
``data:`` and ``http(s)`` only; an http(s) host must be listed in ``allowedDomains`` when that is
set (as vLLM's own ``--allowed-media-domains``, rendered into every engine, checks it), and
otherwise must not be a loopback, link-local, private or cluster-internal address or name, nor a
name that resolves to one, unless ``allowPrivateNetworks``.

The URL is read with urllib3's parse_url, vLLM's own parser, so the proxy and the engines see
the same host. ``check`` is pure; ``screen`` resolves the names it leaves open.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from urllib3.util import parse_url

from .core import MediaPart, ProxyError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str], Awaitable[list[str]]]

DOMAINS_FIELD = "spec.proxy.media.allowedDomains"
PRIVATE_FIELD = "spec.proxy.media.allowPrivateNetworks"
# Names that only ever mean something inside a cluster or a host: Kubernetes Services
# (<svc>.<ns>.svc[.cluster.local]), mDNS, cloud metadata (metadata.google.internal) and
# RFC 6761/8375's special-use names. A single label resolves through the pod's search domains
# to a Service of its own namespace.
_INTERNAL_SUFFIXES = (".svc", ".cluster.local", ".local", ".localhost", ".internal", ".home.arpa")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# How long the proxy waits for the resolver on one name.
RESOLVE_TIMEOUT_SECONDS = 5.0
# getaddrinfo's "no such name": the URL cannot be fetched from here; anything else may pass later.
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@dataclass(frozen=True)
class MediaURLPolicy:
    """spec.proxy.media, as the proxy's flags carry it."""

    allowed_domains: frozenset[str] = frozenset()
    """When set, the only http(s) hosts media may come from (vLLM's --allowed-media-domains:
    an exact, case-insensitive match of the URL's host); listed hosts may be private."""
    allow_private_networks: bool = False


@dataclass(frozen=True)
class Verdict:
    """What ``check`` decided about one URL: refused (``reason``), allowed, or allowed once
    ``resolve`` (a host name) resolves to public addresses only."""

    reason: str | None = None
    resolve: str | None = None


ALLOWED = Verdict()


def check(url: str, policy: MediaURLPolicy) -> Verdict:
    """The pure part of the policy for one media URL (a part's URL, or input_audio's data URL)."""
    if url[:5].lower() == "data:":  # as vLLM tells a data URL: no fetch, nothing to reach
        return ALLOWED
    try:
        parsed = parse_url(url)
    except ValueError as error:
        return Verdict(f"it is not a URL vLLM can read ({error})")
    if parsed.scheme not in ("http", "https"):
        scheme = f"{parsed.scheme}:" if parsed.scheme else "no scheme"
        never = " (file: would read the engine's own files, and is never served)" if parsed.scheme == "file" else ""
        return Verdict(f"media are fetched over http(s) or given as data: URLs only, not {scheme}{never}")
    host = parsed.hostname
    if not host:
        return Verdict("it names no host")
    if policy.allowed_domains:
        if host in policy.allowed_domains:
            return ALLOWED
        listed = ", ".join(sorted(policy.allowed_domains))
        return Verdict(f"its host {host} is not one of {DOMAINS_FIELD} ({listed}): add it there")
    if policy.allow_private_networks:
        return ALLOWED
    address = _literal(host)
    if address is not None:
        return Verdict(_private_reason(host, address)) if _is_private(address) else ALLOWED
    name = host.rstrip(".")
    if name == "localhost" or "." not in name or name.endswith(_INTERNAL_SUFFIXES):
        return Verdict(
            f"its host {host} is a cluster-internal or local name (a single label, localhost, or under "
            f"{', '.join(_INTERNAL_SUFFIXES)}): media from inside the cluster need {PRIVATE_FIELD}: true, "
            f"or the host in {DOMAINS_FIELD}"
        )
    return Verdict(resolve=host)


def check_addresses(host: str, addresses: Iterable[str]) -> str | None:
    """Why a name that resolves to ``addresses`` is refused (None: all of them are public)."""
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])
        if _is_private(address):
            return _private_reason(host, address, resolved=True)
    return None


async def screen(
    parts: Sequence[MediaPart],
    policy: MediaURLPolicy,
    resolve: Resolve,
    timeout: float = RESOLVE_TIMEOUT_SECONDS,
) -> ProxyError | None:
    """The answer to a request whose media URLs the policy refuses (None: every URL may be
    fetched): a 400 naming a refused part (one refused without DNS first), its URL, the rule and
    the field that allows it; a 503 when a name could not be resolved for a reason that may pass.
    Each name is resolved once, all at once."""
    verdicts = [check(part.item.source, policy) for part in parts]
    for part, verdict in zip(parts, verdicts, strict=True):
        if verdict.reason:  # refused without asking DNS about the others
            return _refused(part, verdict.reason)
    names = sorted({v.resolve for v in verdicts if v.resolve})
    answers = await asyncio.gather(*(_resolved(name, resolve, timeout) for name in names))
    found = dict(zip(names, answers, strict=True))
    for part, verdict in zip(parts, verdicts, strict=True):
        if not verdict.resolve:
            continue
        addresses, failure = found[verdict.resolve]
        if addresses is None:
            return _refused(part, failure or "", status=503)
        reason = failure or check_addresses(verdict.resolve, addresses)
        if not addresses and reason is None:
            reason = f"its host {verdict.resolve} resolves to no address"
        if reason:
            return _refused(part, reason)
    return None


async def _resolved(host: str, resolve: Resolve, timeout: float) -> tuple[list[str] | None, str | None]:
    """(addresses, None), or (None, why the lookup failed and may pass), or ([], why the name
    does not resolve at all)."""
    try:
        async with asyncio.timeout(timeout):
            return await resolve(host), None
    except socket.gaierror as error:
        if error.errno in _NO_ADDRESS:
            return [], f"its host {host} does not resolve ({error.strerror}), so no engine could fetch it"
        return None, f"its host {host} could not be resolved to check it ({error.strerror}): retry"
    except (TimeoutError, OSError) as error:
        return None, f"its host {host} could not be resolved to check it ({error or 'timed out'}): retry"


def _refused(part: MediaPart, reason: str, status: int = 400) -> ProxyError:
    url = part.item.source if len(part.item.source) <= 80 else part.item.source[:79] + "…"
    return ProxyError(status, f"media URL of {part.param} ({url}) refused: {reason}", part.param)


def _literal(host: str) -> IPAddress | None:
    """The address a host is, if it is one: also in the legacy IPv4 forms the resolver reads
    (2130706433, 0x7f.1, 127.1), which name no DNS record."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _is_private(address: IPAddress) -> bool:
    """Not a globally reachable unicast address: loopback, link-local (cloud metadata at
    169.254.169.254), private, shared (CGNAT), reserved, multicast, unspecified; an IPv6
    address is judged by the IPv4 address it embeds (mapped, 6to4, NAT64, Teredo), which is
    where it leads."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is None and address.teredo:
            embedded = address.teredo[1]
        if embedded is not None:
            return _is_private(embedded)
    return not address.is_global or address.is_multicast


def _private_reason(host: str, address: IPAddress, *, resolved: bool = False) -> str:
    what = (
        "loopback"
        if address.is_loopback
        else "link-local (cloud metadata services live there)"
        if address.is_link_local
        else "private or otherwise not public"
    )
    where = f"resolves to {address}, a" if resolved else "is a"
    return (
        f"its host {host} {where} {what} address: media from private networks need {PRIVATE_FIELD}: true, "
        f"or the host in {DOMAINS_FIELD}"
    )
