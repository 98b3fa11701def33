"""EPDDeployment API (epd.vime.dev/v1alpha1): the pydantic models are the one source of truth.

The CRD in `crds/` is generated from these models (see `crd.py`); the operator parses every
object through them. Field names are camelCase on the wire, as Kubernetes spells them. One
module, though past 350 lines, as Kubernetes keeps an API version's types in one types.go.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

from .ec.quantity import BYTE_QUANTITY, MAX_BYTES, QUANTITY
from .engine_args import engine_arg_name, spelling_errors
from .proxy_limits import BYTES_PER_ASCII_BYTE, BYTES_PER_JSON_VALUE, BYTES_PER_WIDE_BYTE, Limits

_PROXY = Limits()  # the proxy's defaults, said in each field's description

GROUP = "epd.vime.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "EPDDeployment"
PLURAL = "epddeployments"
SINGULAR = "epddeployment"
SHORT_NAMES = ["epd"]

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# The EC janitor's Prometheus port in every unit with encoders.
JANITOR_METRICS_PORT = 9400
# The EPD proxy's own /metrics and /health in every unit (its main port passes every path on).
PROXY_METRICS_PORT = 9401
# The EPD gateway's endpoint picker (spec.gateway.inferencePool): GAIE's reference ports.
EPP_PORT = 9002
EPP_HEALTH_PORT = 9003
# KEDA's ScaledObject (spec.autoscaling, spec.models[].encoderAutoscaling).
KEDA_GROUP = "keda.sh"
KEDA_VERSION = "v1alpha1"
# The Gateway API Inference Extension's InferencePool (GA since GAIE v1.0).
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"

# Open maps (vLLM engine args, connector extra config) and embedded Kubernetes core types
# (affinity, volumes, ...) are kept schemaless: their own API server validates the latter
# when the operator creates the pod.
OpenObject = dict[str, Any]
# A Kubernetes resource quantity (cpu: 500m, memory: 4Gi), with a bounded exponent.
Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=64)]


class Schema(BaseModel):
    """Base of every API model: camelCase on the wire, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_enum_values=True,
        # Defaults too: an enum default is then its value like any parsed one (plain YAML and JSON).
        validate_default=True,
    )


class WorkerType(str, enum.Enum):
    """An engine's role. Its EC and KV roles are the seed's table, kept here only."""

    encoder = "encoder"
    regular = "regular"
    prefill = "prefill"
    decode = "decode"

    @property
    def ec_role(self) -> str | None:
        """vLLM's EC role: encoders produce embeddings, regular and prefill read them, decode
        never sees an image."""
        return {"encoder": "ec_producer", "regular": "ec_consumer", "prefill": "ec_consumer"}.get(self.value)

    @property
    def kv_role(self) -> str | None:
        return {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.value)

    @property
    def is_encoder(self) -> bool:
        return self is WorkerType.encoder

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_role == "ec_consumer"

    @property
    def is_pd(self) -> bool:
        """Prefill or decode: the unit needs vllm-router's prefill/decode mode."""
        return self.kv_role is not None


class Placement(str, enum.Enum):
    """Where a model's encoders run (docs/architecture.md, "Placements")."""

    unit = "Unit"  # every engine of the model in one pod: the seed's single-node EPD unit
    pools = "Pools"  # an encoder pool of its own pods, and consumer units on any node


class EnvVar(Schema):
    """A container environment variable, as in a Pod spec."""

    model_config = ConfigDict(extra="allow", alias_generator=to_camel, populate_by_name=True)
    name: str = Field(min_length=1, max_length=256, description="Variable name.")
    value: str | None = Field(default=None, max_length=32768, description="Literal value.")
    value_from: OpenObject | None = Field(
        default=None, description="Source for the value (secretKeyRef, configMapKeyRef, fieldRef...)."
    )


class ResourceRequirements(Schema):
    """Extra container resources for each engine; GPUs are set by the operator from numGpusPerEngine."""

    limits: dict[str, int | Quantity] = Field(default_factory=dict, max_length=16, description="Resource limits.")
    requests: dict[str, int | Quantity] = Field(default_factory=dict, max_length=16, description="Resource requests.")


