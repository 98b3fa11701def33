"""EPDDeployments of the tiny model for the real node: the local images, the model on a
PersistentVolume, pinned to epd-real-0.

The model reaches the pods as users ship models: a PersistentVolumeClaim bound to a local
PersistentVolume (the cached tiny model folder, with node affinity to the real node), mounted
read-only through the EPDDeployment's `spec.volumes` / `spec.volumeMounts`; `model:` names the
mount path. No hostPath: Pod Security "restricted" refuses it, and the node tests' namespace
enforces restricted.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from ..images import recipes
from ..localcluster import node
from .serving import in_process_workers, tiny_manifest

MODEL_MOUNT = "/models/tiny-llava"
STORAGE_CLASS = "epd-local"
# What a user sets for an engine of a 1.3 MB model (the operator's defaults, 1 CPU and 4Gi an
# engine, are sized for real models): the 24 GiB node then schedules a unit and the reference
# together. Requests only: a limit would cap the engine's real use, about 2 GB while loading.
ENGINE_REQUESTS = {"cpu": "100m", "memory": "512Mi"}
ROUTER_REQUESTS = {"cpu": "50m", "memory": "64Mi"}
SHM = "256Mi"


def model_volume(name: str, model_dir: Path) -> list[dict[str, Any]]:
    """A local PersistentVolume holding `model_dir` on the real node, and a claim bound to it
    (`name` names both; a PV is cluster-wide, so make it unique)."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "64Mi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": STORAGE_CLASS,
            "local": {"path": str(model_dir)},
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node.NAME]}
                            ]
                        }
                    ]
                }
            },
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": STORAGE_CLASS,
            "volumeName": name,
            "resources": {"requests": {"storage": "64Mi"}},
        },
    }
    return [pv, pvc]


def node_manifest(
    name: str, claim: str, groups: list[dict[str, Any]], *, shm: str = SHM, **spec: Any
) -> dict[str, Any]:
    """`tiny_manifest` for the real node: the local vLLM and router images, the model from the
    claim `claim` mounted read-only at MODEL_MOUNT, pinned to epd-real-0 (its nodeSelector and
    taint), small requests (ENGINE_REQUESTS) and /dev/shm (`shm`), engines in-process (one
    process less each: this machine has 2 cores), probes every 2 s so the tests see changes
    soon. `spec` adds or replaces top-level spec fields."""
    groups = [{"resources": {"requests": dict(ENGINE_REQUESTS)}, **group} for group in groups]
    manifest = in_process_workers(tiny_manifest(name, Path(MODEL_MOUNT), groups, port_base=8000))
    body = manifest["spec"]
    body["image"] = recipes.VLLM_CPU_REF
    body["router"] = {"image": recipes.ROUTER_REF, "resources": {"requests": dict(ROUTER_REQUESTS)}}
    body["nodeSelector"] = dict(node.NODE_SELECTOR)
    body["tolerations"] = copy.deepcopy(node.TOLERATIONS)
    body["volumes"] = [{"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}]
    body["volumeMounts"] = [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]
    body["shm"] = {"sizeLimit": shm}
    body["probes"] = {"periodSeconds": 2, "failureThreshold": 3}
    body.update(spec)
    return manifest
