"""Client library for vLLM Encoder-Prefill Disaggregation (EPD) deployments.

Primes images, videos and audio on a unit's encoders, then renders and generates on the same
unit; lists, pauses and resumes a model's engines for weight updates; builds Vime's rollout
arguments. ``media_items`` says which content parts are media (what every prime sends), and
``Primer`` primes them on encoders the caller names (the EPD proxy's door). Imports neither
kopf nor kubernetes (``discover`` loads the latter when called).
"""

from ._affinity import Choice, affinity_key
from ._affinity import choose as choose_unit
from ._affinity import ranked as rank_units
from ._client import EPDClient, Session, prime_encoder
from ._discovery import discover
from ._endpoints import Endpoints, Engine, ModelEndpoints, SupportsEncoderEndpoints, Unit
from ._errors import (
    DiscoveryError,
    EndpointsError,
    EngineError,
    EPDClientError,
    InvalidResponseError,
    MediaFailure,
    NoReadyUnitError,
    PrimeError,
    RequestError,
)
from ._media import (
    EMBEDS_KINDS,
    MediaItem,
    MediaPartError,
    is_key,
    key_generation,
    key_of,
    keyed_items,
    media_items,
    media_key,
    write_keys,
)
from ._media import KINDS as MEDIA_KINDS
from ._prime import HASHED_FIELDS, Primer, prime_body
from ._retry import RetryPolicy
from ._sync import generate_sync, prime_encoder_sync
from ._vime import VimeRolloutArgs, vime_rollout_args

__all__ = [
    "EMBEDS_KINDS",
    "HASHED_FIELDS",
    "MEDIA_KINDS",
    "Choice",
    "DiscoveryError",
    "EPDClient",
    "EPDClientError",
    "Endpoints",
    "EndpointsError",
    "Engine",
    "EngineError",
    "InvalidResponseError",
    "MediaFailure",
    "MediaItem",
    "MediaPartError",
    "ModelEndpoints",
    "NoReadyUnitError",
    "PrimeError",
    "Primer",
    "RequestError",
    "RetryPolicy",
    "Session",
    "SupportsEncoderEndpoints",
    "Unit",
    "VimeRolloutArgs",
    "affinity_key",
    "choose_unit",
    "discover",
    "generate_sync",
    "is_key",
    "key_generation",
    "key_of",
    "keyed_items",
    "media_items",
    "media_key",
    "prime_body",
    "prime_encoder",
    "prime_encoder_sync",
    "rank_units",
    "vime_rollout_args",
    "write_keys",
]