class ServerGroup(Schema):
    """A group of identical vLLM engines of one worker type (Vime's `server_groups[]`)."""

    # Kept as the enum (not its value) so the role's behaviour is at hand: `group.worker_type.ec_role`.
    model_config = ConfigDict(use_enum_values=False)

    worker_type: WorkerType = Field(
        description=(
            "Role of the engines: encoder (EC producer, never behind the router), regular "
            "(EC consumer serving prefill and decode), prefill (EC consumer, KV producer) or "
            "decode (KV consumer)."
        )
    )
    num_gpus: int = Field(
        ge=1,
        le=1024,
        description="GPUs for the whole group, in each EPD unit (an encoder group of a Pools model: in each encoder pool pod).",
    )
    num_gpus_per_engine: int = Field(
        default=1,
        ge=1,
        le=64,
        description="GPUs per engine (tensor parallel size). numGpus must be a multiple of it.",
    )
    overrides: OpenObject = Field(
        default_factory=dict,
        max_length=128,
        description=(
            "vLLM engine arguments in snake_case, as in Vime (e.g. max_model_len: 4096). Highest "
            "priority: they win over every default; ec_transfer_config is deep-merged."
        ),
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Extra environment for these engines.")
    resources: ResourceRequirements | None = Field(
        default=None, description="Extra resources (cpu, memory) for each engine container."
    )

    @field_validator("overrides")
    @classmethod
    def _one_key_per_argument(cls, overrides: OpenObject) -> OpenObject:
        """Each argument under vLLM's own snake_case name, once: everything after parsing reads
        the overrides in that one spelling."""
        doubled = spelling_errors(overrides)
        if doubled:
            raise ValueError("; ".join(doubled))
        return {engine_arg_name(key): value for key, value in overrides.items()}

    @property
    def engines(self) -> int:
        return self.num_gpus // self.num_gpus_per_engine


class PoolsECConnector(Schema):
    """The EC connector between a Pools model's encoder pool and its consumer units."""

    name: str = Field(
        default="ECCPUConnector",
        min_length=1,
        description=(
            "vLLM EC connector class that reaches other nodes: ECCPUConnector (each engine's pinned "
            "/dev/shm region, read over NIXL) or a custom one. ECExampleConnector cannot: its files "
            "live in one node's /dev/shm."
        ),
    )
    module_path: str | None = Field(default=None, max_length=512, description="Python module of a custom connector.")
    extra_config: OpenObject = Field(
        default_factory=dict,
        max_length=64,
        description=(
            "Merged into ec_connector_extra_config of the model's engines. For ECCPUConnector: "
            "ec_cpu_bytes (each engine's region; default: an equal share of 80% of its pod's "
            "/dev/shm) and ec_enable_nixl (default true)."
        ),
    )


class EncoderPool(Schema):
    """The encoder pool's pods (placement Pools); unset fields take the spec-wide value."""

    shm: Shm | None = Field(default=None, description="The pool pods' /dev/shm; default: spec.shm.")
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=32, description="The pool pods' nodeSelector; default: spec.nodeSelector."
    )
    tolerations: list[OpenObject] | None = Field(
        default=None, max_length=32, description="The pool pods' tolerations; default: spec.tolerations."
    )
    affinity: OpenObject | None = Field(
        default=None,
        description="The pool pods' affinity (e.g. anti-affinity to the consumer units); default: spec.affinity.",
    )


class Autoscaler(Schema):
    """A KEDA ScaledObject the operator makes (docs/autoscaling.md): KEDA's HPA owns the replica
    count from then on, within these bounds, and the operator never writes it."""

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="The fewest pods; 0 (scale from zero) is refused until a request can wake a pool up.",
    )
    max_replicas: int = Field(ge=1, le=1000, description="The most pods; at least minReplicas.")
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description=(
            "The HPA scales down to the highest count it wanted during this window (Kubernetes' default 300): "
            "short for a bursty RL rollout, long to keep warm engines through a lull."
        ),
    )


class EncoderAutoscaling(Autoscaler):
    """The model's encoder pool (placement Pools), sized by its primes in flight."""

    target_primes_in_flight: float = Field(
        default=2,
        gt=0,
        le=1000,
        description=(
            "Prime requests in flight per encoder pod the autoscaler aims at: the sum over the model's EPD proxies "
            "of epd_proxy_primes_in_flight, divided by this, is the pool's size (KEDA's AverageValue). About what "
            "one encoder pod encodes at once without queueing."
        ),
    )


class UnitAutoscaling(Autoscaler):
    """The EPD units (spec.replicas, through the EPDDeployment's scale subresource), sized by the
    requests their EPD proxies are serving."""

    target_requests_in_flight: float = Field(
        default=8,
        gt=0,
        le=10000,
        description=(
            "Requests in flight per unit the autoscaler aims at: the sum over the deployment's EPD proxies of "
            "epd_proxy_requests_in_flight, divided by this, is spec.replicas."
        ),
    )


class DeploymentAutoscaling(Schema):
    """KEDA ScaledObjects on EPD's own load signals, read from Prometheus (docs/autoscaling.md)."""

    prometheus_address: str | None = Field(
        default=None,
        max_length=512,
        pattern=r"^https?://[^\s]+$",
        description=(
            "The Prometheus that scrapes the units (the chart's PodMonitor), whose queries the ScaledObjects' "
            "prometheus triggers run, e.g. http://prometheus-operated.monitoring.svc:9090. Needed by any autoscaler."
        ),
    )
    polling_interval_seconds: int = Field(
        default=15, ge=1, le=300, description="How often KEDA runs the queries (its pollingInterval)."
    )
    units: UnitAutoscaling | None = Field(
        default=None, description="Autoscale the units: spec.replicas becomes the autoscaler's."
    )


