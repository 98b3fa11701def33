"""Every engine's and router's command line, rendered from templates (pure: spec in, argv out).

- `templates/engine.yaml.j2`: the seed's role defaults (EC/KV roles, encoder-only mode, ...) as
  snake_case vLLM engine args, plus the env each role needs.
- `templates/router.yaml.j2`: the vllm-router command.
- `templates/vllm-<minor>/flags.yaml`: how that vLLM version spells flags (booleans differ).

A group's `overrides` are merged over the defaults as an RFC 7386 JSON merge patch (dicts merge
key by key, null deletes, anything else replaces), so they win over every default and never
produce a flag twice. docs/rendering.md has the tables. One module, though past 350 lines:
engines, router and proxy are rendered by the same owned-argument and spelling rules.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2
import yaml

from .api import EPDDeploymentSpec, ModelSpec, Placement, WorkerType
from .ec.regions import cpu_bytes, uses_cpu_regions
from .engine_args import V2_MODEL_RUNNER_ENV, known_env_vars, merge_patch
from .layout import proxied, slots
from .validation import ROUTER_KV_CONNECTORS, CheckedSpec

ROUTER = "router"

_templates = jinja2.Environment(
    loader=jinja2.PackageLoader(__package__, "templates"),
    undefined=jinja2.StrictUndefined,
    autoescape=False,
)
# Characters YAML refuses raw (C1 controls, U+FFFE, U+FFFF) or reads as line breaks (NEL,
# U+2028, U+2029); escaped, they keep their value.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufffe\uffff]")


def _yaml_safe_json(obj: Any, **kwargs: Any) -> str:
    """`tojson` whose output YAML reads back as the same value: non-ASCII characters raw, as
    JSON's `\\uXXXX` surrogate pairs (characters beyond U+FFFF) are not valid YAML escapes."""
    text = json.dumps(obj, ensure_ascii=False, **kwargs)
    return _NOT_YAML_PRINTABLE.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


_templates.policies["json.dumps_function"] = _yaml_safe_json


@dataclass(frozen=True)
class EngineCommand:
    """One vLLM engine of a unit."""

    model: str  # spec model name (key)
    worker_type: WorkerType
    group_index: int  # index of its server group in the model
    engine_index: int  # index within the unit pod, encoders first
    container_name: str  # encoder-0, regular-1, prefill-0, ...
    port: int  # HTTP port: ports.engineBase + engine_index
    nixl_port: int | None  # NIXL side-channel port of prefill/decode engines
    gpus: int  # numGpusPerEngine
    args: list[str]  # full argv
    env: dict[str, str]  # env the role needs; the caller adds the user's env lists
    ec_side_channel_port: int | None = None  # ECCPUConnector producer's side channel (Pools encoders)
    field_env: dict[str, str] = field(default_factory=dict)  # env from the pod's own fields: name -> fieldPath


@dataclass(frozen=True)
class RouterCommand:
    """vllm-router in front of a unit's consumers."""

    model: str
    port: int  # ports.router
    args: list[str]  # full argv
    container_name: str = ROUTER


@dataclass(frozen=True)
class ProxyCommand:
    """The EPD proxy of a unit: on the front port, forwarding to the router or the only consumer."""

    port: int  # ports.router: the Service's `http`
    upstream_port: int  # the router's loopback port, or the unit's only consumer's
    container_name: str = "proxy"


@dataclass(frozen=True)
class ModelPlan:
    name: str
    served_model_name: str
    ec_storage_path: str | None  # None for text-only models
    engines: list[EngineCommand]  # encoders first, then consumers in group order
    router: RouterCommand | None
    placement: Placement = Placement.unit
    proxy: ProxyCommand | None = None

    @property
    def front_port(self) -> int:
        """The port the front Service targets (`http`): the proxy's, else the router's, else the
        only consumer's."""
        if self.proxy is not None:
            return self.proxy.port
        return self.router.port if self.router else self.consumers[0].port

    @property
    def encoders(self) -> list[EngineCommand]:
        return [e for e in self.engines if e.worker_type.is_encoder]

    @property
    def consumers(self) -> list[EngineCommand]:
        """The engines behind the router (or the unit's single entry): every non-encoder."""
        return [e for e in self.engines if not e.worker_type.is_encoder]

    @property
    def pooled(self) -> bool:
        """Placement Pools: the encoders run in the model's encoder pool, not in its units."""
        return self.placement is Placement.pools

    @property
    def unit_engines(self) -> list[EngineCommand]:
        """The engines in each unit pod: all of them, or with Pools only the consumers."""
        return self.consumers if self.pooled else self.engines

    @property
    def unit_encoders(self) -> list[EngineCommand]:
        return [] if self.pooled else self.encoders


