"""Desired Kubernetes objects for an EPDDeployment: pure functions of the validated spec.

With placement Unit, one EPD unit is one pod holding every engine of a model, because the
default EC connector exchanges embeddings as files: encoders and the consumers reading them
must share a node and a /dev/shm. With placement Pools the encoders form a pool of their own
pods and the units hold the consumers. Each model's units are the pods of one StatefulSet, its
encoder pool another (see docs/architecture.md).

One module for every child (both placements' StatefulSets, Services, budgets and their pod
templates), though past 350 lines: they share the labels, names and container builders.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import api, engine_liveness
from .ec.budget import effective_max_bytes
from .ec.quantity import byte_quantity, parse_quantity
from .layout import pool_ports, unit_ports
from .proxy_limits import SPELLINGS, Limits
from .render import EngineCommand, ModelPlan, RouterCommand

FIELD_MANAGER = "epd-operator"
SHM_VOLUME = "dshm"
GPU_RESOURCE = "nvidia.com/gpu"
FRONT_PORT_NAME = "http"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = f"{api.GROUP}/deployment"
LABEL_MODEL = f"{api.GROUP}/model"
LABEL_UNIT = f"{api.GROUP}/unit"
LABEL_ROLE = f"{api.GROUP}/role"
ANNOTATION_SPEC_HASH = f"{api.GROUP}/spec-hash"
ANNOTATION_EC_STORAGE_PATH = f"{api.GROUP}/ec-storage-path"
# Placement Pools: the encoder pool's pods carry this label (the model's name) instead of
# LABEL_MODEL, so no Service or StatefulSet of the model's units ever selects them.
LABEL_ENCODER_POOL = f"{api.GROUP}/encoder-pool"
# The EPD gateway's pods carry this label (the model's name) instead of LABEL_MODEL, so no
# Service or StatefulSet of the model's units selects them; the front Service selects them.
LABEL_GATEWAY = f"{api.GROUP}/gateway"
# The readiness gate of a Pools model's units: True while its encoder pool has a ready encoder.
ENCODERS_READY_GATE = f"{api.GROUP}/encoders-ready"
JANITOR_METRICS_PORT = api.JANITOR_METRICS_PORT
PROXY_METRICS_PORT = api.PROXY_METRICS_PORT
EPP_PORT = api.EPP_PORT
EPP_HEALTH_PORT = api.EPP_HEALTH_PORT

# Pod Security "restricted": every unit and pool pod runs as a non-root uid (vLLM's images run
# as root, with no user of their own), under the runtime's seccomp profile, and no container
# keeps a capability or may gain privileges. The janitor runs as the same uid as the engines:
# only the owner of the EC store's folders (0755) may delete in them.
UNIT_UID = 65532  # distroless' "nonroot": high, so it matches no user of the node
POD_SECURITY_CONTEXT: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": UNIT_UID,
    "runAsGroup": UNIT_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    # What vLLM writes goes to emptyDirs: HOME (its caches and config) and /tmp (torch's).
    "readOnlyRootFilesystem": True,
}
# A uid with no entry in the image's /etc/passwd gets HOME=/, which it cannot write; vLLM keeps
# its caches and config under HOME (~/.cache/vllm, ~/.config/vllm), so engines get one here.
HOME_VOLUME = "home"
TMP_VOLUME = "tmp"
# vLLM reads its API key from here when no --api-key is given.
API_KEY_ENV = "VLLM_API_KEY"
HOME_PATH = "/home/vllm"


def digest(obj: Mapping[str, Any]) -> str:
    """A short hash of a JSON document (a child's desired state, a status): equal exactly when
    the documents are."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def child_name(deployment: str, model: str, suffix: str = "", limit: int = 52) -> str:
    """`<deployment>-<model>[-suffix]`, shortened with a hash when too long.

    52 leaves room for the `-<revision hash>` the StatefulSet controller appends in pod labels.
    """
    full = "-".join(p for p in (deployment, model, suffix) if p)
    if len(full) <= limit:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    return f"{full[: limit - 9].rstrip('-.')}-{digest}"


def selector_labels(deployment: str, model: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_MODEL: model}


def unit_pod_selector(deployment: str) -> str:
    """Every unit pod of the deployment, as a label selector string (the scale subresource's)."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_COMPONENT}=unit"


def common_labels(deployment: str, model: str, role: str) -> dict[str, str]:
    return {
        LABEL_NAME: "epd",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: role,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_ROLE: role,
        **selector_labels(deployment, model),
    }


def network_policy_labels(deployment: str) -> dict[str, str]:
    return {
        LABEL_NAME: "epd",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: "network-policy",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_DEPLOYMENT: deployment,
    }


def _env(command: EngineCommand, extra: list[api.EnvVar], api_key: api.APIKey | None) -> list[dict[str, Any]]:
    """Rendered env, then the user's; a user variable of the same name replaces the rendered one.
    The API key comes from its Secret: an argument would show in the pod spec and in logs."""
    user = [e.model_dump(by_alias=True, exclude_none=True) for e in extra]
    overridden = {u["name"] for u in user}
    fields = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": path}}} for k, path in command.field_env.items()]
    rendered: list[dict[str, Any]] = [{"name": "HOME", "value": HOME_PATH}]
    rendered += [{"name": k, "value": v} for k, v in command.env.items()] + fields
    if api_key is not None:
        ref = {"name": api_key.secret_key_ref.name, "key": api_key.secret_key_ref.key}
        rendered.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    return [e for e in rendered if e["name"] not in overridden] + user


def _probes(port: int, probes: api.Probes, *, startup: bool = True, path: str = "/health") -> dict[str, Any]:
    """Startup (sized for loading the model), readiness and liveness probes on /health. Liveness
    is laxer than readiness: an engine busy with long prompts answers late, and taking it out of
    the Services costs nothing, while a restart drops every request it serves."""

    def probe(failures: int, **timeout: int) -> dict[str, Any]:
        get = {"path": path, "port": port}
        return {"httpGet": get, "periodSeconds": probes.period_seconds, "failureThreshold": failures, **timeout}

    found = {
        "readinessProbe": probe(probes.failure_threshold, timeoutSeconds=5),
        "livenessProbe": probe(3 * probes.failure_threshold, timeoutSeconds=10),
    }
    if startup:
        found["startupProbe"] = probe(math.ceil(probes.startup_timeout_seconds / probes.period_seconds))
    return found


def _without_docstrings(source: str) -> str:
    """Python source with its docstrings and comments left out: what an exec probe carries."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            node.body = kept or [ast.Pass()]  # type: ignore[attr-defined]  # only nodes that have a body list get here
    return ast.unparse(tree)


ENGINE_LIVENESS_SOURCE = _without_docstrings(Path(engine_liveness.__file__).read_text())


# An exec probe starts a process in the container (about 0.1 CPU-second with runc's exec): not
# more often than the kubelet's default period, however often readiness is probed.
LIVENESS_EXEC_MIN_PERIOD_SECONDS = 10
# An engine that failed its liveness probe serves nothing: it is killed this soon, not after the
# pod's grace period (meant for draining requests), which a hung engine core would use up whole.
LIVENESS_KILL_GRACE_SECONDS = 10


def _engine_probes(container: str, port: int, probes: api.Probes) -> dict[str, Any]:
    """``_probes``, with a liveness probe that fails a stalled engine core too (engine_liveness.py,
    run in the engine's own container: its python3 and its loopback), as lax as /health's;
    /health alone when stallSeconds is 0. Its record between probes goes to the pod's /tmp, one
    file per container."""
    found = _probes(port, probes)
    if not probes.stall_seconds:
        return found
    record = f"/tmp/epd-liveness-{container}.json"
    command = ["python3", "-c", ENGINE_LIVENESS_SOURCE, str(port), str(probes.stall_seconds), record]
    live = {k: v for k, v in found["livenessProbe"].items() if k != "httpGet"}
    found["livenessProbe"] = {
        "exec": {"command": command},
        **live,
        "periodSeconds": max(probes.period_seconds, LIVENESS_EXEC_MIN_PERIOD_SECONDS),
        "terminationGracePeriodSeconds": LIVENESS_KILL_GRACE_SECONDS,
    }
    return found


# Resources of a container that sets none (so that the scheduler counts every pod and a
# namespace's quotas can, and no container can take a node's memory): an engine's host
# processes (a large model's engine sets its own), the router.
# The janitor answers its /metrics at once, unless it is stuck.
JANITOR_PROBES = api.Probes(period_seconds=30)
ENGINE_RESOURCES = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "64Gi"}}
ROUTER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def _resources(
    gpus: int, extra: api.ResourceRequirements | None, default: Mapping[str, Mapping[str, str]], shm_bytes: int = 0
) -> dict[str, Any]:
    """The user's resources over `default` requests and limits; GPUs from numGpusPerEngine.
    `shm_bytes`: the pod's memory-backed /dev/shm, which counts against the memory of the
    container that writes it (the encoders' files): added to this container's default memory
    request and limit (each pod's first container carries it)."""
    limits: dict[str, Any] = dict(extra.limits) if extra else {}
    requests: dict[str, Any] = dict(extra.requests) if extra else {}
    for given, defaults in ((requests, default["requests"]), (limits, default["limits"])):
        for resource, amount in defaults.items():
            if resource not in given:
                given[resource] = amount
                if resource == "memory" and shm_bytes:
                    given[resource] = byte_quantity(parse_quantity(amount) + shm_bytes)
    if gpus:
        limits[GPU_RESOURCE] = gpus
        requests[GPU_RESOURCE] = gpus
    resources = {"requests": requests}
    if limits:
        resources["limits"] = limits
    return resources