class ModelSpec(Schema):
    """One served model and its server groups: each EPD unit of it is one pod on one node, holding every
    engine (placement Unit) or its consumers only, fed by an encoder pool (placement Pools)."""

    name: str = Field(
        max_length=40,
        pattern=DNS1123_LABEL,
        description="Model key (DNS-1123 label, unique). Vime's default model name is 'default'.",
    )
    model: str = Field(
        min_length=1, max_length=1024, description="Model path or id passed to vLLM (`vllm serve <model>`)."
    )
    served_model_name: str | None = Field(
        default=None, max_length=256, description="Name clients use in requests; defaults to `model`."
    )
    server_groups: list[ServerGroup] = Field(
        min_length=1,
        max_length=16,
        description=(
            "Valid layouts: {encoder, regular}, {encoder, prefill, decode}, and text-only "
            "{regular} or {prefill, decode}. Several groups of one type are allowed."
        ),
    )

    # Placement: the encoders of a model in its units, or in a pool of their own.
    placement: Placement = Field(
        default=Placement.unit,
        description=(
            "Unit: every engine of the model in one pod (an EPD unit) sharing a node-local EC store. "
            "Pools: the encoders form an encoder pool (its own StatefulSet of encoderReplicas pods, on any "
            "node) and the consumers form the units (replicas of them), which read embeddings over the "
            "network (ECCPUConnector with NIXL by default). Pools needs an encoder group."
        ),
    )
    encoder_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description=(
            "Pods in the encoder pool (placement Pools), each holding the encoder groups' engines; "
            "independent of spec.replicas. 0 stops the pool: its consumers leave their Services."
        ),
    )
    ec_connector: PoolsECConnector | None = Field(
        default=None,
        description=(
            "The model's EC connector (placement Pools only; a Unit model uses spec.ecConnector). "
            "Default: ECCPUConnector over NIXL."
        ),
    )
    encoder_pool: EncoderPool | None = Field(
        default=None, description="The encoder pool's pods (placement Pools): /dev/shm and scheduling."
    )
    encoder_autoscaling: EncoderAutoscaling | None = Field(
        default=None,
        description=(
            "Autoscale the encoder pool (placement Pools) with KEDA: the pool's size becomes the autoscaler's "
            "(encoderReplicas is ignored), the operator no longer sets it."
        ),
    )
    weights_version: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[\x21-\x7e]+$",
        description=(
            "The version of the model's weights (e.g. step-42), bumped by an RL trainer after each weight sync: "
            "the model's EPD gateway sends it with every request that carries none (X-EPD-Weights-Version), and "
            "the units' proxies key each media part by it, so no request is served an embedding of older weights. "
            "Changing it restarts nothing; setting or unsetting it rolls the units once (their proxies then refuse "
            "media requests without a version). Needs spec.gateway.enabled."
        ),
    )

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def worker_types(self) -> set[WorkerType]:
        return {g.worker_type for g in self.server_groups}

    @property
    def has_encoders(self) -> bool:
        return WorkerType.encoder in self.worker_types

    @property
    def is_pd(self) -> bool:
        return any(t.is_pd for t in self.worker_types)

    @property
    def encoder_engines(self) -> int:
        return sum(g.engines for g in self.server_groups if g.worker_type.is_encoder)

    @property
    def consumer_engines(self) -> int:
        """Every engine that is not an encoder: regular, prefill and decode."""
        return sum(g.engines for g in self.server_groups if not g.worker_type.is_encoder)

    @property
    def needs_router(self) -> bool:
        """vllm-router fronts the consumers when there is a choice to make: prefill/decode, or
        more than one consumer engine. Encoders are never behind it."""
        return self.is_pd or self.consumer_engines > 1

    @property
    def pooled(self) -> bool:
        """Placement Pools: the encoders run in their own pool, not in the units."""
        return self.placement == Placement.pools

    @property
    def pools_connector(self) -> PoolsECConnector:
        return self.ec_connector or PoolsECConnector()

    @property
    def media_per_prompt(self) -> int | None:
        """The most media items a consumer takes in one prompt, by its limit_mm_per_prompt
        override (every modality's count added up; the strictest consumer group's), or None
        when no consumer sets one."""
        totals = [
            _media_total(group.overrides["limit_mm_per_prompt"])
            for group in self.server_groups
            if group.worker_type.is_ec_consumer and "limit_mm_per_prompt" in group.overrides
        ]
        known = [total for total in totals if total]  # 0: no media at all, which no prime changes
        return min(known) if known else None


def _media_total(value: Any) -> int | None:
    """limit_mm_per_prompt's counts added up: ``{"image": 4}``, vLLM's ``{"video": {"count": 1,
    ...}}`` form, or either as JSON text (as on the command line). None for a value that is
    neither (vLLM's parser says what is wrong with it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    total = 0
    for limit in value.values():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return None
        total += count
    return total


class ECConnector(Schema):
    """Encoder-cache (EC) connector between encoders (producers) and consumers."""

    name: str = Field(default="ECExampleConnector", max_length=256, description="vLLM EC connector class.")
    storage_root: str = Field(
        default="/dev/shm",
        pattern=r"^/.*",
        max_length=512,
        description="Folder holding each model's isolated EC store (the shared memory-backed emptyDir).",
    )
    path_prefix: str = Field(
        default="vime-ec-",
        pattern=r"^[A-Za-z0-9._-]+$",
        max_length=64,
        description="Prefix of each model's EC folder name under storageRoot.",
    )
    module_path: str | None = Field(default=None, max_length=512, description="Python module of a custom connector.")
    extra_config: OpenObject = Field(
        default_factory=dict, max_length=64, description="Merged into ec_connector_extra_config of every engine."
    )


class KVConnector(Schema):
    """KV-cache connector between prefill (producer) and decode (consumer) engines."""

    name: str = Field(default="NixlConnector", max_length=256, description="vLLM KV connector class.")
    extra_config: OpenObject = Field(
        default_factory=dict, max_length=64, description="kv_connector_extra_config of prefill and decode engines."
    )


class RouterPolicy(str, enum.Enum):
    round_robin = "round_robin"
    random = "random"
    cache_aware = "cache_aware"
    power_of_two = "power_of_two"
    consistent_hash = "consistent_hash"


class Router(Schema):
    """vllm-router in front of a unit's consumer engines (added for prefill/decode or >1 consumer)."""

    image: str = Field(default="vllm/vllm-router:v0.1.17", max_length=512, description="vllm-router image.")
    policy: RouterPolicy = Field(default=RouterPolicy.round_robin, description="Load-balancing policy.")
    request_timeout_seconds: int = Field(default=1800, ge=1, le=86400, description="Per-request timeout.")
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Extra vllm-router arguments. Not the ones the operator sets (host, port, workers, policy, "
            "timeout, KV connector) nor secrets (--api-key): refused."
        ),
    )
    resources: ResourceRequirements | None = Field(default=None, description="Router container resources.")


