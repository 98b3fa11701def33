"""The EPD proxy's bounds, as pure data and functions: what one request may hold, what the
proxy may hold for all of them at once, and how each refusal names its limit and how to raise
it (its `spec.proxy` field and its flag). The proxy (proxy/server.py), its flags (cli.py), the
operator's checks and the container it renders (validation.py, resources.py) all read them
here. docs/proxy.md, "Bounds", explains each."""

from __future__ import annotations

from dataclasses import dataclass, fields

KiB = 1024
MiB = 1024 * KiB

# Memory one JSON value takes once parsed, at most (a one-key object with its slot in its
# container: 192 bytes for the 2 structural bytes `{` and `,` that announce it; a list, a string
# or a number less), per byte of `,`, `{` or `[` in the body: every value but a top-level scalar
# is announced by one of them (tests/proxy/test_proxy_limits.py measures the shapes).
BYTES_PER_JSON_VALUE = 100
# What a primed body costs per byte, beyond its values: the bytes held, json's decoded copy,
# the parsed strings, each prime's body (a str and its bytes) and, for a Pools model, the
# re-serialised body: measured at 5 bytes a byte for ASCII, 13 for a body whose non-ASCII bytes
# or \\u escapes make its copies 4-byte characters (tests/proxy/test_proxy_limits.py).
BYTES_PER_ASCII_BYTE = 6
BYTES_PER_WIDE_BYTE = 16
# Per media part primed: its prime's request and answer objects, task and retry state.
BYTES_PER_PART = 16 * KiB


@dataclass(frozen=True)
class Limits:
    """Every bound of the proxy, with its default. Each is a flag of `epd-dataplane proxy` and a
    field of `spec.proxy` (SPELLINGS)."""

    max_request_bytes: int = 64 * MiB
    """Largest body of a primed route (read whole and parsed); other bodies are streamed."""
    max_buffered_bytes: int = 600 * MiB
    """Memory the primed requests being read, parsed and primed may take in all (estimated
    from their bodies before parsing: ``request_cost``); a request waits for room."""
    max_media_parts: int = 32
    """Media parts one request may carry (each is one prime request)."""
    max_json_depth: int = 64
    """How deep a primed body's JSON may nest."""
    max_header_bytes: int = 16 * KiB
    """Longest request line, and longest header or trailer field."""
    max_headers: int = 128
    """Header fields of a request, and trailer fields of a chunked body, together."""
    keepalive_timeout_seconds: float = 75.0
    """A connection with no request for this long is closed; a request's head must have come
    whole within this long of the connection opening or of the previous answer."""
    body_timeout_seconds: float = 60.0
    """How long a primed route's body may take to arrive whole."""
    prime_concurrency_per_request: int = 16
    """Prime requests of one request in flight at once: one request's many parts queue behind
    their own, not in front of other requests' primes."""

    def __post_init__(self) -> None:
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"{SPELLINGS[field.name][1]} must be positive")
        if (error := budget_error(self)) is not None:
            raise ValueError(error)


# Each limit's spec.proxy field and flag, for the refusals and docs.
SPELLINGS = {
    "max_request_bytes": ("maxRequestBytes", "--max-request-bytes"),
    "max_buffered_bytes": ("maxBufferedBytes", "--max-buffered-bytes"),
    "max_media_parts": ("maxMediaParts", "--max-media-parts"),
    "max_json_depth": ("maxJsonDepth", "--max-json-depth"),
    "max_header_bytes": ("maxHeaderBytes", "--max-header-bytes"),
    "max_headers": ("maxHeaders", "--max-headers"),
    "keepalive_timeout_seconds": ("keepaliveTimeoutSeconds", "--keepalive-timeout-seconds"),
    "body_timeout_seconds": ("bodyTimeoutSeconds", "--body-timeout-seconds"),
    "prime_concurrency_per_request": ("primeConcurrencyPerRequest", "--prime-concurrency-per-request"),
}


def budget_error(limits: Limits) -> str | None:
    """Why the memory budget cannot hold one body of the largest size, if it cannot: such a
    request would wait for ever."""
    needed = reservation(limits.max_request_bytes, limits)
    if limits.max_buffered_bytes >= needed:
        return None
    return (
        f"maxBufferedBytes ({limits.max_buffered_bytes}) must hold what one body of maxRequestBytes reserves "
        f"before it is read: at least {needed} bytes ({BYTES_PER_ASCII_BYTE} bytes a byte and a sixteenth, "
        f"{BYTES_PER_PART} a part of maxMediaParts)"
    )


def raise_it(limit: str) -> str:
    """How to raise a limit: its spec.proxy field, and the flag it renders."""
    field, flag = SPELLINGS[limit]
    return f"raise spec.proxy.{field} (the proxy's {flag})"


def request_cost(raw: bytes, parts: int = 0) -> int:
    """An upper bound of the memory a primed body takes while the proxy parses it and primes
    its ``parts``, from counts taken before parsing (each a C-speed scan of the bytes)."""
    wide = not raw.isascii() or b"\\u" in raw
    values = raw.count(b",") + raw.count(b"{") + raw.count(b"[")
    per_byte = BYTES_PER_WIDE_BYTE if wide else BYTES_PER_ASCII_BYTE
    return len(raw) * per_byte + values * BYTES_PER_JSON_VALUE + parts * BYTES_PER_PART


def reservation(length: int, limits: Limits) -> int:
    """What a request whose body is ``length`` bytes reserves before reading it: the cost of an
    ASCII body of that length with as many parts as allowed, and a sixteenth more for its JSON
    values (a body with up to one value per 1,600 bytes never needs more once read)."""
    return length * BYTES_PER_ASCII_BYTE + length // 16 + limits.max_media_parts * BYTES_PER_PART


def nested_deeper(value: object, limit: int) -> bool:
    """Whether parsed JSON nests containers more than ``limit`` deep (iterative: a deep value
    cannot exhaust the stack)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
