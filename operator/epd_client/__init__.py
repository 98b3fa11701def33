"""Client library for vLLM Encoder-Prefill Disaggregation (EPD) deployments.

Primes images on a unit's encoders, then renders and generates on the same unit. Imports
neither kopf nor kubernetes (``discover`` loads the latter when called).
"""

from ._client import EPDClient, Session, prime_encoder
from ._discovery import discover
from ._endpoints import Endpoints, ModelEndpoints, Unit, VimeArgs
from ._errors import (
    DiscoveryError,
    EndpointsError,
    EPDClientError,
    ImageFailure,
    NoReadyUnitError,
    PrimeError,
    RequestError,
)
from ._retry import RetryPolicy
from ._sync import generate_sync, prime_encoder_sync

__all__ = [
    "DiscoveryError",
    "EPDClient",
    "EPDClientError",
    "Endpoints",
    "EndpointsError",
    "ImageFailure",
    "ModelEndpoints",
    "NoReadyUnitError",
    "PrimeError",
    "RequestError",
    "RetryPolicy",
    "Session",
    "Unit",
    "VimeArgs",
    "discover",
    "generate_sync",
    "prime_encoder",
    "prime_encoder_sync",
]