class OutlierDetection(Schema):
    """When the proxy leaves an encoder out of priming (Envoy's consecutive gateway failures): a
    failure is no answer in time, no connection, a 5xx or an answer cut off; one answer clears it."""

    consecutive_failures: int | None = Field(
        default=None, ge=0, le=1000, description="Failed prime requests in a row; 0: never. Default: 5."
    )
    base_ejection_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description="How long an encoder is left out, times the number of times in a row it was. Default: 30.",
    )
    max_ejection_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description="The longest an encoder is left out (baseEjectionSeconds if that is longer). Default: 300.",
    )


# A media host as vLLM compares it with --allowed-media-domains: the URL's host as urllib3 reads
# it, lower case and punycode (an IPv4 address is one too).
MEDIA_HOST = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"


class MediaURLs(Schema):
    """Where media URLs may point, for the EPD proxy and every engine alike (docs/security.md):
    http(s) and data: URLs only, never file:."""

    allowed_domains: list[Annotated[str, Field(pattern=MEDIA_HOST, max_length=253)]] = Field(
        default_factory=list,
        max_length=256,
        description=(
            "When set, the only hosts http(s) media may come from: an exact match of the URL's host (lower case, "
            "punycode; no wildcards, a subdomain is another host), rendered into every engine as vLLM's "
            "--allowed-media-domains and checked by the proxy before priming. Listed hosts may be private. Default: "
            "any public host."
        ),
    )
    allow_private_networks: bool = Field(
        default=False,
        description=(
            "Let media URLs name loopback, link-local (cloud metadata), private and cluster-internal hosts, or "
            "names resolving to them. The proxy refuses them by default; engines cannot tell them apart, so a "
            "client reaching an engine directly is held only by allowedDomains and the NetworkPolicy."
        ),
    )
    allow_redirects: bool = Field(
        default=False,
        description=(
            "Let engines follow an HTTP redirect when fetching media (vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS). A "
            "redirect's target is checked by neither the proxy nor vLLM's allowed domains."
        ),
    )


class Proxy(Schema):
    """The EPD proxy in every unit (`epd-dataplane proxy`, the operator's image, docs/proxy.md): on
    the front port, it primes the media of any OpenAI client's request on the encoders before
    forwarding it to vllm-router (or the unit's only consumer) on the pod's loopback."""

    enabled: bool = Field(
        default=True,
        description=(
            "Without it, only clients that prime the encoders themselves (epd_client) use them: any other "
            "client's images are encoded by the consumers."
        ),
    )
    request_timeout_seconds: int | None = Field(
        default=None, ge=1, le=86400, description="Per-request timeout; default: router.requestTimeoutSeconds."
    )
    prime_timeout_seconds: int = Field(
        default=600, ge=1, le=86400, description="How long priming one request's media may take, retries included."
    )
    prime_attempt_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description=(
            "How long one prime request to one encoder may take before it is retried on the next encoder, so a hung "
            "encoder costs one attempt, not all of primeTimeoutSeconds; at most primeTimeoutSeconds. Default: 300 s "
            "(epd_client's), or primeTimeoutSeconds if shorter."
        ),
    )
    outlier_detection: OutlierDetection = Field(
        default_factory=OutlierDetection,
        description="When an encoder that keeps failing its prime requests is left out (its probes may still pass).",
    )
    max_request_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=MAX_BYTES,
        description=(
            "Largest body of a route whose media are primed (chat completions, Responses, ...), which the proxy "
            f"holds whole and parses; other bodies stream through. Over it: 413. Default: {_PROXY.max_request_bytes}."
        ),
    )
    max_buffered_bytes: int | None = Field(
        default=None,
        ge=1 << 20,
        le=MAX_BYTES,
        description=(
            "Memory the primed requests being read, parsed and primed may take in all, estimated from each body "
            f"before parsing ({BYTES_PER_ASCII_BYTE} bytes a byte of ASCII, {BYTES_PER_WIDE_BYTE} otherwise, "
            f"{BYTES_PER_JSON_VALUE} a JSON value); a request waits its turn (503 after bodyTimeoutSeconds). It must "
            f"hold one ASCII body of maxRequestBytes. Default: {_PROXY.max_buffered_bytes}, under the proxy "
            "container's 1Gi memory limit: raise both together."
        ),
    )
    max_media_parts: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description=(
            "Media parts one request may carry, each primed by a request to an encoder. Over it: 400. Default: the "
            f"consumers' limit_mm_per_prompt override (its counts added up) if set, else {_PROXY.max_media_parts}."
        ),
    )
    max_json_depth: int | None = Field(
        default=None,
        ge=1,
        le=512,
        description=f"How deep a primed body's JSON may nest. Over it: 400. Default: {_PROXY.max_json_depth}.",
    )
    max_header_bytes: int | None = Field(
        default=None,
        ge=1024,
        le=1 << 20,
        description=(
            "Longest request line, header field or trailer field of a client's request. Over it: 431. Default: "
            f"{_PROXY.max_header_bytes}."
        ),
    )
    max_headers: int | None = Field(
        default=None,
        ge=8,
        le=4096,
        description=(
            "Header fields of a client's request and trailer fields of its chunked body, together. Over it: 400. "
            f"Default: {_PROXY.max_headers}."
        ),
    )
    keepalive_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description=(
            "A client connection with no request for this long is closed, and a request's head must arrive whole "
            f"within this long of the connection opening or of the previous answer. Default: "
            f"{_PROXY.keepalive_timeout_seconds:g}."
        ),
    )
    body_timeout_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86400,
        description=(
            f"How long a primed route's body may take to arrive whole (then 408). Default: "
            f"{_PROXY.body_timeout_seconds:g}."
        ),
    )
    prime_concurrency_per_request: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description=(
            "Prime requests of one request in flight at once, so that one request's many parts do not hold up "
            f"other requests' primes. Default: {_PROXY.prime_concurrency_per_request} (of 64 in all)."
        ),
    )
    resources: ResourceRequirements | None = Field(default=None, description="The proxy container's resources.")
    media: MediaURLs = Field(
        default_factory=MediaURLs,
        description="Where media URLs may point: enforced by the proxy and, where vLLM can, by every engine.",
    )

    def limits(self, model: ModelSpec) -> Limits:
        """The bounds the proxy of ``model``'s units runs with: the fields set, the proxy's own
        defaults for the rest (maxMediaParts: the consumers' limit_mm_per_prompt first)."""
        given = {name: getattr(self, name) for name in Limits.__dataclass_fields__}
        if given["max_media_parts"] is None:
            given["max_media_parts"] = model.media_per_prompt
        return Limits(**{name: value for name, value in given.items() if value is not None})


