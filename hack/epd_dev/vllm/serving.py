"""EPDDeployments of the tiny model that real vLLM serves on this CPU: what the node tests and
`make demo` share (real_node.py puts them on the real node).

What serving on CPU needs (docs/testing.md, "Serving vLLM on CPU") is set the way a user would
set it, through each server group's `overrides`; the rendered commands are otherwise the
operator's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from epd_client import Endpoints, EPDClientError, discover

from ..operator_process import wait_for
from . import tiny_model

# Every engine gets these; encoders run eager already (a role default), consumers need it too
# (no CUDA graphs on CPU).
CPU_OVERRIDES = {"max_model_len": 512, "dtype": "bfloat16"}
EAGER = {"enforce_eager": True}
# The image the CPU build's version matches: it selects the argument templates.
IMAGE = "vllm/vllm-openai:v0.32.0"
MODEL = "default"


def tiny_manifest(
    name: str, model_dir: Path, groups: list[dict[str, Any]], *, port_base: int = 8000, **spec: Any
) -> dict[str, Any]:
    """An EPDDeployment serving the tiny model with `groups` (serverGroups, camelCase), the CPU
    overrides merged under each group's own.

    Ports are one block from `port_base` (each pod has a network of its own): the front port
    (the EPD proxy's), then per engine an HTTP port, a NIXL side-channel port and (a Pools
    model's encoders) an ECCPUConnector side-channel port, then the router's on the pod's
    loopback behind the proxy. `spec` adds top-level spec fields
    (kvConnector, ...).
    """
    groups = copy.deepcopy(groups)
    for group in groups:
        eager = EAGER if group["workerType"] != "encoder" else {}
        group["overrides"] = {**CPU_OVERRIDES, **eager, **group.get("overrides", {})}
    count = sum(g["numGpus"] // g.get("numGpusPerEngine", 1) for g in groups)
    base = port_base
    return {
        "apiVersion": "epd.vime.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": name},
        "spec": {
            "image": IMAGE,
            "ports": {
                "router": base,
                "engineBase": base + 1,
                "nixlSideChannelBase": base + 1 + count,
                "ecSideChannelBase": base + 1 + 2 * count,
                "routerLoopback": base + 1 + 3 * count,
            },
            "models": [
                {
                    "name": MODEL,
                    "model": str(model_dir),
                    "servedModelName": tiny_model.SERVED_NAME,
                    "serverGroups": groups,
                }
            ],
            **spec,
        },
    }


def in_process_workers(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with every engine running its model in its engine-core process instead of one
    more spawned worker process: one import of torch and vLLM less per engine, so it is ready
    about 20 s sooner (of 90 on a busy 2-core machine) with about 0.7 GB less memory, and answers
    the same. vLLM on CPU allows the single-process executor only with
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (platforms/cpu.py), which leaves the engine core its own
    process still."""
    manifest = copy.deepcopy(manifest)
    spec = manifest["spec"]
    for model in spec["models"]:
        for group in model["serverGroups"]:
            group["overrides"] = {**group.get("overrides", {}), "distributed_executor_backend": "uni"}
    spec["env"] = [*spec.get("env", []), {"name": "VLLM_ENABLE_V1_MULTIPROCESSING", "value": "0"}]
    return manifest


def prefill_decode_groups(kv_store: Path) -> list[dict[str, Any]]:
    """The seed's second topology (encoder, prefill, decode) as it runs on CPU.

    The KV connector is the only substitution: the rendered NixlConnector needs the `nixl`
    package, which the CPU serving venv lacks, so prefill and decode use vLLM's built-in
    ExampleConnector (KV blocks as safetensors files in `kv_store`). The router stays rendered
    with `--kv-connector nixl`: that only decides which kv_transfer_params it passes along, and
    ExampleConnector finds the KV by the prompt's tokens instead. It moves whole blocks of the
    prompt but its last token; the CPU default block of 128 tokens would move nothing of short
    prompts, hence `block_size: 32`.
    """
    kv = {
        "block_size": 32,
        "kv_transfer_config": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(kv_store)},
        },
    }
    return [
        {"workerType": "encoder", "numGpus": 1},
        {"workerType": "prefill", "numGpus": 1, "overrides": kv},
        {"workerType": "decode", "numGpus": 1, "overrides": kv},
    ]


def discover_ready(kubeconfig: Path, name: str, namespace: str, model: str = MODEL, timeout: float = 120) -> Endpoints:
    """The EPDDeployment's endpoints once `discover` shows every unit of `model` ready: the
    EndpointSlices that say where and how each unit is may trail the status that says Ready."""

    def ready() -> Endpoints | None:
        try:
            endpoints = discover(name, namespace, kubeconfig=str(kubeconfig))
        except EPDClientError:
            return None
        units = endpoints.model(model).units
        return endpoints if units and all(u.ready for u in units) else None

    found: Endpoints = wait_for(ready, timeout, f"epd/{name}'s units ready in its EndpointSlices")
    return found
