"""Turn a Vime `vllm:` config (snake_case server groups) into an EPDDeployment manifest."""

from __future__ import annotations

from typing import Any

from . import api
from .validation import SpecError, validate

_GROUP_KEYS = {
    "worker_type": "workerType",
    "num_gpus": "numGpus",
    "num_gpus_per_engine": "numGpusPerEngine",
    "overrides": "overrides",
}


def _group(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise SpecError([f"{where}: expected a mapping with worker_type and num_gpus"])
    unknown = sorted(set(raw) - set(_GROUP_KEYS))
    if unknown:
        raise SpecError([f"{where}: unknown key(s) {', '.join(unknown)}: expected {', '.join(_GROUP_KEYS)}"])
    return {_GROUP_KEYS[k]: v for k, v in raw.items()}


def vime_to_manifest(
    vime: dict[str, Any], *, name: str, image: str, model: str | None = None, namespace: str | None = None
) -> dict[str, Any]:
    """Convert Vime's config; `model` is the checkpoint for entries that do not name one.

    The result is validated with the same rules as the operator, so an invalid Vime layout fails
    here with the rule's message instead of at apply time.
    """
    entries = vime.get("vllm") if isinstance(vime, dict) else None
    if not isinstance(entries, list) or not entries:
        raise SpecError(["vllm: expected a non-empty list of models (Vime's `vllm:` section)"])
    models = []
    for index, entry in enumerate(entries):
        where = f"vllm[{index}]"
        if not isinstance(entry, dict) or "server_groups" not in entry:
            raise SpecError([f"{where}: expected a mapping with name and server_groups"])
        checkpoint = entry.get("model") or entry.get("model_path") or model
        if not checkpoint:
            raise SpecError([f"{where}: no model path: add `model:` to the entry or pass --model"])
        groups = entry["server_groups"]
        if not isinstance(groups, list):
            raise SpecError([f"{where}.server_groups: expected a list"])
        converted = {
            "name": entry.get("name", "default"),
            "model": checkpoint,
            "serverGroups": [_group(g, f"{where}.server_groups[{i}]") for i, g in enumerate(groups)],
        }
        if entry.get("served_model_name"):
            converted["servedModelName"] = entry["served_model_name"]
        models.append(converted)
    spec = {"image": image, "models": models}
    validate(spec)
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}