class InferencePoolSpec(Schema):
    """A Gateway API Inference Extension InferencePool per proxied model, whose endpoint picker is
    the model's EPD gateway (docs/gateway-api.md): any conformant gateway (Istio, agentgateway,
    NGINX Gateway Fabric, Envoy) routing an HTTPRoute to the pool places each request on the unit
    that holds its media, as the front Service does."""

    enabled: bool = Field(
        default=False,
        description=(
            "Create an InferencePool (inference.networking.k8s.io/v1) per model with a gateway: its selector "
            "matches that model's unit pods, its target port is their EPD proxy, its endpointPickerRef the "
            "gateway's picker Service (port 9002, gRPC). Needs spec.gateway.enabled and the InferencePool CRD "
            "(the chart installs it only when asked: inferencePoolCRD.install)."
        ),
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description=(
            "What the gateway does when the picker is unreachable: FailClose refuses the request, FailOpen sends "
            "it to a unit of the pool without the picker (its pictures may be encoded again there)."
        ),
    )
    secure_serving: bool = Field(
        default=True,
        description=(
            "TLS on the picker's port with a self-signed certificate, as GAIE's reference picker serves (gateways "
            "do not verify it); false: plaintext gRPC (agentgateway's standalone mode wants it)."
        ),
    )
    fallbacks: int = Field(
        default=0,
        ge=0,
        le=7,
        description=(
            "Units named after the pick in x-gateway-destination-endpoint, where a gateway that goes down the list "
            "sends a request whose unit refuses connections (Istio does); 0: the pick alone, which a standalone "
            "Envoy's ORIGINAL_DST cluster needs."
        ),
    )


class Gateway(Schema):
    """The EPD gateway in front of each model's units (`epd-dataplane gateway`, the operator's
    image, docs/proxy.md): the model's front Service targets it, and it sends each request to the
    unit that holds its media, with the model's weights version."""

    enabled: bool = Field(
        default=False,
        description=(
            "A Deployment of the gateway per model with an EPD proxy; its front Service targets the gateway, "
            "which sends each request to the ready unit its conversation or first picture prefers (bounded load), "
            "so a repeated picture is primed once per weights version and not once per unit. It reads the "
            "EPDDeployment and the units' EndpointSlices with a Role of its own (list and watch: nothing else)."
        ),
    )
    replicas: int = Field(default=1, ge=1, le=100, description="Gateway pods per model.")
    max_load_percent: int = Field(
        default=125,
        ge=100,
        le=1000,
        description=(
            "The most requests in flight a unit takes, in percent of the mean over the ready units, before a "
            "request goes to its key's next unit (where its pictures are primed again). Higher: fewer pictures "
            "encoded twice, more load on the units that hold hot pictures (docs/proxy.md measures 125, 150 "
            "and 200)."
        ),
    )
    resources: ResourceRequirements | None = Field(default=None, description="The gateway container's resources.")
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=32, description="The gateway pods' nodeSelector; default: spec.nodeSelector."
    )
    tolerations: list[OpenObject] | None = Field(
        default=None, max_length=32, description="The gateway pods' tolerations; default: spec.tolerations."
    )
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec,
        description="An InferencePool per model for Gateway API gateways, the gateway its endpoint picker.",
    )


