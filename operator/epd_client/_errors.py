"""The exceptions users catch. Everything derives from EPDClientError."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._endpoints import Engine


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


class InvalidResponseError(RequestError):
    """The server answered, but not with a whole JSON body: the body was cut off (the
    connection closed early) or is not JSON. ``status_code`` is the answer's status."""


@dataclass(frozen=True)
class MediaFailure:
    """One media item (image, video or audio part) that could not be primed."""

    index: int
    """Position of the item among all media parts of the messages (0-based)."""
    url: str
    """The URL (for input_audio, the data URL), shortened when long (base64 data URLs are)."""
    encoders: tuple[str, ...]
    """Encoder base URLs tried, in order."""
    error: RequestError
    kind: str = "image_url"
    """The part's type: image_url, video_url, audio_url or input_audio."""


class PrimeError(EPDClientError):
    """Some media items could not be primed on the unit's encoders.

    Raised instead of letting the consumer encode them itself: a silent fallback would hide
    a broken encoder behind slower rollouts.
    """

    def __init__(self, unit: str, total: int, failures: Sequence[MediaFailure]) -> None:
        from ._media import KINDS  # here: _media's errors derive from this module's

        self.unit = unit
        self.failures = tuple(failures)
        details = "; ".join(
            f"{KINDS.get(f.kind, f.kind)} {f.index} ({f.url}) via {', '.join(f.encoders)}: {f.error.reason}"
            for f in self.failures
        )
        super().__init__(f"{len(self.failures)} of {total} media item(s) failed to prime on unit {unit!r}: {details}")


class EngineError(EPDClientError):
    """Engines of a model failed a call; ``failures`` pairs each with its RequestError.

    Raised by the calls that must reach every engine of a model (``EPDClient.pause`` and
    ``resume``), naming each engine that failed, and by render and generate when the unit's
    entry (its EPD proxy, router or consumer, as an Engine of that role) answered with a body
    that is cut off or not JSON (an InvalidResponseError)."""

    def __init__(self, call: str, model: str, total: int, failures: Sequence[tuple[Engine, RequestError]]) -> None:
        self.call = call
        self.model = model
        self.failures = tuple(failures)
        details = "; ".join(
            f"{engine.unit}/{engine.name} ({engine.url}): {error.reason}" for engine, error in self.failures
        )
        hint = ""
        if any(error.status_code == 404 for _, error in self.failures):
            hint = (
                " (vLLM serves /pause and /resume only with VLLM_SERVER_DEV_MODE=1 in the "
                "engines' environment: set serverDevMode: true in the EPDDeployment's spec)"
            )
        super().__init__(
            f"{call} failed on {len(self.failures)} of {total} engine(s) of model {model!r}: {details}{hint}"
        )