def render(checked: CheckedSpec, *, namespace: str, name: str, uid: str) -> list[ModelPlan]:
    """The commands of every model's EPD unit (pure; a checked spec always renders)."""
    spec = checked.spec
    plans = []
    for index, model in enumerate(spec.models):
        # Pools: no EC store; the embeddings stay in each encoder's own region until read.
        path = (
            ec_storage_path(spec, namespace=namespace, name=name, uid=uid, model=model.name)
            if model.has_encoders and not model.pooled
            else None
        )
        plans.append(_model_plan(spec, checked.vllm_minor, model, path))
    return plans


def ec_storage_path(spec: EPDDeploymentSpec, *, namespace: str, name: str, uid: str, model: str) -> str:
    """The model's isolated EC store, e.g. /dev/shm/vime-ec-demo-default-1a2b3c4d.

    Readable, unique per EPDDeployment object (the uid changes when it is recreated) and model,
    stable across reconciles, and a single safe path component.
    """
    digest = hashlib.sha256(f"{namespace}\x00{name}\x00{uid}\x00{model}".encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{name}-{model}".lower()).strip("-")[:48].rstrip("-")
    root = spec.ec_connector.storage_root.rstrip("/")
    return f"{root}/{spec.ec_connector.path_prefix}{readable}-{digest}"


def engine_flags(minor: str, args: Mapping[str, Any]) -> list[str]:
    """snake_case engine args -> vLLM CLI flags as vLLM `minor` spells them.

    True -> `--flag`; False -> the version's negation (nothing for store_true flags); None and
    empty lists -> omitted; dicts -> compact JSON with sorted keys; lists -> `--flag a b`
    (`--flag a --flag b` for append flags); anything else -> `--flag str(value)`.
    """
    spelling = flag_spelling(minor)
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif key not in spelling.store_true:
                argv.append(spelling.negate(flag))
        elif isinstance(value, list):
            if key in spelling.append:
                for item in value:
                    argv += [flag, _text(item)]
            elif value:
                argv += [flag, *map(_text, value)]
        else:
            argv += [flag, _text(value)]
    return argv


def format_commands(plans: list[ModelPlan]) -> str:
    """One shell line per engine and router: `[model group=G engine=E container] ENV=.. argv`
    (`[model router] argv` for the router)."""
    lines = []
    for plan in plans:
        for cmd in plan.engines:
            env = [f"{key}={value}" for key, value in sorted(cmd.env.items())]
            env += [f"{key}=<{path}>" for key, path in sorted(cmd.field_env.items())]
            where = f"{plan.name} group={cmd.group_index} engine={cmd.engine_index} {cmd.container_name}"
            lines.append(f"[{where}] " + shlex.join([*env, *cmd.args]))
        if plan.router:
            lines.append(f"[{plan.name} {ROUTER}] " + shlex.join(plan.router.args))
    return "\n".join(lines)


def commands_json(plans: list[ModelPlan]) -> list[dict[str, Any]]:
    commands = []
    for plan in plans:
        for cmd in plan.engines:
            commands.append(
                {
                    "model": cmd.model,
                    "workerType": cmd.worker_type.value,
                    "engineIndex": cmd.engine_index,
                    "args": list(cmd.args),
                    "env": dict(cmd.env),
                    "fieldEnv": dict(cmd.field_env),
                }
            )
        if plan.router:
            # The router's entry keeps the engines' shape for tools reading the list.
            commands.append(
                {
                    "model": plan.name,
                    "workerType": ROUTER,
                    "engineIndex": -1,
                    "args": list(plan.router.args),
                    "env": {},
                    "fieldEnv": {},
                }
            )
    return commands


# --------------------------------------------------------------------------- engines


def _model_plan(spec: EPDDeploymentSpec, minor: str, model: ModelSpec, ec_path: str | None) -> ModelPlan:
    served = model.served_name
    cpu_regions = uses_cpu_regions(model)
    engines: list[EngineCommand] = []
    # Encoders first (layout.slots): they take the lowest ports and start, as sidecars, before
    # the consumers.
    for slot in slots(spec, model):
        group, worker_type = model.server_groups[slot.group_index], slot.worker_type
        defaults = _load_yaml(
            _templates.get_template("engine.yaml.j2").render(
                worker_type=worker_type.value,
                ec_role=worker_type.ec_role,
                kv_role=worker_type.kv_role,
                served_model_name=served,
                port=slot.port,
                gpus=group.num_gpus_per_engine,
                nixl_port=slot.nixl_port,
                ec_storage_path=ec_path,
                ec=spec.ec_connector,
                kv=spec.kv_connector,
                server_dev_mode=spec.server_dev_mode,
                pools_ec=model.pools_connector if model.pooled else None,
                ec_cpu_bytes=cpu_bytes(spec, model, group) if cpu_regions and worker_type.ec_role else None,
                ec_side_channel_port=slot.ec_side_channel_port,
                v2_model_runner=cpu_regions and V2_MODEL_RUNNER_ENV in known_env_vars(minor),
                media=spec.proxy.media,
            )
        )
        args = _apply_overrides(defaults["args"], group.overrides)
        engines.append(
            EngineCommand(
                model=model.name,
                worker_type=worker_type,
                group_index=slot.group_index,
                engine_index=slot.engine_index,
                container_name=slot.container_name,
                port=slot.port,
                nixl_port=slot.nixl_port,
                gpus=group.num_gpus_per_engine,
                args=["vllm", "serve", model.model, *engine_flags(minor, args)],
                env=defaults["env"] or {},
                ec_side_channel_port=slot.ec_side_channel_port,
                field_env=defaults.get("field_env") or {},
            )
        )
    router = _router(spec, model, engines)
    proxy = None
    if proxied(spec, model):
        upstream = router.port if router else next(e.port for e in engines if not e.worker_type.is_encoder)
        proxy = ProxyCommand(port=spec.ports.router, upstream_port=upstream)
    # Placement(): the API models keep enum values (Schema's use_enum_values), the plans the enum.
    return ModelPlan(model.name, served, ec_path, engines, router, Placement(model.placement), proxy)


def _apply_overrides(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    # Sorted: args new to the defaults come in a stable order whatever the source's key order
    # (a reordered pod template would roll every unit).
    merged: dict[str, Any] = merge_patch(defaults, {key: overrides[key] for key in sorted(overrides)})
    return merged


@dataclass(frozen=True)
class FlagSpelling:
    negated_prefixes: dict[str, str]
    store_true: frozenset[str]
    append: frozenset[str]

    def negate(self, flag: str) -> str:
        for prefix, inverse in self.negated_prefixes.items():
            if flag.startswith("--" + prefix):
                return "--" + inverse + flag.removeprefix("--" + prefix)
        return "--no-" + flag.removeprefix("--")


def _load_yaml(text: str) -> Any:
    # libyaml's parser when PyYAML has it: an order of magnitude faster than the pure-Python one.
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def flag_spelling(minor: str) -> FlagSpelling:
    """How vLLM `minor` spells flags: templates/vllm-<minor>/flags.yaml."""
    text = (resources.files(__package__) / "templates" / f"vllm-{minor}" / "flags.yaml").read_text()
    data = yaml.safe_load(text)
    return FlagSpelling(
        negated_prefixes=data["negated_prefixes"],
        store_true=frozenset(data["store_true"]),
        append=frozenset(data["append"]),
    )


def _text(value: Any) -> str:
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


# --------------------------------------------------------------------------- router


def _router(spec: EPDDeploymentSpec, model: ModelSpec, engines: list[EngineCommand]) -> RouterCommand | None:
    """vllm-router in front of the consumers, when the model needs one; never the encoders."""
    if not model.needs_router:
        return None
    consumers = [e for e in engines if not e.worker_type.is_encoder]

    def urls(worker_type: WorkerType) -> list[str]:
        return [f"http://127.0.0.1:{e.port}" for e in consumers if e.worker_type == worker_type]

    # Behind the EPD proxy the router serves the pod's loopback only: every client comes through the proxy.
    host, port = ("127.0.0.1", spec.ports.router_loopback) if proxied(spec, model) else ("0.0.0.0", spec.ports.router)
    args = _load_yaml(
        _templates.get_template("router.yaml.j2").render(
            router=spec.router,
            host=host,
            port=port,
            worker_urls=urls(WorkerType.regular),
            prefill_urls=urls(WorkerType.prefill),
            decode_urls=urls(WorkerType.decode),
            # validate() refused a prefill/decode model whose KV connector the router cannot name.
            kv_connector=ROUTER_KV_CONNECTORS.get(spec.kv_connector.name) if model.is_pd else None,
        )
    )
    return RouterCommand(model=model.name, port=port, args=args)
