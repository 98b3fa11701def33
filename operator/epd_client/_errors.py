"""The exceptions users catch. Everything derives from EPDClientError."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class EPDClientError(Exception):
    """Base class of every error this library raises on purpose."""


class EndpointsError(EPDClientError):
    """The endpoints cannot serve the call: unknown model, ambiguous unit, no entry URL,
    or a malformed EPDDeployment status."""


class NoReadyUnitError(EndpointsError):
    """The model has units, but none is ready. Usually transient (pods starting)."""


class DiscoveryError(EPDClientError):
    """Reading the EPDDeployment from the cluster failed, or it has no usable status yet."""


class RequestError(EPDClientError):
    """One HTTP request failed for good: its retries ran out, its deadline passed, or the
    server gave an answer that is not worth retrying (a 4xx other than 408/429)."""

    def __init__(
        self,
        path: str,
        urls: Sequence[str],
        *,
        attempts: int,
        reason: str,
        status_code: int | None = None,
    ) -> None:
        self.path = path
        self.urls = tuple(urls)
        self.attempts = attempts
        self.reason = reason
        self.status_code = status_code
        tried = ", ".join(self.urls)
        super().__init__(f"POST {path} via {tried} failed after {attempts} attempt(s): {reason}")


@dataclass(frozen=True)
class ImageFailure:
    """One image that could not be primed."""

    index: int
    """Position of the image among all image parts of the messages (0-based)."""
    url: str
    """The image URL, shortened when long (base64 data URLs are)."""
    encoders: tuple[str, ...]
    """Encoder base URLs tried, in order."""
    error: RequestError


class PrimeError(EPDClientError):
    """Some images could not be primed on the unit's encoders.

    Raised instead of letting the consumer encode the images itself: a silent fallback
    would hide a broken encoder behind slower rollouts.
    """

    def __init__(self, unit: str, total: int, failures: Sequence[ImageFailure]) -> None:
        self.unit = unit
        self.failures = tuple(failures)
        details = "; ".join(
            f"image {f.index} ({f.url}) via {', '.join(f.encoders)}: {f.error.reason}"
            for f in self.failures
        )
        super().__init__(
            f"{len(self.failures)} of {total} image(s) failed to prime on unit {unit!r}: {details}"
        )