def _lifecycle(spec: api.EPDDeploymentSpec) -> dict[str, Any]:
    """The drain before SIGTERM (api.Termination): a preStop sleep, which needs no binary in the image."""
    seconds = spec.termination.drain_seconds
    return {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}} if seconds else {}


def security_context(
    spec: api.EPDDeploymentSpec, base: Mapping[str, Any] = CONTAINER_SECURITY_CONTEXT
) -> dict[str, Any]:
    """A container's securityContext: `base` (restricted) with the user's spec.securityContext
    over it; a copy of its own (containers share no dict)."""
    return copy.deepcopy({**base, **(spec.security_context or {})})


def _engine_container(
    spec: api.EPDDeploymentSpec,
    model: api.ModelSpec,
    command: EngineCommand,
    front: bool,
    sidecar: bool = True,
    shm_bytes: int = 0,
) -> dict[str, Any]:
    group = model.server_groups[command.group_index]
    ports = [{"name": FRONT_PORT_NAME if front else command.container_name, "containerPort": command.port}]
    if command.nixl_port is not None:
        ports.append({"name": f"nixl-{command.engine_index}", "containerPort": command.nixl_port})
    if command.ec_side_channel_port is not None:
        ports.append({"name": f"ec-side-{command.engine_index}", "containerPort": command.ec_side_channel_port})
    container = {
        "name": command.container_name,
        "image": spec.image,
        "command": command.args[:2],
        "args": command.args[2:],
        "env": _env(command, [*spec.env, *group.env], spec.api_key),
        "ports": ports,
        "resources": _resources(command.gpus, group.resources, ENGINE_RESOURCES, shm_bytes),
        "volumeMounts": [
            {"name": SHM_VOLUME, "mountPath": "/dev/shm"},
            *spec.volume_mounts,
            {"name": HOME_VOLUME, "mountPath": HOME_PATH},
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
        ],
        **_engine_probes(command.container_name, command.port, spec.probes),
        **_lifecycle(spec),
        "securityContext": security_context(spec),
    }
    if command.worker_type.is_encoder and sidecar:
        # A native sidecar: the kubelet starts the consumers only after every encoder's
        # startupProbe passed, and an unready encoder makes the whole pod unready.
        container["restartPolicy"] = "Always"
    return container