class NetworkPolicySpec(Schema):
    """Who reaches the pods of the EPDDeployment (a NetworkPolicy the operator owns). Each pod is
    always reachable by the EPDDeployment's own pods (units and encoder pools), on every port."""

    enabled: bool = Field(
        default=True,
        description="Create the NetworkPolicy. Enforced only where the cluster's network plugin implements "
        "NetworkPolicy (docs/security.md).",
    )
    clients: list[OpenObject] | None = Field(
        default=None,
        max_length=32,
        description=(
            "NetworkPolicy peers (podSelector / namespaceSelector / ipBlock) allowed on the front port and the "
            "engines' HTTP ports, where clients prime encoders, render, generate and pause engines; default: every "
            "pod of the EPDDeployment's namespace. Never the side channels or the janitors."
        ),
    )
    monitoring: list[OpenObject] = Field(
        default_factory=list,
        max_length=32,
        description="Peers allowed to scrape the engines' and janitors' /metrics too (e.g. Prometheus' namespace).",
    )


class APIKeySecret(Schema):
    """A key of a Secret in the EPDDeployment's namespace."""

    name: str = Field(min_length=1, max_length=253, description="The Secret's name.")
    key: str = Field(min_length=1, max_length=253, description="The key in the Secret.")


class APIKey(Schema):
    """An API key every engine requires (vLLM's VLLM_API_KEY, read from the Secret, never an argument)."""

    secret_key_ref: APIKeySecret = Field(description="The Secret key holding it.")


class ServiceType(str, enum.Enum):
    cluster_ip = "ClusterIP"
    node_port = "NodePort"
    load_balancer = "LoadBalancer"


class FrontService(Schema):
    """The Service in front of each model's units: their routers, or their single consumer."""

    type: ServiceType = Field(default=ServiceType.cluster_ip, description="Kubernetes Service type.")
    headless: bool = Field(
        default=False,
        description=(
            "clusterIP: None: DNS answers with the ready units' pod IPs and no virtual IP is allocated "
            "(kube-apiserver allocates ClusterIPs one at a time; docs/performance.md). Clients then "
            "balance across the addresses themselves. Only with type ClusterIP; changing it deletes "
            "and re-creates the Service, as its clusterIP cannot change."
        ),
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Annotations of the Service, e.g. a cloud load balancer's settings.",
    )


class Shm(Schema):
    """The memory-backed emptyDir every engine of a pod (a unit, or an encoder pool pod) mounts at /dev/shm."""

    size_limit: str = Field(
        default="16Gi",
        pattern=BYTE_QUANTITY,
        max_length=32,
        description="emptyDir sizeLimit in bytes, e.g. 16Gi (counts against pod memory).",
    )


class ECStorage(Schema):
    """Bounds on each model's EC store (the connector itself never deletes anything)."""

    max_bytes: int | None = Field(
        default=None, ge=1, le=MAX_BYTES, description="Byte budget per model; default: 80% of shm.sizeLimit."
    )
    ttl_seconds: int | None = Field(default=None, ge=1, le=2**31 - 1, description="Evict entries older than this.")


class Ports(Schema):
    """Ports inside each pod; engines get consecutive ports, encoders first (with Pools, the pool pods'
    encoders and the units' consumers are each numbered from engineBase)."""

    router: int = Field(
        default=8000,
        ge=1,
        le=65535,
        description="The unit's front port (the Service's `http`): the EPD proxy's, or vllm-router's without it.",
    )
    router_loopback: int = Field(
        default=8001,
        ge=1,
        le=65535,
        description="vllm-router's port behind the EPD proxy, on the pod's loopback only.",
    )
    engine_base: int = Field(default=8100, ge=1, le=65000, description="First engine HTTP port.")
    nixl_side_channel_base: int = Field(
        default=5600, ge=1, le=65000, description="First NIXL side-channel port (prefill/decode)."
    )
    ec_side_channel_base: int = Field(
        default=5700,
        ge=1,
        le=65000,
        description="First ECCPUConnector side-channel port (VLLM_EC_SIDE_CHANNEL_PORT of a Pools model's encoders).",
    )


class Probes(Schema):
    """Engine health probes on /health; the startup window is sized for model loading."""

    period_seconds: int = Field(default=10, ge=1, le=3600, description="Probe period.")
    startup_timeout_seconds: int = Field(
        default=1800, ge=10, le=86400, description="How long an engine may take to load its model."
    )
    failure_threshold: int = Field(
        default=3,
        ge=1,
        le=100,
        description=(
            "Failed readiness probes before an engine is unready. Its liveness probe, which restarts it, "
            "waits three times as many and allows 10 s a probe: a busy engine answers /health late, "
            "and a restart would drop every request it serves."
        ),
    )
    stall_seconds: int = Field(
        default=120,
        ge=0,
        le=86400,
        description=(
            "An engine whose API server has had requests in flight for this long in all while no engine "
            "step finished fails its liveness probe, and the kubelet restarts it: vLLM's /health stays 200 while "
            "its engine core hangs. An engine paused (/pause, for a weight update) or asleep is not "
            "stalled. Longer than the longest step (a long prefill, a large video's encode). The check "
            "runs every periodSeconds (at least 10 s: it starts a process in the engine's container), so a "
            "stalled engine is restarted about stallSeconds plus three times failureThreshold periods later. "
            "0: liveness is /health alone."
        ),
    )


