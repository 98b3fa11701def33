"""Every engine's and router's command line, rendered from templates (pure: spec in, argv out).

- `templates/engine.yaml.j2`: the seed's role defaults (EC/KV roles, encoder-only mode, ...) as
  snake_case vLLM engine args, plus the env each role needs.
- `templates/router.yaml.j2`: the vllm-router command.
- `templates/vllm-<minor>/flags.yaml`: how that vLLM version spells flags (booleans differ).

A group's `overrides` are merged over the defaults as an RFC 7386 JSON merge patch (dicts merge
key by key, null deletes, anything else replaces), so they win over every default and never
produce a flag twice. docs/rendering.md has the tables.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shlex
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping

import jinja2
import yaml

from .api import EPDDeploymentSpec, ModelSpec, ServerGroup, WorkerType
from .validation import SpecError, vllm_minor

ENCODER = WorkerType.encoder.value
ROUTER = "router"
PD_TYPES = (WorkerType.prefill.value, WorkerType.decode.value)

# Pod wiring the operator derives from other spec fields (probes, Services, GPU requests and the
# router depend on them): an override would silently break it, so it is rejected instead.
OWNED_ARGS = {
    "model": "models[].model",
    "served_model_name": "models[].servedModelName",
    "port": "ports.engineBase",
    "tensor_parallel_size": "serverGroups[].numGpusPerEngine",
}

# vllm-router's `--kv-connector` choices, by vLLM KV connector class.
ROUTER_KV_CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake", "MoRIIOConnector": "moriio"}

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
    model: str  # spec model name (key)
    worker_type: str  # encoder | regular | prefill | decode | router
    group_index: int  # index of its server group in the model (-1 for the router)
    engine_index: int  # index within the unit pod, encoders first (-1 for the router)
    container_name: str  # encoder-0, regular-1, prefill-0, ..., router
    port: int  # HTTP port: ports.engineBase + engine_index; router: ports.router
    nixl_port: int | None  # NIXL side-channel port of prefill/decode engines
    gpus: int  # numGpusPerEngine (router: 0)
    args: list[str]  # full argv
    env: dict[str, str]  # env the role needs; the caller adds the user's env lists


@dataclass(frozen=True)
class ModelPlan:
    name: str
    served_model_name: str
    ec_storage_path: str | None  # None for text-only models
    engines: list[EngineCommand]  # encoders first, then consumers in group order
    router: EngineCommand | None

    @property
    def commands(self) -> list[EngineCommand]:
        return [*self.engines, *([self.router] if self.router else [])]


def render(spec: EPDDeploymentSpec, *, namespace: str, name: str, uid: str) -> list[ModelPlan]:
    """The commands of every model's EPD unit; raises SpecError for an unsupported vLLM version
    or an override of operator-owned wiring."""
    minor = vllm_minor(spec)
    plans = []
    for index, model in enumerate(spec.models):
        has_encoder = any(_type(g) == ENCODER for g in model.server_groups)
        path = ec_storage_path(spec, namespace=namespace, name=name, uid=uid, model=model.name) if has_encoder else None
        plans.append(_model_plan(spec, minor, index, model, path))
    return plans


def ec_storage_path(spec: EPDDeploymentSpec, *, namespace: str, name: str, uid: str, model: str) -> str:
    """The model's isolated EC store, e.g. /dev/shm/vime-ec-demo-default-1a2b3c4d.

    Readable, unique per EPDDeployment object (the uid changes when it is recreated) and model,
    stable across reconciles, and a single safe path component.
    """
    digest = hashlib.sha256("\0".join((namespace, name, uid, model)).encode()).hexdigest()[:8]
    readable = re.sub(r"[^a-z0-9-]+", "-", f"{name}-{model}".lower()).strip("-")[:48].rstrip("-")
    root = spec.ec_connector.storage_root.rstrip("/")
    return f"{root}/{spec.ec_connector.path_prefix}{readable}-{digest}"


def engine_flags(minor: str, args: Mapping[str, Any]) -> list[str]:
    """snake_case engine args -> vLLM CLI flags as vLLM `minor` spells them.

    True -> `--flag`; False -> the version's negation (nothing for store_true flags); None and
    empty lists -> omitted; dicts -> compact JSON with sorted keys; lists -> `--flag a b`
    (`--flag a --flag b` for append flags); anything else -> `--flag str(value)`.
    """
    spelling = _spelling(minor)
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
        for cmd in plan.commands:
            where = "" if cmd.worker_type == ROUTER else f" group={cmd.group_index} engine={cmd.engine_index}"
            env = [f"{key}={value}" for key, value in sorted(cmd.env.items())]
            lines.append(f"[{plan.name}{where} {cmd.container_name}] " + shlex.join([*env, *cmd.args]))
    return "\n".join(lines)


def commands_json(plans: list[ModelPlan]) -> list[dict[str, Any]]:
    return [
        {
            "model": cmd.model,
            "workerType": cmd.worker_type,
            "engineIndex": cmd.engine_index,
            "args": list(cmd.args),
            "env": dict(cmd.env),
        }
        for plan in plans
        for cmd in plan.commands
    ]


# --------------------------------------------------------------------------- engines


def _model_plan(
    spec: EPDDeploymentSpec, minor: str, m_index: int, model: ModelSpec, ec_path: str | None
) -> ModelPlan:
    served = model.served_model_name or model.model
    groups = list(enumerate(model.server_groups))
    # Encoders first: they take the lowest ports and start (as sidecars) before the consumers.
    ordered = [g for g in groups if _type(g[1]) == ENCODER] + [g for g in groups if _type(g[1]) != ENCODER]
    engines: list[EngineCommand] = []
    numbers: Counter[str] = Counter()
    for g_index, group in ordered:
        worker_type = _type(group)
        for _ in range(group.engines):
            engine_index = len(engines)
            port = spec.ports.engine_base + engine_index
            nixl_port = spec.ports.nixl_side_channel_base + engine_index if worker_type in PD_TYPES else None
            defaults = _load_yaml(
                _templates.get_template("engine.yaml.j2").render(
                    worker_type=worker_type,
                    served_model_name=served,
                    port=port,
                    gpus=group.num_gpus_per_engine,
                    nixl_port=nixl_port,
                    ec_storage_path=ec_path,
                    ec=spec.ec_connector,
                    kv=spec.kv_connector,
                )
            )
            where = f"spec.models[{m_index}].serverGroups[{g_index}].overrides"
            args = _apply_overrides(defaults["args"], group.overrides, where)
            engines.append(
                EngineCommand(
                    model=model.name,
                    worker_type=worker_type,
                    group_index=g_index,
                    engine_index=engine_index,
                    container_name=f"{worker_type}-{numbers[worker_type]}",
                    port=port,
                    nixl_port=nixl_port,
                    gpus=group.num_gpus_per_engine,
                    args=["vllm", "serve", model.model, *engine_flags(minor, args)],
                    env=defaults["env"],
                )
            )
            numbers[worker_type] += 1
    return ModelPlan(model.name, served, ec_path, engines, _router(spec, model, engines))


def _apply_overrides(defaults: dict[str, Any], overrides: dict[str, Any], where: str) -> dict[str, Any]:
    # vLLM accepts both spellings of a flag; one key per argument keeps each flag single.
    overrides = {key.replace("-", "_"): value for key, value in overrides.items()}
    owned = sorted(OWNED_ARGS.keys() & overrides.keys())
    if owned:
        raise SpecError(
            [f"{where}.{key}: set by the operator from spec.{OWNED_ARGS[key]}; change that instead" for key in owned]
        )
    # Sorted: args new to the defaults come in a stable order whatever the source's key order
    # (a reordered pod template would roll every unit).
    return _merge_patch(defaults, {key: overrides[key] for key in sorted(overrides)})


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: dicts merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


@dataclass(frozen=True)
class _Spelling:
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
def _spelling(minor: str) -> _Spelling:
    text = (resources.files(__package__) / "templates" / f"vllm-{minor}" / "flags.yaml").read_text()
    data = yaml.safe_load(text)
    return _Spelling(
        negated_prefixes=data["negated_prefixes"],
        store_true=frozenset(data["store_true"]),
        append=frozenset(data["append"]),
    )


def _text(value: Any) -> str:
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _type(group: ServerGroup) -> str:
    return WorkerType(group.worker_type).value


# --------------------------------------------------------------------------- router


def _router(spec: EPDDeploymentSpec, model: ModelSpec, engines: list[EngineCommand]) -> EngineCommand | None:
    """vllm-router in front of the consumers, when there is a choice to make: prefill/decode, or
    more than one consumer engine. Encoders are never behind it."""
    consumers = [e for e in engines if e.worker_type != ENCODER]
    pd = any(e.worker_type in PD_TYPES for e in consumers)
    if not pd and len(consumers) < 2:
        return None
    kv_connector = None
    if pd:
        kv_connector = ROUTER_KV_CONNECTORS.get(spec.kv_connector.name)
        if kv_connector is None:
            raise SpecError(
                [
                    f"spec.kvConnector.name: vllm-router coordinates prefill/decode only with "
                    f"{', '.join(ROUTER_KV_CONNECTORS)} (model '{model.name}' has prefill/decode groups)"
                ]
            )

    def urls(worker_type: str) -> list[str]:
        return [f"http://127.0.0.1:{e.port}" for e in consumers if e.worker_type == worker_type]

    args = _load_yaml(
        _templates.get_template("router.yaml.j2").render(
            router=spec.router,
            port=spec.ports.router,
            worker_urls=urls(WorkerType.regular.value),
            prefill_urls=urls(WorkerType.prefill.value),
            decode_urls=urls(WorkerType.decode.value),
            kv_connector=kv_connector,
        )
    )
    return EngineCommand(
        model=model.name,
        worker_type=ROUTER,
        group_index=-1,
        engine_index=-1,
        container_name=ROUTER,
        port=spec.ports.router,
        nixl_port=None,
        gpus=0,
        args=args,
        env={},
    )