def _router_container(spec: api.EPDDeploymentSpec, command: RouterCommand, *, front: bool) -> dict[str, Any]:
    return {
        "name": command.container_name,
        "image": spec.router.image,
        "command": command.args[:1],
        "args": command.args[1:],
        "env": [],
        "ports": [{"name": FRONT_PORT_NAME if front else command.container_name, "containerPort": command.port}],
        "resources": _resources(0, spec.router.resources, ROUTER_RESOURCES),
        # Behind the proxy it listens on the pod's loopback, where the kubelet's probes cannot
        # reach it: the proxy's readiness asks it through the front port instead. In front,
        # its startup window matters: it listens only once its consumers answer, and they load
        # their model meanwhile.
        **(_probes(command.port, spec.probes) if front else {}),
        **_lifecycle(spec),
        "securityContext": security_context(spec),
    }


def janitor_container(spec: api.EPDDeploymentSpec, plan: ModelPlan, image: str) -> dict[str, Any]:
    """Keeps the model's EC store under its byte budget: vLLM's connector never deletes a file.
    `image` is the operator's own (it runs `epd-operator janitor`).

    It only lists and deletes inside the store; it never creates it (the connector does, on its
    first write). See docs/ec-storage.md.
    """
    assert plan.ec_storage_path is not None, "only units with encoders have an EC store"
    args = ["--path", plan.ec_storage_path, "--max-bytes", str(effective_max_bytes(spec))]
    if spec.ec_storage.ttl_seconds is not None:
        args += ["--ttl-seconds", str(spec.ec_storage.ttl_seconds)]
    mounts = _store_mounts(spec, plan.ec_storage_path)
    return {
        "name": "janitor",
        "image": image,
        "command": ["epd-operator", "janitor"],
        "args": [*args, "--metrics-port", str(JANITOR_METRICS_PORT)],
        "ports": [{"name": "janitor-metrics", "containerPort": JANITOR_METRICS_PORT}],
        # Measured: 36 MiB idle, ~0.6 KiB more per entry (a 50,000-entry store peaks at 63 MiB).
        "resources": {"requests": {"cpu": "10m", "memory": "48Mi"}, "limits": {"memory": "128Mi"}},
        "volumeMounts": mounts,
        # A crashing janitor's last log lines show in the pod's container status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        **_probes(JANITOR_METRICS_PORT, JANITOR_PROBES, startup=False, path="/metrics"),
        # The pod's uid, the engines' (POD_SECURITY_CONTEXT): it may delete what they wrote and
        # nothing else.
        "securityContext": security_context(spec),
    }


def _store_mounts(spec: api.EPDDeploymentSpec, store: str) -> list[dict[str, Any]]:
    """What a container needs mounted to reach the EC store: /dev/shm, and the user's volume that
    holds it when ecConnector.storageRoot names one."""
    return [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] + [
        m for m in spec.volume_mounts if m.get("mountPath") and store.startswith(str(m["mountPath"]).rstrip("/") + "/")
    ]


def looks_up_store(spec: api.EPDDeploymentSpec, plan: ModelPlan) -> bool:
    """Whether the unit's proxy looks in the unit's EC store before priming: placement Unit with
    ECExampleConnector (its files are named by the parts' uuids, which the proxy writes)."""
    return bool(plan.ec_storage_path) and not plan.pooled and spec.ec_connector.name == "ECExampleConnector"


def _pod_spec(
    spec: api.EPDDeploymentSpec,
    containers: list[dict[str, Any]],
    shm: api.Shm,
    *,
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    affinity: dict[str, Any] | None,
    init_containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """What a unit pod and an encoder pool pod share: their /dev/shm and HOME emptyDirs, the
    user's volumes, security, termination and scheduling."""
    pod_spec: dict[str, Any] = {} if init_containers is None else {"initContainers": init_containers}
    pod_spec |= {
        "containers": containers,
        "volumes": [
            {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm.size_limit}},
            *spec.volumes,
            {"name": HOME_VOLUME, "emptyDir": {}},
            {"name": TMP_VOLUME, "emptyDir": {}},
        ],
        "enableServiceLinks": False,
        # The engines, the router and the janitor never call the Kubernetes API.
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy({**POD_SECURITY_CONTEXT, **(spec.pod_security_context or {})}),
        "terminationGracePeriodSeconds": spec.termination.grace_period_seconds,
    }
    optional = {
        "nodeSelector": node_selector or None,
        "tolerations": tolerations or None,
        "affinity": affinity,
        "priorityClassName": spec.priority_class_name,
        "serviceAccountName": spec.service_account_name,
        "imagePullSecrets": spec.image_pull_secrets or None,
    }
    pod_spec.update({k: v for k, v in optional.items() if v is not None})
    return pod_spec


# The proxy's own figure (docs/proxy.md: 72 MiB under load); the limit leaves room for a few
# bodies of --max-request-bytes (64 MiB each, parsed) at once.
PROXY_RESOURCES = {"requests": {"cpu": "100m", "memory": "96Mi"}, "limits": {"memory": "1Gi"}}