class Termination(Schema):
    """How a unit or pool pod stops (a rollout, a scale-down, a drain)."""

    grace_period_seconds: int = Field(
        default=120,
        ge=1,
        le=86400,
        description=(
            "The pod's terminationGracePeriodSeconds: how long its engines may finish in-flight requests "
            "after the drain, before the kubelet kills them."
        ),
    )
    drain_seconds: int = Field(
        default=10,
        ge=0,
        le=3600,
        description=(
            "Each container's preStop sleep: the pod is already out of its Services' endpoints, so new "
            "requests stop coming while in-flight ones go on; only then does the container get SIGTERM. "
            "Below gracePeriodSeconds; 0: none."
        ),
    )


class EPDDeploymentSpec(Schema):
    """Desired state: models served with encoder-prefill disaggregation."""

    image: str = Field(min_length=1, max_length=512, description="vLLM image, e.g. vllm/vllm-openai:v0.34.0.")
    vllm_version: str | None = Field(
        default=None,
        max_length=64,
        pattern=r"^v?[0-9]+\.[0-9]+(\.[0-9]+)?([.+-].*)?$",
        description="vLLM version (selects argument templates); default: parsed from the image tag.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        # The status is bounded whatever the count (units are listed in EndpointSlices, not in it).
        le=10000,
        description="EPD units per model (one pod each). The scale subresource: `kubectl scale`, HPA, KEDA.",
    )
    max_unavailable: int | str = Field(
        default=1,
        description=(
            "Units of a model that may be unavailable at once, as a number (1 or more) or a percentage "
            "of replicas ('25%'): the PodDisruptionBudget of the model's units, and the StatefulSet's "
            "rolling update (above 1 only where the MaxUnavailableStatefulSet feature gate is on; "
            "elsewhere units roll one at a time)."
        ),
    )
    models: list[ModelSpec] = Field(min_length=1, max_length=16, description="Served models.")
    ec_connector: ECConnector = Field(default_factory=ECConnector, description="EC connector.")
    ec_storage: ECStorage = Field(default_factory=ECStorage, description="EC store bounds.")
    kv_connector: KVConnector = Field(default_factory=KVConnector, description="KV connector.")
    router: Router = Field(default_factory=Router, description="vllm-router settings.")
    service: FrontService = Field(default_factory=FrontService, description="Each model's front Service.")
    proxy: Proxy = Field(default_factory=Proxy, description="The EPD proxy in front of each unit.")
    gateway: Gateway = Field(default_factory=Gateway, description="The EPD gateway in front of each model's units.")
    network_policy: NetworkPolicySpec = Field(
        default_factory=NetworkPolicySpec, description="Who reaches the pods (a NetworkPolicy the operator owns)."
    )
    autoscaling: DeploymentAutoscaling = Field(
        default_factory=DeploymentAutoscaling,
        description="KEDA autoscalers of the units and of the models' encoder pools, and where they read the signal.",
    )
    api_key: APIKey | None = Field(
        default=None,
        description=(
            "Every engine requires `Authorization: Bearer <key>` on its API (/v1, /inference): VLLM_API_KEY from "
            "this Secret. vllm-router passes the client's header on; epd_client sends it (api_key=)."
        ),
    )
    shm: Shm = Field(default_factory=Shm, description="Shared /dev/shm emptyDir.")
    ports: Ports = Field(default_factory=Ports, description="Container ports.")
    probes: Probes = Field(default_factory=Probes, description="Engine probes.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64, description="Environment for every engine.")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32, description="Pod nodeSelector.")
    tolerations: list[OpenObject] = Field(default_factory=list, max_length=32, description="Pod tolerations.")
    affinity: OpenObject | None = Field(default=None, description="Pod affinity.")
    priority_class_name: str | None = Field(default=None, max_length=253, description="Pod priorityClassName.")
    service_account_name: str | None = Field(default=None, max_length=253, description="Pod serviceAccountName.")
    image_pull_secrets: list[OpenObject] = Field(
        default_factory=list, max_length=16, description="Pod imagePullSecrets."
    )
    termination: Termination = Field(default_factory=Termination, description="How unit and pool pods stop.")
    pod_security_context: OpenObject | None = Field(
        default=None,
        description=(
            "Merged over the pods' securityContext (default: runAsNonRoot, uid/gid 65532, seccomp RuntimeDefault: "
            "Pod Security restricted), for images that need another uid or an fsGroup."
        ),
    )
    security_context: OpenObject | None = Field(
        default=None,
        description=(
            "Merged over every container's securityContext (default: no privilege escalation, every "
            "capability dropped). Loosening it can take the pods out of Pod Security restricted."
        ),
    )
    server_dev_mode: bool = Field(
        default=False,
        description=(
            "Run every engine with VLLM_SERVER_DEV_MODE=1, which serves vLLM's development endpoints "
            "(/pause, /resume, /reset_prefix_cache, ...) that RL trainers call around a weight sync. "
            "Only for engines no untrusted client can reach."
        ),
    )
    volumes: list[OpenObject] = Field(
        default_factory=list, max_length=32, description="Extra pod volumes (e.g. a model cache PVC); no hostPath."
    )
    volume_mounts: list[OpenObject] = Field(
        default_factory=list, max_length=32, description="Extra mounts for every engine container."
    )

    def model(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)

    def pool_shm(self, model: ModelSpec) -> Shm:
        """The /dev/shm of the model's encoder pool pods (placement Pools): its own, else spec.shm."""
        pool = model.encoder_pool
        return pool.shm if pool is not None and pool.shm is not None else self.shm

    def engine_env(self, group: ServerGroup, group_path: str) -> dict[str, tuple[str, EnvVar]]:
        """The variables a group's engines get from the spec, each with the field that sets it:
        spec.env, then the group's env, which wins for a name both set (as in their pods)."""
        env = {e.name: (f"spec.env[{i}]", e) for i, e in enumerate(self.env)}
        return env | {e.name: (f"{group_path}.env[{i}]", e) for i, e in enumerate(group.env)}


class Condition(Schema):
    """A Kubernetes-style condition."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""
    last_transition_time: str
    observed_generation: int | None = None


# Units and pool pods listed by name in the status, at most: a status must stay far below the
# object size etcd accepts (1.5 MiB) whatever the number of units; every other one is counted.
LISTED_PODS = 10


class EngineEndpoint(Schema):
    """One engine of every unit (or encoder pool pod): a pod's engine `name` is at
    http://<the pod's IP>:<port>, its IP in the EndpointSlices of the Service that lists the pods."""

    name: str = Field(description="Container name, e.g. encoder-0 or prefill-1.")
    role: WorkerType = Field(description="encoder, regular, prefill or decode.")
    port: int


class UnreadyPod(Schema):
    """A unit or encoder pool pod that is not ready, and why."""

    name: str
    node: str | None = None
    reason: str = Field(
        description="EncoderUnready, EncoderStarting, EngineUnready, EngineStarting, Unschedulable, PodMissing, ..."
    )
    message: str | None = None


class EncoderPoolStatus(Schema):
    """A Pools model's encoder pool: its StatefulSet, Service and what its pods say."""

    name: str = Field(description="The pool's StatefulSet; its pods are <name>-0 to <name>-<replicas - 1>.")
    service: str = Field(description="Its headless Service, whose EndpointSlices list the pods with an IP.")
    replicas: int
    ready_pods: int = 0
    autoscaler: str | None = Field(
        default=None,
        description=(
            "Its KEDA ScaledObject (spec.models[].encoderAutoscaling), which sizes it: `kubectl get hpa "
            "keda-hpa-<autoscaler>` shows the signal, its target and the size chosen; `replicas` is that size."
        ),
    )
    engines: list[EngineEndpoint] = Field(default_factory=list, description="The engines of each pool pod.")
    unready_reasons: dict[str, int] = Field(default_factory=dict, description="Pods not ready, by reason.")
    unready: list[UnreadyPod] = Field(
        default_factory=list, max_length=LISTED_PODS, description="The first pods not ready (broken ones first)."
    )


class ModelStatus(Schema):
    """One model's units: what each has (the same for every unit) and how many are ready. Where
    each unit is, the EndpointSlices of `unitsService` say: an endpoint per unit pod with an IP
    (its name in targetRef, its node), `conditions.serving` its readiness."""

    name: str
    served_model_name: str
    ec_storage_path: str | None = None
    ec_storage_max_bytes: int | None = None
    placement: Placement | None = None
    stateful_set: str | None = Field(
        default=None, description="The units' StatefulSet: unit i is its pod <statefulSet>-<i>."
    )
    units_service: str | None = Field(
        default=None, description="The headless Service listing every unit (not ready ones too) in its EndpointSlices."
    )
    desired_units: int = 0
    ready_units: int = 0
    updated_units: int = Field(default=0, description="Units running the current spec's pod template.")
    engines: list[EngineEndpoint] = Field(
        default_factory=list, description="The engines of each unit, encoders first (a Pools unit has no encoder)."
    )
    entry_port: int | None = Field(
        default=None,
        description="Each unit's front door, for any OpenAI client: its EPD proxy, else its router, else its only "
        "consumer.",
    )
    router_port: int | None = Field(
        default=None, description="Its vllm-router, where reachable (behind the EPD proxy it serves the loopback only)."
    )
    unready_reasons: dict[str, int] = Field(default_factory=dict, description="Units not ready, by reason.")
    unready: list[UnreadyPod] = Field(
        default_factory=list, max_length=LISTED_PODS, description="The first units not ready (broken ones first)."
    )
    ec_evictions: int | None = Field(
        default=None,
        description="EC entries its units' janitors evicted for budget since they started (scraped; unset until one "
        "was).",
    )
    fallback_encodes: int | None = Field(
        default=None,
        description="Images its units' consumers encoded themselves, not finding them in the EC store (cache misses), "
        "since their janitors started (scraped; unset until one was).",
    )
    encoder_pool: EncoderPoolStatus | None = None


class EPDDeploymentStatus(Schema):
    """Observed state, written by the operator."""

    observed_generation: int | None = None
    phase: str | None = None
    ready: str | None = Field(default=None, description="Ready units / desired units, e.g. 2/2.")
    updated: str | None = Field(default=None, description="Units on the current spec / desired units, e.g. 1/2.")
    replicas: int | None = Field(
        default=None, description="Units per model that exist (the fewest over the models): the scale subresource's."
    )
    selector: str | None = Field(default=None, description="Label selector of the unit pods (scale subresource).")
    model_count: int | None = None
    fallback_encodes: int | None = Field(
        default=None, description="Sum of every model's fallbackEncodes (unset until a janitor was scraped)."
    )
    conditions: list[Condition] = Field(default_factory=list)
    models: list[ModelStatus] = Field(default_factory=list)
