"""Turn a Vime `vllm:` config (the YAML of its `--vllm-config`) into an EPDDeployment manifest.

Vime's resolution rules (its docs/en/advanced/vllm-config.md and
vime/backends/vllm_utils/vllm_config.py; docs/vime.md has the whole mapping):

- GPUs per engine (tensor parallel size): the group's `num_gpus_per_engine`, else the model's,
  else Vime's `--rollout-num-gpus-per-engine` (default 1);
- model path: the group's `overrides.model_path`, else the model's `model_path`, else
  `--hf-checkpoint`; every group of a model must agree;
- `update_weights`: as given, else true exactly when the model path is `--hf-checkpoint`;
- `engine_groups` is the older name of `server_groups`;
- `placeholder` groups reserve GPUs for co-located training and start no engine.

What the manifest cannot carry is said in a note, never dropped silently; what would not run is
refused with the path of the field in the Vime config.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import api
from .engine_args import engine_arg_name, override_errors
from .validation import OWNED_ARGS, SpecError, validate, vllm_minor

# Models that receive the trainer's weights, comma-separated: the operator syncs no weights, the
# trainer's own sync (Vime's update_weights) can read which engines it must update from here.
UPDATE_WEIGHTS_ANNOTATION = f"{api.GROUP}/update-weights"
# Vime's `--rollout-num-gpus-per-engine` default.
VIME_GPUS_PER_ENGINE = 1

MODEL_KEYS = ("name", "model_path", "update_weights", "num_gpus_per_engine", "server_groups", "engine_groups")
GROUP_KEYS = ("worker_type", "num_gpus", "num_gpus_per_engine", "overrides")
PLACEHOLDER = "placeholder"
WORKER_TYPES = (*(t.value for t in api.WorkerType), PLACEHOLDER)
# What to set in a Vime config instead of an override the operator derives itself.
VIME_INSTEAD = {"tensor_parallel_size": "num_gpus_per_engine", "model": "model_path"}


@dataclass(frozen=True)
class Conversion:
    manifest: dict[str, Any]
    notes: list[str]  # for the person converting: resolved layouts, fields dropped or carried elsewhere


@dataclass(frozen=True)
class _Model:
    spec: dict[str, Any]  # the EPDDeployment's models[] entry
    update_weights: bool


def vime_to_manifest(
    vime: Any,
    *,
    name: str,
    image: str,
    hf_checkpoint: str | None = None,
    num_gpus_per_engine: int = VIME_GPUS_PER_ENGINE,
    vllm_version: str | None = None,
    namespace: str | None = None,
) -> Conversion:
    """Convert Vime's config. `hf_checkpoint` and `num_gpus_per_engine` are Vime's
    `--hf-checkpoint` and `--rollout-num-gpus-per-engine`, the defaults of its resolution rules.

    Raises SpecError with every problem, each naming its place in the Vime config; the result
    is also checked by the operator's own validation, so it will not fail at apply time.
    """
    entries = vime.get("vllm") if isinstance(vime, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SpecError(["vllm: expected a non-empty list of models (Vime's `vllm:` section)"])
    if num_gpus_per_engine < 1:
        raise SpecError([f"--num-gpus-per-engine: {num_gpus_per_engine} is not a GPU count: use 1 or more"])
    # Only the image (or vllmVersion) decides the version; the models are built below.
    minor = vllm_minor(api.EPDDeploymentSpec.model_construct(image=image, vllm_version=vllm_version, models=[]))
    notes = [f"{key}: ignored: only the `vllm:` section describes engines" for key in vime if key != "vllm"]
    errors: list[str] = []
    models: list[_Model] = []
    for index, entry in enumerate(entries):
        model = _model(entry, f"vllm[{index}]", minor, hf_checkpoint, num_gpus_per_engine, errors, notes)
        if model:
            models.append(model)
    if errors:
        raise SpecError(errors)
    if not models:
        raise SpecError(["vllm: no model has an engine to run (only placeholder groups)"])
    spec: dict[str, Any] = {"image": image, "models": [m.spec for m in models]}
    if vllm_version:
        spec["vllmVersion"] = vllm_version
    validate(spec)
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    updated = [m.spec["name"] for m in models if m.update_weights]
    if updated:
        metadata["annotations"] = {UPDATE_WEIGHTS_ANNOTATION: ",".join(updated)}
        notes.append(
            f"update_weights: Vime syncs the trainer's weights into {', '.join(updated)}; the operator does "
            f"not, so convert lists them in the annotation {UPDATE_WEIGHTS_ANNOTATION} for the trainer's own sync"
        )
    manifest = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}
    return Conversion(manifest, notes)


def _model(
    entry: Any,
    where: str,
    minor: str,
    hf_checkpoint: str | None,
    default_gpus: int,
    errors: list[str],
    notes: list[str],
) -> _Model | None:
    """One `vllm[]` entry as an EPDDeployment model; None when it is invalid (its problems are
    added to `errors`) or starts no engine."""
    if not isinstance(entry, dict):
        errors.append(f"{where}: expected a mapping with name and server_groups")
        return None
    problems = _unknown_keys(entry, MODEL_KEYS, where)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        problems.append(f"{where}.name: required: the model's name (Vime's key for its router)")
    if "server_groups" in entry and "engine_groups" in entry:
        problems.append(f"{where}: both server_groups and engine_groups (its older name): keep server_groups")
    groups_key = "engine_groups" if "engine_groups" in entry else "server_groups"
    raw_groups = entry.get(groups_key)
    if not isinstance(raw_groups, list) or not raw_groups:
        problems.append(f"{where}.{groups_key}: expected a non-empty list of server groups")
        raw_groups = []
    model_gpus = entry.get("num_gpus_per_engine")
    problems += _count_errors(model_gpus, f"{where}.num_gpus_per_engine", required=False)
    if "update_weights" in entry and not isinstance(entry["update_weights"], bool):
        problems.append(f"{where}.update_weights: expected true or false")
    if "model_path" in entry and not (isinstance(entry["model_path"], str) and entry["model_path"]):
        problems.append(f"{where}.model_path: expected a path")

    groups: list[dict[str, Any]] = []
    group_paths: list[str | None] = []  # each group's overrides.model_path
    for g_index, raw in enumerate(raw_groups):
        group_where = f"{where}.{groups_key}[{g_index}]"
        group, path = _group(raw, group_where, minor, model_gpus, default_gpus, problems, notes)
        if group:
            groups.append(group)
            group_paths.append(path)
    errors += problems
    if problems:
        return None
    if not groups:
        notes.append(f"{where} ({name}): only placeholder groups: no engines, so no model in the EPDDeployment")
        return None

    found = {path or entry.get("model_path") or hf_checkpoint for path in group_paths}
    if None in found:
        errors.append(f"{where}: no model path: set model_path, or pass --hf-checkpoint (as to Vime)")
        return None
    paths = {str(path) for path in found}
    if len(paths) > 1:
        errors.append(
            f"{where}: its groups use different model paths ({', '.join(sorted(paths))}): Vime requires "
            "one per model: put each path in a model of its own"
        )
        return None
    [path] = paths
    update_weights = entry.get("update_weights")
    if update_weights is None:
        # Vime's inference, and its warning when it says no.
        update_weights = path == hf_checkpoint
        if not update_weights:
            notes.append(
                f"{where} ({name}).update_weights: not set, so false: its model path {path} is not "
                "--hf-checkpoint (set it to say so)"
            )
    notes.append(f"{where} ({name}): {_layout(groups)} in each EPD unit (one pod on one node)")
    return _Model({"name": name, "model": path, "serverGroups": groups}, update_weights)


def _group(
    raw: Any,
    where: str,
    minor: str,
    model_gpus: Any,
    default_gpus: int,
    problems: list[str],
    notes: list[str],
) -> tuple[dict[str, Any] | None, str | None]:
    """(the EPDDeployment group, or None for a placeholder or an invalid group; the group's
    overrides.model_path or None)."""
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping with worker_type and num_gpus")
        return None, None
    problems += _unknown_keys(raw, GROUP_KEYS, where)
    worker_type = raw.get("worker_type")
    if worker_type not in WORKER_TYPES:
        problems.append(f"{where}.worker_type: {worker_type!r} is not one of {', '.join(WORKER_TYPES)}")
    problems += _count_errors(raw.get("num_gpus"), f"{where}.num_gpus", required=True)
    problems += _count_errors(raw.get("num_gpus_per_engine"), f"{where}.num_gpus_per_engine", required=False)
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        problems.append(f"{where}.overrides: expected a mapping of vLLM engine arguments")
        overrides = {}
    if worker_type == PLACEHOLDER:
        notes.append(
            f"{where}: placeholder group dropped: in Vime it reserves {raw.get('num_gpus')} GPUs for co-located "
            "training, which has no meaning for an EPDDeployment (its pods run engines only)"
        )
        return None, None

    # Vime's own keys in overrides: model_path is the group's model path; disaggregation* are
    # skipped by Vime (it sets the prefill/decode role), as the operator sets each engine's role.
    path = None
    engine_args: dict[str, Any] = {}
    for key, value in overrides.items():
        name = engine_arg_name(key)
        if name == "model_path":
            path = value
        elif isinstance(name, str) and name.startswith("disaggregation"):
            notes.append(f"{where}.overrides.{key}: dropped: Vime skips it too; the operator sets each engine's role")
        else:
            engine_args[key] = value
    problems += override_errors(minor, engine_args, f"{where}.overrides")
    for key in engine_args:
        name = engine_arg_name(key)
        if name in OWNED_ARGS:
            instead = f"set {VIME_INSTEAD[name]} instead" if name in VIME_INSTEAD else "remove it"
            problems.append(f"{where}.overrides.{key}: the operator sets it (spec.{OWNED_ARGS[name]}): {instead}")

    gpus = raw.get("num_gpus_per_engine") or model_gpus or default_gpus
    source = (
        "its num_gpus_per_engine"
        if raw.get("num_gpus_per_engine")
        else "the model's num_gpus_per_engine"
        if model_gpus
        else "--num-gpus-per-engine"
    )
    num_gpus = raw.get("num_gpus")
    if isinstance(num_gpus, int) and isinstance(gpus, int) and gpus >= 1 and num_gpus % gpus:
        problems.append(
            f"{where}.num_gpus: {num_gpus} is not a multiple of {gpus} GPUs per engine (from {source}): "
            "a unit runs whole engines"
        )
    group: dict[str, Any] = {"workerType": worker_type, "numGpus": num_gpus, "numGpusPerEngine": gpus}
    if engine_args:
        group["overrides"] = engine_args
    return group, path


def _unknown_keys(raw: Mapping[str, Any], known: tuple[str, ...], where: str) -> list[str]:
    errors = []
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"expected {', '.join(known)}"
            errors.append(f"{where}.{key}: not a field of Vime's vllm config: {hint}")
    return errors


def _count_errors(value: Any, where: str, *, required: bool) -> list[str]:
    if value is None and not required:
        return []
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [f"{where}: expected a GPU count (1 or more), got {value!r}"]
    return []


def _layout(groups: list[dict[str, Any]]) -> str:
    parts = []
    for group in groups:
        engines = group["numGpus"] // group["numGpusPerEngine"]
        parts.append(f"{engines} {group['workerType']} engine{'s' * (engines != 1)} at TP {group['numGpusPerEngine']}")
    return " + ".join(parts) + f" = {sum(g['numGpus'] for g in groups)} GPUs"