def proxy_container(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan, image: str) -> dict[str, Any]:
    """The EPD proxy of a unit: `epd-dataplane proxy` from the operator's `image`, on the front
    port (it holds the name `http`), forwarding to the router or the only consumer on the pod's
    loopback. Any OpenAI client through the front Service gets its media primed on the encoders
    first (docs/proxy.md).

    Placement Unit: it primes on the unit's own encoders, on the loopback. Pools: on the encoder
    pool's ready pods, found by DNS through the pool's headless Service (the pod's resolver
    completes the name with its namespace), and the encoders' ec_transfer_params go with each
    request so the consumers pull from them.
    """
    assert plan.proxy is not None, "only a plan with a proxy has its container"
    if plan.pooled:
        ports = ",".join(str(e.port) for e in plan.encoders)
        encoders = ["--encoders-dns", f"{pool_name(deployment, plan.name)}:{ports}", "--placement", "Pools"]
    else:
        encoders = [a for e in plan.unit_encoders for a in ("--encoder", f"http://127.0.0.1:{e.port}")]
    store = plan.ec_storage_path if looks_up_store(spec, plan) else None
    if store:
        encoders += ["--ec-store", store]
    if spec.model(plan.name).weights_version is not None:  # only whether: a new version restarts nothing
        encoders.append("--require-weights-version")
    timeout = spec.proxy.request_timeout_seconds or spec.router.request_timeout_seconds
    outliers = spec.proxy.outlier_detection
    limits = spec.proxy.limits(spec.model(plan.name))
    media_args = _media_args(spec)
    tuned: dict[str, object] = {
        "--prime-attempt-timeout-seconds": spec.proxy.prime_attempt_timeout_seconds,
        "--eject-after-failures": outliers.consecutive_failures,
        "--ejection-base-seconds": outliers.base_ejection_seconds,
        "--ejection-max-seconds": outliers.max_ejection_seconds,
    }  # unset: the proxy's own defaults
    # The bounds that differ from the proxy's defaults (the fields set, maxMediaParts from the
    # consumers' limit_mm_per_prompt), by their flags.
    default = Limits()
    tuned |= {
        SPELLINGS[name][1]: value for name in SPELLINGS if (value := getattr(limits, name)) != getattr(default, name)
    }
    return {
        "name": plan.proxy.container_name,
        "image": image,
        "command": ["epd-dataplane", "proxy"],
        "args": [
            *("--port", str(plan.proxy.port), "--upstream", f"http://127.0.0.1:{plan.proxy.upstream_port}"),
            *encoders,
            *("--request-timeout-seconds", str(timeout)),
            *("--prime-timeout-seconds", str(spec.proxy.prime_timeout_seconds)),
            *(
                a
                for flag, value in tuned.items()
                if value is not None
                for a in (flag, f"{value:g}" if isinstance(value, float) else str(value))
            ),
            *media_args,
            *("--metrics-port", str(PROXY_METRICS_PORT)),
        ],
        "ports": [
            {"name": FRONT_PORT_NAME, "containerPort": plan.proxy.port},
            {"name": "proxy-metrics", "containerPort": PROXY_METRICS_PORT},
        ],
        "resources": _resources(0, spec.proxy.resources, PROXY_RESOURCES),
        # The EC store it looks in and leases entries of (read and write: its lease files).
        **({"volumeMounts": _store_mounts(spec, store)} if store else {}),
        **_proxy_probes(plan.proxy.port, spec.probes),
        **_lifecycle(spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security_context(spec),
    }


def _media_args(spec: api.EPDDeploymentSpec) -> list[str]:
    """spec.proxy.media as the proxy's and the gateway's flags (the engines get the same allowed
    domains: engine.yaml.j2)."""
    media = spec.proxy.media
    args = [*(("--allowed-media-domains", *media.allowed_domains) if media.allowed_domains else ())]
    if media.allow_private_networks:
        args.append("--media-allow-private-networks")
    return args


def _proxy_probes(port: int, probes: api.Probes) -> dict[str, Any]:
    """Alive is the proxy's own /health; ready is /health through the front port, answered by
    what it forwards to (the router on the loopback, which no kubelet probe reaches, or the only
    consumer): a client is sent to the unit only once a request can go all the way."""
    alive = _probes(PROXY_METRICS_PORT, probes, startup=False)
    through = _probes(port, probes, startup=False)
    return {"readinessProbe": through["readinessProbe"], "livenessProbe": alive["livenessProbe"]}


def pod_template(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan, operator_image: str) -> dict[str, Any]:
    model = spec.model(plan.name)
    consumers = plan.consumers
    front_is_engine = plan.proxy is None and plan.router is None and len(consumers) == 1
    shm_bytes = parse_quantity(spec.shm.size_limit)
    first = plan.unit_engines[0]  # carries the /dev/shm in its memory request (_resources)
    init = [
        _engine_container(spec, model, c, False, shm_bytes=shm_bytes if c is first else 0) for c in plan.unit_encoders
    ]
    main = [
        _engine_container(spec, model, c, front_is_engine, shm_bytes=shm_bytes if c is first else 0) for c in consumers
    ]
    if plan.router is not None:
        main.append(_router_container(spec, plan.router, front=plan.proxy is None))
    if plan.proxy is not None:
        main.append(proxy_container(spec, deployment, plan, operator_image))
    if plan.ec_storage_path:
        main.append(janitor_container(spec, plan, operator_image))
    pod_spec = _pod_spec(
        spec,
        main,
        spec.shm,
        node_selector=spec.node_selector,
        tolerations=spec.tolerations,
        affinity=spec.affinity,
        init_containers=init,
    )
    if plan.pooled:
        # Sidecars cannot order containers of other pods: the operator opens this gate while the
        # model's encoder pool has a ready encoder (status.encoder_gates).
        pod_spec["readinessGates"] = [{"conditionType": ENCODERS_READY_GATE}]
    labels = common_labels(deployment, plan.name, "unit")
    annotations = {}
    if plan.ec_storage_path:
        annotations[ANNOTATION_EC_STORAGE_PATH] = plan.ec_storage_path
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def statefulset(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan, operator_image: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": child_name(deployment, plan.name),
            "labels": common_labels(deployment, plan.name, "unit"),
        },
        "spec": {
            "replicas": spec.replicas,
            "serviceName": child_name(deployment, plan.name, "units", limit=63),
            # Units are independent: start and replace them all at once, not one by one.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(deployment, plan.name)},
            "template": pod_template(spec, deployment, plan, operator_image),
            # One unit at a time by default: an updated unit must be Ready before the next is
            # replaced, so a bad revision stops after its first unit. maxUnavailable above 1 is
            # honoured where the MaxUnavailableStatefulSet feature gate is on.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": spec.max_unavailable}},
        },
    }


