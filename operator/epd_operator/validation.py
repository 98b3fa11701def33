"""The one validation gate: every rule that can reject a spec, and the checked spec it returns.

The seed's topology rules are one table; the same table generates the CRD's CEL rules
(`crd.py`), so the API server (at apply time) and the operator (for clusters without CEL, or
objects written before the rules) give one verdict. The operator, `render` and `convert` all
call `validate`; rendering a CheckedSpec cannot fail. One module, though past 350 lines: a
rule split from the gate could be skipped by a caller.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from .api import DNS1123_LABEL, EPDDeploymentSpec, ModelSpec, ServerGroup
from .ec.connectors import MOONCAKE_CONNECTOR, ec_config_errors
from .ec.quantity import BYTE_QUANTITY, MAX_BYTES, parse_quantity
from .ec.regions import region_errors, uses_cpu_regions
from .engine_args import SUPPORTED_MINORS, environ_errors, override_errors
from .layout import Block, pod_gpus, pool_ports, unit_ports

SUPPORTED_VLLM_VERSIONS = SUPPORTED_MINORS

# Pod wiring the operator derives from other spec fields (probes, Services, GPU requests and the
# router depend on them): an override would silently break it, so it is refused instead.
OWNED_ARGS = {
    "model": "models[].model",
    "served_model_name": "models[].servedModelName",
    "port": "ports.engineBase",
    "tensor_parallel_size": "serverGroups[].numGpusPerEngine",
    "allowed_media_domains": "proxy.media.allowedDomains",
}

# Wiring no spec field moves, which the operator sets all the same.
OWNED_WIRING = {
    "host": "an engine listens on every address of its pod; its Services and NetworkPolicy decide who reaches it",
}

# Keys inside the transfer configs the operator renders that no override may set. The seed
# keeps a group's overrides above the rendered EC and KV roles and connectors (an encoder may
# be made ec_both): only the model's own EC store is the operator's alone, or two models, or
# two EPDDeployments, could read each other's embeddings.
OWNED_TRANSFER_KEYS = {
    ("ec_transfer_config", "ec_connector_extra_config", "shared_storage_path"): (
        "ecConnector.storageRoot and .pathPrefix (every model has a store of its own)"
    ),
}

# Arguments no EPDDeployment may give an engine, and why.
REFUSED_ARGS = {
    "allowed_local_media_path": (
        "it lets any client that reaches the engine read its files through file: media URLs; media come over "
        "http(s) or as data: URLs (docs/security.md)"
    ),
}

# Secrets vLLM also reads from the environment: an argument would show in the pod spec, in
# `ps` and in every log line that prints the command.
SECRET_ARGS = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}

# vllm-router's arguments the operator renders, and its secret one.
ROUTER_OWNED_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--worker-urls",
        "--policy",
        "--request-timeout-secs",
        "--vllm-pd-disaggregation",
        "--prefill",
        "--decode",
        "--kv-connector",
    }
)
ROUTER_SECRET_FLAGS = frozenset({"--api-key"})

# vllm-router's `--kv-connector` choices, by vLLM KV connector class. vLLM's ExampleConnector
# (KV blocks as files on one node, for testing) reads none of the router's kv_transfer_params:
# any choice serves it.
ROUTER_KV_CONNECTORS = {
    "NixlConnector": "nixl",
    "MooncakeConnector": "mooncake",
    "MoRIIOConnector": "moriio",
    "ExampleConnector": "nixl",
}


# Bounds on what one EPDDeployment may ask for: its reconciles cost the operator time in
# proportion (every tenant's objects share the operator).
MAX_ENGINES = 256  # vLLM engines in all its models' pods together (CEL checks it too)
DEFAULT_MAX_GPUS_PER_POD = 64  # more than any node has: a bigger pod would never schedule

# An EPDDeployment's name becomes part of every child's name and the value of their labels:
# a DNS-1035 label (Service names are) of at most 63 characters (label values are).
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 63


@dataclass(frozen=True)
class Limits:
    """Bounds the operator holds every spec to beyond the CRD's own, set on the operator
    (`epd-operator run --max-gpus-per-pod`, the chart's `limits.maxGpusPerPod`)."""

    max_gpus_per_pod: int = DEFAULT_MAX_GPUS_PER_POD


def name_errors(name: str) -> list[str]:
    if len(name) <= MAX_NAME_LENGTH and re.fullmatch(NAME_PATTERN, name):
        return []
    return [
        (
            f"metadata.name: {name!r} is not a DNS-1035 label of at most {MAX_NAME_LENGTH} characters (lowercase "
            "letters, digits and '-', starting with a letter): it names the Services and labels the pods; choose "
            "another name"
        )
    ]


def size_errors(spec: EPDDeploymentSpec, limits: Limits) -> list[str]:
    """More engines than one EPDDeployment may have, more GPUs in one pod than a node can have,
    or a /dev/shm larger than Kubernetes can hold."""
    errors = []
    engines = sum(m.encoder_engines + m.consumer_engines for m in spec.models)
    if engines > MAX_ENGINES:
        errors.append(
            f"spec.models: {engines} engines in all, more than the {MAX_ENGINES} one EPDDeployment may have: "
            "lower numGpus, raise numGpusPerEngine, or split the models over several EPDDeployments"
        )
    for index, model in enumerate(spec.models):
        for pod, gpus in pod_gpus(model).items():
            if gpus > limits.max_gpus_per_pod:
                errors.append(
                    f"spec.models[{index}].serverGroups: {pod} of model '{model.name}' would need {gpus} GPUs, more "
                    f"than the {limits.max_gpus_per_pod} a pod may have here (no node has more; the operator's "
                    "--max-gpus-per-pod): lower numGpus"
                )
    shms = [("spec.shm.sizeLimit", spec.shm)] + [
        (f"spec.models[{i}].encoderPool.shm.sizeLimit", m.encoder_pool.shm)
        for i, m in enumerate(spec.models)
        if m.encoder_pool is not None and m.encoder_pool.shm is not None
    ]
    for field, shm in shms:
        if parse_quantity(shm.size_limit) > MAX_BYTES:
            errors.append(f"{field}: {shm.size_limit} is more bytes than Kubernetes can hold (at most 8Ei)")
    return errors


@dataclass(frozen=True)
class CheckedSpec:
    """A spec that passed every rule of `validate`, with what the rules worked out."""

    spec: EPDDeploymentSpec
    vllm_minor: str  # "0.33": selects the argument templates


@dataclass(frozen=True)
class LayoutRule:
    """A layout is rejected when it has every type in `present`, at least one of `any_of`
    (when given) and none of `absent`."""

    present: frozenset[str]
    absent: frozenset[str]
    message: str
    any_of: frozenset[str] = frozenset()

    def violated_by(self, types: set[str]) -> bool:
        return self.present <= types and (not self.any_of or bool(self.any_of & types)) and not (self.absent & types)


def _rule(present: str, absent: str, message: str, any_of: str = "") -> LayoutRule:
    return LayoutRule(frozenset(present.split()), frozenset(absent.split()), message, frozenset(any_of.split()))


# Valid per model: {encoder, regular}, {encoder, prefill, decode}, {regular}, {prefill, decode}.
LAYOUT_RULES: tuple[LayoutRule, ...] = (
    _rule(
        "regular",
        "",
        "regular cannot be mixed with prefill or decode: use regular groups, or a prefill and a decode group",
        any_of="prefill decode",
    ),
    _rule("encoder prefill", "decode", "encoder+prefill is incomplete: add a decode group"),
    _rule("encoder decode", "prefill", "encoder+decode is incomplete: add a prefill group"),
    _rule(
        "encoder",
        "regular prefill decode",
        "an encoder group alone serves nothing: add a regular group, or a prefill and a decode group",
    ),
    _rule("prefill", "decode encoder regular", "prefill without decode: add a decode group"),
    _rule("decode", "prefill encoder regular", "decode without prefill: add a prefill group"),
)


@dataclass(frozen=True)
class ModelRule:
    """A rule on one model, stated twice: `cel` (the CRD's rule on a model, true when valid) and
    `violated_by` (Python), so the API server and the operator agree (tests/api check both)."""

    cel: str
    message: str
    violated_by: Callable[[ModelSpec], bool]


# Placement rules. The CRD defaults placement to Unit, so CEL always sees it.
PLACEMENT_RULES: tuple[ModelRule, ...] = (
    ModelRule(
        "!(self.placement == 'Pools' && !self.serverGroups.exists(g, g.workerType == 'encoder'))",
        "placement Pools needs an encoder group: a model without encoders has nothing to pool (use placement Unit)",
        lambda m: m.pooled and not m.has_encoders,
    ),
    ModelRule(
        "!(self.placement == 'Pools' && has(self.ecConnector) && self.ecConnector.name == 'ECExampleConnector')",
        "placement Pools cannot use ECExampleConnector: it exchanges embeddings as files in a node-local "
        "/dev/shm, which cannot span nodes; use ECCPUConnector (the default for Pools: leave ecConnector.name unset)",
        lambda m: m.pooled and m.ec_connector is not None and m.ec_connector.name == "ECExampleConnector",
    ),
    ModelRule(
        "!(self.placement == 'Pools' && has(self.ecConnector) && self.ecConnector.name == 'ECMooncakeConnector' && "
        "self.serverGroups.exists(g, g.workerType == 'encoder' && has(g.numGpusPerEngine) && g.numGpusPerEngine > 1))",
        "ECMooncakeConnector's producers (the encoder groups) run tensor_parallel_size 1, and vLLM refuses more: "
        "set their numGpusPerEngine to 1",
        lambda m: (
            m.pooled
            and m.pools_connector.name == MOONCAKE_CONNECTOR
            and any(g.worker_type.is_encoder and g.num_gpus_per_engine > 1 for g in m.server_groups)
        ),
    ),
    ModelRule(
        "!(self.placement != 'Pools' && has(self.ecConnector))",
        "ecConnector is for placement Pools: a Unit model uses spec.ecConnector",
        lambda m: not m.pooled and m.ec_connector is not None,
    ),
)


def layout_errors(model: ModelSpec) -> list[str]:
    """Messages for every layout rule this model breaks (empty when the layout is valid)."""
    types = {t.value for t in model.worker_types}
    return [f"model '{model.name}': {r.message}" for r in LAYOUT_RULES if r.violated_by(types)]


def placement_errors(spec: EPDDeploymentSpec, index: int, model: ModelSpec) -> list[str]:
    """Placement rules, and for Pools: names, NIXL and the ECCPUConnector regions."""
    errors = [f"model '{model.name}': {r.message}" for r in PLACEMENT_RULES if r.violated_by(model)]
    if not model.pooled:
        return errors
    pool = f"{model.name}-encoders"
    if any(other.name == pool for other in spec.models):
        errors.append(
            f"spec.models[{index}].name: model '{model.name}' has placement Pools, whose encoder pool is named "
            f"like model '{pool}': rename one"
        )
    nixl = model.pools_connector.extra_config.get("ec_enable_nixl")
    if uses_cpu_regions(model) and nixl is not None and str(nixl).strip().lower() not in ("true", "1", "yes"):
        errors.append(
            f"spec.models[{index}].ecConnector.extraConfig.ec_enable_nixl: without NIXL ECCPUConnector reads only "
            "its own pod's region, and a Pools model's encoders run in other pods: remove it"
        )
    return errors + region_errors(spec, index, model)


class SpecError(ValueError):
    """An EPDDeployment spec that must not be reconciled; `errors` are user-facing messages."""

    def __init__(self, errors: list[str]):
        self.errors = errors
        super().__init__("; ".join(errors))


def port_errors(spec: EPDDeploymentSpec, index: int, model: ModelSpec) -> list[str]:
    """Ports a pod of the model would use twice, or past 65535: its engines could not all bind."""
    if model.pooled:
        return [*_range_errors(model, pool_ports(spec, model)), *_range_errors(model, unit_ports(spec, model))]
    return _range_errors(model, unit_ports(spec, model))


def _range_errors(model: ModelSpec, ranges: dict[str, Block]) -> list[str]:
    errors = []
    for name, (low, high) in ranges.items():
        if high > 65535 and name.startswith("ports."):
            errors.append(f"spec.{name}: model '{model.name}' needs ports {low}-{high}, past 65535: lower it")
    names = list(ranges)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            (a_low, a_high), (b_low, b_high) = ranges[first], ranges[second]
            if a_low <= b_high and b_low <= a_high:
                fix = first if first.startswith("ports.") else second
                errors.append(
                    f"spec.{fix}: model '{model.name}' would use ports {a_low}-{a_high} for {first} and "
                    f"{b_low}-{b_high} for {second}: move one range"
                )
    return errors


def owned_arg_errors(group: ServerGroup, where: str) -> list[str]:
    """Overrides that set wiring the operator owns, nested keys of the transfer configs
    included, secrets, and values argparse would read as flags (engine_args.override_errors
    checks the names)."""
    errors = []
    for name, value in group.overrides.items():  # one spelling per argument: ServerGroup normalised them
        if name in OWNED_ARGS:
            errors.append(f"{where}.{name}: set by the operator from spec.{OWNED_ARGS[name]}; change that instead")
        elif name in OWNED_WIRING:
            errors.append(f"{where}.{name}: set by the operator ({OWNED_WIRING[name]}): remove it")
        elif name in REFUSED_ARGS:
            errors.append(f"{where}.{name}: refused: {REFUSED_ARGS[name]}")
        elif name in SECRET_ARGS:
            errors.append(
                f"{where}.{name}: a secret must not be an argument (it would show in the pod spec and in logs): "
                f"remove it and set {SECRET_ARGS[name]} from a Secret with env[].valueFrom.secretKeyRef"
                + (" (or spec.apiKey)" if name == "api_key" else "")
            )
        errors += _flag_like_values(value, f"{where}.{name}")
    for path, source in OWNED_TRANSFER_KEYS.items():
        if _has_path(group.overrides, path):
            errors.append(f"{where}.{'.'.join(path)}: set by the operator from spec.{source}; change that instead")
    return errors


# What a server group's engines may be made into: EPD serves generation. A pooling engine's
# routes (/v1/embeddings, /pooling, /classify, /score, /rerank) would encode their media on the
# consumer, and the EPD proxy primes generation routes only (docs/proxy.md).
GENERATION_ONLY = {"runner": ("auto", "generate"), "convert": ("auto", "none")}


def generation_only_errors(group: ServerGroup, where: str) -> list[str]:
    """Overrides that would make an engine a pooling one (``runner``, ``convert``)."""
    return [
        f"{where}.{name}: {group.overrides[name]!r} would make a pooling engine, whose media its consumers "
        f"would encode themselves (the EPD proxy primes generation only): use one of {', '.join(allowed)} or "
        "remove it"
        for name, allowed in GENERATION_ONLY.items()
        if group.overrides.get(name) not in (None, *allowed)  # None: vLLM's default, auto
    ]


def _has_path(tree: Any, path: tuple[str, ...]) -> bool:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


# `-x` or `--x`: an argument vLLM's parser would read as a flag of its own, not as a value.
_FLAG_LIKE = re.compile(r"^--?[A-Za-z]")


def _flag_like_values(value: Any, where: str) -> list[str]:
    """A string value, or a list item, that would reach the command line looking like a flag."""
    items = value if isinstance(value, list) else [value]
    return [
        f"{where}: {item!r} starts with '-': on the command line it would be read as a flag of its own, not as "
        "a value: remove it"
        for item in items
        if isinstance(item, str) and _FLAG_LIKE.match(item)
    ]


def router_arg_errors(spec: EPDDeploymentSpec) -> list[str]:
    """extraArgs that repeat what the operator renders for vllm-router, or carry a secret."""
    errors = []
    for index, arg in enumerate(spec.router.extra_args):
        flag = arg.split("=", 1)[0]
        if flag in ROUTER_OWNED_FLAGS:
            errors.append(f"spec.router.extraArgs[{index}]: {flag} is set by the operator: remove it")
        elif flag in ROUTER_SECRET_FLAGS:
            errors.append(
                f"spec.router.extraArgs[{index}]: {flag} would put a secret in the pod spec and its logs: remove it "
                "and set spec.apiKey.secretKeyRef"
            )
    return errors


# At least one unit: a StatefulSet cannot roll with 0, and a budget of 0 blocks every drain.
MAX_UNAVAILABLE_PERCENT = r"^([1-9][0-9]?|100)%$"


def max_unavailable_errors(spec: EPDDeploymentSpec) -> list[str]:
    value = spec.max_unavailable
    if isinstance(value, int) and value >= 1 or isinstance(value, str) and re.match(MAX_UNAVAILABLE_PERCENT, value):
        return []
    return [f"spec.maxUnavailable: {value!r} is not a unit count of 1 or more, nor a percentage from 1% to 100%"]


DRAIN_WITHIN_GRACE = (
    "the drain must end before the grace period does, or the kubelet kills the engines while they drain: "
    "lower spec.termination.drainSeconds or raise gracePeriodSeconds"
)


def termination_errors(spec: EPDDeploymentSpec) -> list[str]:
    termination = spec.termination
    if termination.drain_seconds < termination.grace_period_seconds:
        return []
    return [
        (
            f"spec.termination.drainSeconds: {termination.drain_seconds} s is not below gracePeriodSeconds "
            f"({termination.grace_period_seconds} s): {DRAIN_WITHIN_GRACE}"
        )
    ]


PRIME_ATTEMPT_WITHIN_PRIME = (
    "one prime attempt cannot outlast priming with all its retries (primeTimeoutSeconds), and no retry would "
    "reach another encoder: lower spec.proxy.primeAttemptTimeoutSeconds or raise primeTimeoutSeconds"
)


def proxy_errors(spec: EPDDeploymentSpec) -> list[str]:
    errors = []
    attempt, whole = spec.proxy.prime_attempt_timeout_seconds, spec.proxy.prime_timeout_seconds
    if attempt is not None and attempt > whole:
        errors.append(
            f"spec.proxy.primeAttemptTimeoutSeconds: {attempt} s is longer than primeTimeoutSeconds ({whole} s): "
            f"{PRIME_ATTEMPT_WITHIN_PRIME}"
        )
    for model in spec.models:
        try:
            spec.proxy.limits(model)
        except ValueError as error:
            errors.append(
                f"spec.proxy (model '{model.name}'): {error}: raise maxBufferedBytes or lower maxRequestBytes"
            )
            break
    return errors


def autoscaling_errors(spec: EPDDeploymentSpec) -> list[str]:
    """The autoscalers' bounds, and what their signals need: Prometheus, and the EPD proxies that
    export them."""
    scalers = [("spec.autoscaling.units", spec.autoscaling.units)] + [
        (f"spec.models[{i}].encoderAutoscaling", m.encoder_autoscaling) for i, m in enumerate(spec.models)
    ]
    errors = []
    for where, scaler in scalers:
        if scaler is None:
            continue
        if scaler.min_replicas == 0:
            errors.append(
                f"{where}.minReplicas: 0 (scale from zero) is not supported yet: the first request would find no pod "
                "to wake it; set 1 or more"
            )
        if scaler.min_replicas > scaler.max_replicas:
            errors.append(
                f"{where}: minReplicas ({scaler.min_replicas}) is above maxReplicas ({scaler.max_replicas}): raise "
                "maxReplicas or lower minReplicas"
            )
        if spec.autoscaling.prometheus_address is None:
            errors.append(
                f"{where}: the autoscaler reads its signal from Prometheus: set spec.autoscaling.prometheusAddress "
                "(e.g. http://prometheus-operated.monitoring.svc:9090)"
            )
        if not spec.proxy.enabled:
            errors.append(
                f"{where}: the autoscaler's signal comes from the units' EPD proxies: set spec.proxy.enabled to true"
            )
    for index, model in enumerate(spec.models):
        if model.encoder_autoscaling is not None and not model.pooled:
            errors.append(
                f"spec.models[{index}].encoderAutoscaling: the model's encoders are in its units (placement Unit), "
                "sized with them: autoscale the units (spec.autoscaling.units), or set placement Pools"
            )
    return errors


def gateway_errors(spec: EPDDeploymentSpec) -> list[str]:
    """The weights version reaches requests through the gateway, and the gateway fronts the
    units' proxies: neither works without the other."""
    errors = []
    if spec.gateway.enabled and not spec.proxy.enabled:
        errors.append(
            "spec.gateway.enabled: the gateway sends requests to the units' EPD proxies, which key and prime their "
            "media: set spec.proxy.enabled to true, or spec.gateway.enabled to false"
        )
    if spec.gateway.inference_pool.enabled and not spec.gateway.enabled:
        errors.append(
            "spec.gateway.inferencePool.enabled: the InferencePool's endpoint picker is the model's EPD gateway, "
            "and the gateway is off: set spec.gateway.enabled to true, or spec.gateway.inferencePool.enabled to false"
        )
    for index, model in enumerate(spec.models):
        if model.weights_version is not None and not spec.gateway.enabled:
            errors.append(
                f"spec.models[{index}].weightsVersion: the model's EPD gateway sends it with each request, and the "
                "gateway is off: set spec.gateway.enabled to true (or leave weightsVersion unset and send the "
                "X-EPD-Weights-Version header with each request)"
            )
    return errors


HEADLESS_NEEDS_CLUSTER_IP = (
    "a headless Service has no virtual IP, which a NodePort or LoadBalancer Service needs: "
    "set spec.service.type to ClusterIP, or headless to false"
)


def service_errors(spec: EPDDeploymentSpec) -> list[str]:
    if spec.service.headless and spec.service.type != "ClusterIP":
        return [f"spec.service.headless: {HEADLESS_NEEDS_CLUSTER_IP} (type is {spec.service.type})"]
    return []


def router_errors(spec: EPDDeploymentSpec, model: ModelSpec) -> list[str]:
    if model.is_pd and spec.kv_connector.name not in ROUTER_KV_CONNECTORS:
        return [
            (
                f"spec.kvConnector.name: vllm-router coordinates prefill/decode only with "
                f"{', '.join(ROUTER_KV_CONNECTORS)} (model '{model.name}' has prefill/decode groups)"
            )
        ]
    return []


def engine_environ_errors(spec: EPDDeploymentSpec, minor: str) -> list[str]:
    """What each group's engines would refuse at start in the environment the spec gives them
    (spec.env, then the group's env, which wins for a name it sets too); each field once."""
    errors: dict[str, None] = {}
    for index, model in enumerate(spec.models):
        for g_index, group in enumerate(model.server_groups):
            env = spec.engine_env(group, f"spec.models[{index}].serverGroups[{g_index}]")
            found = [(where, name, e.value if e.value_from is None else None) for name, (where, e) in env.items()]
            strict = group.overrides.get("fail_on_environ_validation") is True
            errors |= dict.fromkeys(environ_errors(minor, found, fail_on_unknown=strict))
    return list(errors)


def vllm_minor(spec: EPDDeploymentSpec) -> str:
    """The vLLM minor version ("0.33") from `vllmVersion`, else from the image tag."""
    if spec.vllm_version:
        source, text = "spec.vllmVersion", spec.vllm_version
    else:
        source, text = "spec.image", _image_tag(spec.image)
    # The same grammar as the CRD's CEL rule: ASCII digits, no leading zeros, and a tag suffix
    # that cannot run into another part of the image reference.
    suffix = r"(?:[.+-].*)?" if spec.vllm_version else r"(?:[.+-][^/:@]*)?"
    match = re.fullmatch(r"v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)" + suffix, text or "", re.ASCII)
    if not match:
        raise SpecError(
            [
                (
                    f"{source}: cannot tell the vLLM version from {text or spec.image!r}: "
                    f"set spec.vllmVersion to one of {', '.join(SUPPORTED_VLLM_VERSIONS)}"
                )
            ]
        )
    minor = f"{int(match[1])}.{int(match[2])}"
    if minor not in SUPPORTED_VLLM_VERSIONS:
        raise SpecError(
            [
                (
                    f"{source}: vLLM {minor} is not supported: use one of "
                    f"{', '.join(SUPPORTED_VLLM_VERSIONS)} (argument templates exist only for those)"
                )
            ]
        )
    return minor


def _image_tag(image: str) -> str:
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


# What a pattern means, for people: a regex in an error message tells them little.
_PATTERN_HINTS = {
    DNS1123_LABEL: "a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit",
    BYTE_QUANTITY: "a byte quantity such as 16Gi, 512Mi or 1e9",
}


def _pydantic_messages(error: pydantic.ValidationError) -> list[str]:
    messages = []
    for item in error.errors():
        path = "spec" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in item["loc"])
        hint = _PATTERN_HINTS.get((item.get("ctx") or {}).get("pattern", ""))
        if item["type"] == "string_pattern_mismatch" and hint:
            messages.append(f"{path}: {item['input']!r} is not {hint}")
        elif item["type"] == "value_error":  # our own validators' messages, without pydantic's prefix
            messages.append(f"{path}: {(item.get('ctx') or {}).get('error', item['msg'])}")
        else:
            messages.append(f"{path}: {item['msg']}")
    return messages