def pod_disruption_budget(spec: api.EPDDeploymentSpec, stateful_set: dict[str, Any]) -> dict[str, Any]:
    """Voluntary disruptions (drains, evictions) take at most maxUnavailable of the pods of a
    StatefulSet of units or of an encoder pool: the budget covers exactly its pods."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": stateful_set["metadata"]["name"], "labels": stateful_set["metadata"]["labels"]},
        "spec": {
            "maxUnavailable": spec.max_unavailable,
            "selector": stateful_set["spec"]["selector"],
            # A pod that is not Ready (loading its model, or broken) may be evicted even when the
            # budget is spent: waiting for it would block a drain for nothing.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _service_port(plan: ModelPlan, spec: api.EPDDeploymentSpec) -> dict[str, Any]:
    # Always ports.router: the proxy's port, the router's, or (the only consumer's) the number
    # clients know, whichever container holds the name `http`.
    return {"name": FRONT_PORT_NAME, "port": spec.ports.router, "targetPort": FRONT_PORT_NAME, "protocol": "TCP"}


def services(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan) -> list[dict[str, Any]]:
    """A headless Service listing every unit, and one fronting ready units' routers or consumers
    (of `spec.service`'s type, or headless).

    Both expose only the `http` port (router, or the single consumer): encoders are never
    reachable through a Service; clients find their URLs in the EPDDeployment's status.
    """
    selector = selector_labels(deployment, plan.name)
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": child_name(deployment, plan.name, "units", limit=63),
            "labels": common_labels(deployment, plan.name, "units"),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [_service_port(plan, spec)],
        },
    }
    # With a gateway, the front Service is the gateway's: it sends each request to a unit.
    front_selector = gateway_selector_labels(deployment, plan.name) if has_gateway(spec, plan) else selector
    front: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": child_name(deployment, plan.name, limit=63),
            "labels": common_labels(deployment, plan.name, "router" if plan.router else "consumer"),
        },
        "spec": {"type": spec.service.type, "selector": front_selector, "ports": [_service_port(plan, spec)]},
    }
    if spec.service.annotations:
        front["metadata"]["annotations"] = dict(spec.service.annotations)
    if spec.service.headless:
        front["spec"]["clusterIP"] = "None"
    return [headless, front]


def is_headless(service: Mapping[str, Any]) -> bool:
    """clusterIP: None. It cannot change on an existing Service (an apply that sets it is refused,
    one that drops it is silently ignored), so a change of it re-creates the Service."""
    return (service.get("spec") or {}).get("clusterIP") == "None"


# --------------------------------------------------------------------------- encoder pools


def pool_name(deployment: str, model: str) -> str:
    """The encoder pool's StatefulSet and Service (validation refuses a model of this name)."""
    return child_name(deployment, model, "encoders")


def pool_selector_labels(deployment: str, model: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_ENCODER_POOL: model}


def pool_labels(deployment: str, model: str) -> dict[str, str]:
    return {
        LABEL_NAME: "epd",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: "encoder-pool",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_ROLE: "encoder-pool",
        **pool_selector_labels(deployment, model),
    }


def pool_pod_template(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan) -> dict[str, Any]:
    """A pod of the encoder pool: the model's encoder engines (plain containers: nothing in this
    pod waits for them), its own /dev/shm (their ECCPUConnector regions) and scheduling."""
    model = spec.model(plan.name)
    pool = model.encoder_pool or api.EncoderPool()
    shm = spec.pool_shm(model)
    shm_bytes = parse_quantity(shm.size_limit)
    containers = [
        _engine_container(spec, model, c, False, sidecar=False, shm_bytes=shm_bytes if i == 0 else 0)
        for i, c in enumerate(plan.encoders)
    ]
    pod_spec = _pod_spec(
        spec,
        containers,
        shm,
        node_selector=spec.node_selector if pool.node_selector is None else pool.node_selector,
        tolerations=spec.tolerations if pool.tolerations is None else pool.tolerations,
        affinity=spec.affinity if pool.affinity is None else pool.affinity,
    )
    return {"metadata": {"labels": pool_labels(deployment, plan.name)}, "spec": pod_spec}


def pool_statefulset(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan) -> dict[str, Any]:
    """The encoder pool: `encoderReplicas` pods, scaled independently of the units. An
    autoscaled pool's size is its autoscaler's: the operator's apply sets none (so owns none)."""
    name = pool_name(deployment, plan.name)
    model = spec.model(plan.name)
    size = {} if model.encoder_autoscaling is not None else {"replicas": model.encoder_replicas}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": pool_labels(deployment, plan.name)},
        "spec": {
            **size,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": pool_selector_labels(deployment, plan.name)},
            "template": pool_pod_template(spec, deployment, plan),
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": spec.max_unavailable}},
        },
    }


def pool_service(deployment: str, plan: ModelPlan) -> dict[str, Any]:
    """Headless, listing the pool's ready encoder pods (and governing their StatefulSet). It
    selects by LABEL_ENCODER_POOL, which unit pods never carry, as the units' Services select by
    LABEL_MODEL, which pool pods never carry."""
    ports = [{"name": e.container_name, "port": e.port, "targetPort": e.port, "protocol": "TCP"} for e in plan.encoders]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pool_name(deployment, plan.name), "labels": pool_labels(deployment, plan.name)},
        "spec": {"clusterIP": "None", "selector": pool_selector_labels(deployment, plan.name), "ports": ports},
    }


# --------------------------------------------------------------------------- the gateway

# Measured: about 70 MiB idle, like a unit's proxy; the limit leaves room for bodies it reads.
GATEWAY_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}
GATEWAY_CONTAINER = "gateway"


def has_gateway(spec: api.EPDDeploymentSpec, plan: ModelPlan) -> bool:
    """A model has a gateway when spec.gateway is on and its units have an EPD proxy to send to."""
    return spec.gateway.enabled and plan.proxy is not None


def gateway_name(deployment: str, model: str) -> str:
    return child_name(deployment, model, "gateway")


def gateway_account_name(deployment: str) -> str:
    """The ServiceAccount, Role and RoleBinding every gateway of the deployment shares."""
    return child_name(deployment, "", "gateway", limit=63)


def gateway_selector_labels(deployment: str, model: str) -> dict[str, str]:
    return {LABEL_DEPLOYMENT: deployment, LABEL_GATEWAY: model}


def gateway_labels(deployment: str, model: str) -> dict[str, str]:
    return {
        LABEL_NAME: "epd",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: "gateway",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_ROLE: "gateway",
        **gateway_selector_labels(deployment, model),
    }


def _account_labels(deployment: str) -> dict[str, str]:
    return {
        LABEL_NAME: "epd",
        LABEL_INSTANCE: deployment,
        LABEL_COMPONENT: "gateway",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_DEPLOYMENT: deployment,
    }