def validate(raw: dict[str, Any], *, name: str | None = None, limits: Limits | None = None) -> CheckedSpec:
    """Parse and check a raw `.spec` (and the object's `name`, when given); raise SpecError
    listing every problem, each naming its field."""
    naming = name_errors(name) if name is not None else []
    try:
        spec = EPDDeploymentSpec.model_validate(raw)
    except pydantic.ValidationError as error:
        raise SpecError(naming + _pydantic_messages(error)) from None
    # The version first: overrides are checked against its engine arguments (its errors still come last).
    try:
        minor, version_errors = vllm_minor(spec), []
    except SpecError as error:
        minor, version_errors = None, error.errors
    errors: list[str] = naming + size_errors(spec, limits or Limits()) + router_arg_errors(spec)
    seen: set[str] = set()
    for index, model in enumerate(spec.models):
        if model.name in seen:
            errors.append(f"spec.models[{index}].name: model name '{model.name}' is used twice: names must be unique")
        seen.add(model.name)
        errors += layout_errors(model)
        errors += placement_errors(spec, index, model)
        errors += ec_config_errors(spec, index, model, minor)
        errors += port_errors(spec, index, model)
        errors += router_errors(spec, model)
        for g_index, group in enumerate(model.server_groups):
            where = f"spec.models[{index}].serverGroups[{g_index}].overrides"
            errors += owned_arg_errors(group, where)
            errors += generation_only_errors(group, where)
            if minor:
                errors += override_errors(minor, group.overrides, where)
            if group.num_gpus % group.num_gpus_per_engine:
                errors.append(
                    f"spec.models[{index}].serverGroups[{g_index}]: numGpus ({group.num_gpus}) must be "
                    f"a multiple of numGpusPerEngine ({group.num_gpus_per_engine})"
                )
    if minor:
        errors += engine_environ_errors(spec, minor)
    errors += max_unavailable_errors(spec)
    errors += service_errors(spec)
    errors += termination_errors(spec)
    errors += proxy_errors(spec)
    errors += gateway_errors(spec)
    errors += autoscaling_errors(spec)
    for volume in spec.volumes:
        if "hostPath" in volume:
            errors.append(
                f"spec.volumes: volume '{volume.get('name')}' uses hostPath: not allowed (use a PVC or emptyDir)"
            )
    errors += version_errors
    if errors or minor is None:
        raise SpecError(errors)
    return CheckedSpec(spec, minor)