def gateway_deployment(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan, image: str) -> dict[str, Any]:
    """The model's EPD gateway: `epd-dataplane gateway` from the operator's `image`, on the front
    port (named `http`, which the front Service targets), watching the EPDDeployment and the
    units' EndpointSlices with its own ServiceAccount. Its flags never carry the weights
    version (it reads it from the EPDDeployment): a new version rolls nothing."""
    assert plan.proxy is not None, "a gateway fronts the units' proxies"
    gateway = spec.gateway
    limits = spec.proxy.limits(spec.model(plan.name))
    default = Limits()
    tuned = {SPELLINGS[n][1]: v for n in SPELLINGS if (v := getattr(limits, n)) != getattr(default, n)}
    timeout = spec.proxy.request_timeout_seconds or spec.router.request_timeout_seconds
    port = plan.proxy.port
    pool = gateway.inference_pool
    picker = epp_service_name(deployment, plan.name)
    epp_args = (
        [
            *("--epp-port", str(EPP_PORT), "--epp-health-port", str(EPP_HEALTH_PORT)),
            *(() if pool.secure_serving else ("--no-epp-secure-serving",)),
            *(("--epp-fallbacks", str(pool.fallbacks)) if pool.fallbacks else ()),
            # The names its self-signed certificate is for: the picker's Service.
            *("--epp-name", picker, "--epp-name", f"{picker}.$(POD_NAMESPACE).svc"),
        ]
        if pool.enabled
        else []
    )
    epp_ports = (
        [{"name": "grpc-epp", "containerPort": EPP_PORT}, {"name": "grpc-epp-health", "containerPort": EPP_HEALTH_PORT}]
        if pool.enabled
        else []
    )
    container = {
        "name": GATEWAY_CONTAINER,
        "image": image,
        "command": ["epd-dataplane", "gateway"],
        "args": [
            *("--port", str(port), "--metrics-port", str(PROXY_METRICS_PORT)),
            *("--namespace", "$(POD_NAMESPACE)", "--deployment", deployment, "--model", plan.name),
            *("--units-service", child_name(deployment, plan.name, "units", limit=63)),
            *("--request-timeout-seconds", str(timeout)),
            *("--max-load-percent", str(gateway.max_load_percent)),
            *_media_args(spec),
            *(
                a
                for flag, value in tuned.items()
                for a in (flag, f"{value:g}" if isinstance(value, float) else str(value))
            ),
            *epp_args,
        ],
        "env": [{"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [
            {"name": FRONT_PORT_NAME, "containerPort": port},
            {"name": "gateway-metrics", "containerPort": PROXY_METRICS_PORT},
            *epp_ports,
        ],
        "resources": _resources(0, gateway.resources, GATEWAY_RESOURCES),
        # Ready once it knows the units (its watches answered); alive while it serves.
        "readinessProbe": _probes(PROXY_METRICS_PORT, spec.probes, startup=False, path="/ready")["readinessProbe"],
        "livenessProbe": _probes(PROXY_METRICS_PORT, spec.probes, startup=False)["livenessProbe"],
        **_lifecycle(spec),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security_context(spec),
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": gateway_account_name(deployment),
        # The only pod of the EPDDeployment that reads the API: its Role's get, list and watch.
        "automountServiceAccountToken": True,
        "enableServiceLinks": False,
        "containers": [container],
        "securityContext": copy.deepcopy({**POD_SECURITY_CONTEXT, **(spec.pod_security_context or {})}),
        "terminationGracePeriodSeconds": spec.termination.grace_period_seconds,
    }
    scheduling = {
        "nodeSelector": spec.node_selector if gateway.node_selector is None else gateway.node_selector,
        "tolerations": spec.tolerations if gateway.tolerations is None else gateway.tolerations,
        "priorityClassName": spec.priority_class_name,
        "imagePullSecrets": spec.image_pull_secrets or None,
    }
    pod_spec.update({k: copy.deepcopy(v) for k, v in scheduling.items() if v})
    labels = gateway_labels(deployment, plan.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": gateway_name(deployment, plan.name), "labels": labels},
        "spec": {
            "replicas": gateway.replicas,
            "selector": {"matchLabels": gateway_selector_labels(deployment, plan.name)},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            # A new gateway is Ready (its watches answered) before an old one goes.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        },
    }


def has_inference_pool(spec: api.EPDDeploymentSpec, plan: ModelPlan) -> bool:
    return has_gateway(spec, plan) and spec.gateway.inference_pool.enabled


def epp_service_name(deployment: str, model: str) -> str:
    return child_name(deployment, model, "epp", limit=63)


def inference_pool_objects(spec: api.EPDDeploymentSpec, deployment: str, plan: ModelPlan) -> list[dict[str, Any]]:
    """The model's InferencePool and the Service of its endpoint picker (the gateway's ext_proc
    port). The pool selects exactly the model's unit pods (not its encoder pool, not its gateway)
    and targets their EPD proxy: the picker names a ready unit's proxy, which primes what it lacks.
    Readiness is the picker's to weigh, as GAIE's pickers do: a selector cannot."""
    assert plan.proxy is not None, "the pool's endpoints are the units' proxies"
    pool = spec.gateway.inference_pool
    labels = {**gateway_labels(deployment, plan.name), LABEL_COMPONENT: "endpoint-picker"}
    picker = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": epp_service_name(deployment, plan.name), "labels": labels},
        "spec": {
            "selector": gateway_selector_labels(deployment, plan.name),
            "ports": [
                {
                    "name": "grpc-epp",
                    "port": EPP_PORT,
                    "targetPort": "grpc-epp",
                    "protocol": "TCP",
                    "appProtocol": "http2" if pool.secure_serving else "kubernetes.io/h2c",
                }
            ],
        },
    }
    inference_pool = {
        "apiVersion": f"{api.INFERENCE_POOL_GROUP}/{api.INFERENCE_POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": {
            "name": child_name(deployment, plan.name, limit=63),
            "labels": common_labels(deployment, plan.name, "inference-pool"),
        },
        "spec": {
            "selector": {"matchLabels": {**selector_labels(deployment, plan.name), LABEL_COMPONENT: "unit"}},
            "targetPorts": [{"number": plan.proxy.port}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": epp_service_name(deployment, plan.name),
                "port": {"number": EPP_PORT},
                "failureMode": pool.failure_mode,
            },
        },
    }
    return [picker, inference_pool]


def gateway_access(deployment: str) -> list[dict[str, Any]]:
    """The gateways' ServiceAccount, and a Role (bound to it) that reads just what they watch: this
    EPDDeployment (list and watch by name) and the EndpointSlices of its namespace (list and
    watch: their names are generated, so no narrower rule exists). Nothing else, no write."""
    name = gateway_account_name(deployment)
    labels = _account_labels(deployment)
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "labels": labels},
        # Only the gateway's pods mount its token (their own spec says so).
        "automountServiceAccountToken": False,
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "labels": labels},
        "rules": [
            {
                "apiGroups": [api.GROUP],
                "resources": [api.PLURAL],
                "resourceNames": [deployment],
                "verbs": ["list", "watch"],
            },
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "labels": labels},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name}],
    }
    return [account, role, binding]


# --------------------------------------------------------------------------- autoscaling


def scaled_objects(
    spec: api.EPDDeploymentSpec, deployment: str, plans: list[ModelPlan], namespace: str
) -> list[dict[str, Any]]:
    """KEDA ScaledObjects on EPD's own signals, as the proxies export them and the chart's
    PodMonitor labels them (docs/autoscaling.md): each model's encoder pool by its primes in
    flight per encoder pod, the units (the EPDDeployment's scale subresource: spec.replicas) by
    their requests in flight per unit. KEDA makes and drives the HPA; the real HPA controller
    scales through the scale subresource, so the replica counts are its, never the operator's."""
    scaling = spec.autoscaling
    objects = []
    selector = f'namespace="{namespace}",deployment="{deployment}",role="unit"'
    for plan in plans:
        encoders = spec.model(plan.name).encoder_autoscaling
        if encoders is not None and plan.pooled:
            query = f'sum(epd_proxy_primes_in_flight{{{selector},model="{plan.name}"}})'
            target = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": pool_name(deployment, plan.name)}
            name = encoders_scaled_object_name(deployment, plan.name)
            objects.append(
                _scaled_object(
                    name,
                    common_labels(deployment, plan.name, "autoscaler"),
                    target,
                    encoders,
                    query,
                    encoders.target_primes_in_flight,
                    scaling,
                )
            )
    if scaling.units is not None:
        query = f"sum(epd_proxy_requests_in_flight{{{selector}}})"
        target = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "name": deployment}
        labels = {**network_policy_labels(deployment), LABEL_COMPONENT: "autoscaler"}
        objects.append(
            _scaled_object(
                child_name(deployment, "", "units", limit=63),
                labels,
                target,
                scaling.units,
                query,
                scaling.units.target_requests_in_flight,
                scaling,
            )
        )
    return objects


def encoders_scaled_object_name(deployment: str, model: str) -> str:
    return child_name(deployment, model, "encoders", limit=63)


def _scaled_object(
    name: str,
    labels: dict[str, str],
    target: dict[str, str],
    scaler: api.Autoscaler,
    query: str,
    per_replica: float,
    scaling: api.DeploymentAutoscaling,
) -> dict[str, Any]:
    assert scaling.prometheus_address is not None, "validation requires it with any autoscaler"
    return {
        "apiVersion": f"{api.KEDA_GROUP}/{api.KEDA_VERSION}",
        "kind": "ScaledObject",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "scaleTargetRef": target,
            "minReplicaCount": scaler.min_replicas,
            "maxReplicaCount": scaler.max_replicas,
            "pollingInterval": scaling.polling_interval_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": scaler.scale_down_stabilization_seconds},
                        "scaleUp": {"stabilizationWindowSeconds": 0},
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    # AverageValue: the HPA divides the sum by the replicas and aims at the threshold.
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": scaling.prometheus_address,
                        "query": query,
                        "threshold": f"{per_replica:g}",
                    },
                }
            ],
        },
    }


# --------------------------------------------------------------------------- network policy


def _tcp(low: int, high: int) -> dict[str, Any]:
    port: dict[str, Any] = {"protocol": "TCP", "port": low}
    if high > low:
        port["endPort"] = high
    return port


def serving_ports(spec: api.EPDDeploymentSpec, plans: list[ModelPlan]) -> list[dict[str, Any]]:
    """Where clients talk to the deployment's pods: each model's front port and its engines' HTTP
    ports (prime, render, generate, pause). Not the NIXL or EC side channels, nor the janitors."""
    ports = []
    for plan in plans:
        model = spec.model(plan.name)
        blocks = [unit_ports(spec, model)["ports.engineBase"]]
        if plan.pooled:
            blocks.append(pool_ports(spec, model)["ports.engineBase"])
        blocks.append((plan.front_port, plan.front_port))
        if has_inference_pool(spec, plan):
            blocks.append((EPP_PORT, EPP_PORT))  # the gateways of an HTTPRoute ask the picker
        ports += [_tcp(low, high) for low, high in blocks if high >= low]
    unique = {json.dumps(p, sort_keys=True): p for p in ports}
    return list(unique.values())


def network_policy(
    spec: api.EPDDeploymentSpec, deployment: str, plans: list[ModelPlan], operator_namespace: str | None
) -> dict[str, Any]:
    """Ingress to every pod of the EPDDeployment: from its own pods on every port (a unit's
    consumers reach their pool's encoders and side channels); from the client peers on the
    serving ports (default: every pod of the namespace); from the monitoring peers on those and
    the janitors' metrics port; from the operator's namespace on the janitors' metrics port
    (the operator reads their counters). Only allowed peers can prime an encoder: no other
    tenant can write under an EC store key this deployment reads."""
    policy = spec.network_policy
    own = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: deployment, LABEL_MANAGED_BY: FIELD_MANAGER}}}
    serving = serving_ports(spec, plans)
    janitor = [_tcp(JANITOR_METRICS_PORT, JANITOR_METRICS_PORT)] if any(p.ec_storage_path for p in plans) else []
    proxies = [_tcp(PROXY_METRICS_PORT, PROXY_METRICS_PORT)] if any(p.proxy for p in plans) else []
    clients = [{"podSelector": {}}] if policy.clients is None else policy.clients
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if clients:
        ingress.append({"from": clients, "ports": serving})
    if policy.monitoring:
        ingress.append({"from": policy.monitoring, "ports": serving + janitor + proxies})
    if janitor and operator_namespace:
        namespace = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}}}
        ingress.append({"from": [namespace], "ports": janitor})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": child_name(deployment, "", limit=63), "labels": network_policy_labels(deployment)},
        "spec": {"podSelector": own["podSelector"], "policyTypes": ["Ingress"], "ingress": ingress},
    }


def desired_children(
    spec: api.EPDDeploymentSpec,
    deployment: str,
    plans: list[ModelPlan],
    operator_image: str,
    *,
    operator_namespace: str | None = None,
    namespace: str = "",
) -> list[dict[str, Any]]:
    """Per model: its units' StatefulSet, two Services and a PodDisruptionBudget (with Pools also
    its encoder pool's StatefulSet, Service and budget); and the deployment's NetworkPolicy.
    `operator_image` runs the janitors; `operator_namespace` (where the operator runs, if known)
    may scrape them; `namespace` is the deployment's (its autoscalers' queries name it)."""
    children = []
    for plan in plans:
        units = statefulset(spec, deployment, plan, operator_image)
        children += [units, *services(spec, deployment, plan), pod_disruption_budget(spec, units)]
        if plan.pooled:
            pool = pool_statefulset(spec, deployment, plan)
            children += [pool, pool_service(deployment, plan), pod_disruption_budget(spec, pool)]
        if has_gateway(spec, plan):
            children.append(gateway_deployment(spec, deployment, plan, operator_image))
        if has_inference_pool(spec, plan):
            children += inference_pool_objects(spec, deployment, plan)
    if any(has_gateway(spec, plan) for plan in plans):
        children += gateway_access(deployment)
    if spec.network_policy.enabled:
        children.append(network_policy(spec, deployment, plans, operator_namespace))
    children += scaled_objects(spec, deployment, plans, namespace)
    return children
