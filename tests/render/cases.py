"""The specs the golden and contract tests render: the seed's two topologies, override cases,
encoder pools and text-only models, each for every supported vLLM version."""

from __future__ import annotations

import copy
from typing import Any

from epd_operator.render import ModelPlan, render
from epd_operator.validation import SUPPORTED_VLLM_VERSIONS, validate

VERSIONS = SUPPORTED_VLLM_VERSIONS
MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"
OBJECT = {"namespace": "team-a", "name": "demo", "uid": "6f1c2a9e-0d4b-4c8e-9a57-3b2f1e0c7d64"}

CASES: dict[str, dict[str, Any]] = {
    # Seed topology 1: encoder plus a combined prefill/decode worker.
    "encoder-regular": {
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 1},
                    {"workerType": "regular", "numGpus": 1},
                ],
            }
        ],
    },
    # Seed topology 2: encoder plus separate prefill and decode workers.
    "encoder-prefill-decode": {
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 1},
                    {"workerType": "prefill", "numGpus": 1},
                    {"workerType": "decode", "numGpus": 1},
                ],
            }
        ],
    },
    # Overrides win over every default; several engines per group put a router in front.
    "overrides-regular": {
        "ecConnector": {"modulePath": "my_connectors.ec", "extraConfig": {"flush_interval_s": 5}},
        "router": {"policy": "cache_aware", "requestTimeoutSeconds": 600, "extraArgs": ["--disable-circuit-breaker"]},
        "models": [
            {
                "name": "vlm",
                "model": MODEL,
                "servedModelName": "actor",
                "serverGroups": [
                    # Listed after the consumers: encoders still come first.
                    {
                        "workerType": "regular",
                        "numGpus": 4,
                        "numGpusPerEngine": 2,
                        "overrides": {
                            "max_model_len": 4096,
                            "gpu-memory-utilization": 0.85,
                            "middleware": ["a.b:m1", "a.b:m2"],
                        },
                    },
                    {
                        "workerType": "encoder",
                        "numGpus": 2,
                        "overrides": {
                            "mm_encoder_only": False,
                            "enable_prefix_caching": True,
                            "enforce_eager": None,
                            "ec_transfer_config": {
                                "ec_buffer_device": "cpu",
                                "ec_connector_extra_config": {"shm_budget": "4Gi"},
                            },
                        },
                    },
                ],
            }
        ],
    },
    "overrides-prefill-decode": {
        "kvConnector": {"extraConfig": {"backends": ["UCX"]}},
        "proxy": {"media": {"allowRedirects": True}},
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 1, "overrides": {"disable_log_stats": True}},
                    {
                        "workerType": "prefill",
                        "numGpus": 2,
                        "overrides": {
                            "enable_prefix_caching": False,
                            "max_num_batched_tokens": 8192,
                            "kv_transfer_config": {
                                "kv_buffer_device": "cpu",
                                "kv_connector_extra_config": {"num_threads": 4},
                            },
                        },
                    },
                    {"workerType": "decode", "numGpus": 1},
                    {"workerType": "prefill", "numGpus": 1},
                ],
            }
        ],
    },
    # Placement Pools: encoders in their own pool pods, consumers read over NIXL (ECCPUConnector);
    # each pod's regions share 80% of its /dev/shm, the pool's own size here.
    "pools-regular": {
        "shm": {"sizeLimit": "8Gi"},
        # Media from these hosts only, in every engine (the pool's encoders too) and the proxy.
        "proxy": {"media": {"allowedDomains": ["images.example.com", "10.0.0.5"]}},
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "placement": "Pools",
                "encoderReplicas": 2,
                "encoderPool": {"shm": {"sizeLimit": "4Gi"}},
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 2},
                    {"workerType": "regular", "numGpus": 2},
                ],
            }
        ],
    },
    # The user's ec_cpu_bytes and extra config: the model's connector, then a group's overrides.
    "pools-prefill-decode": {
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "placement": "Pools",
                "ecConnector": {"extraConfig": {"ec_cpu_bytes": 2147483648, "consumer_ack_timeout_s": 30}},
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 1},
                    {
                        "workerType": "prefill",
                        "numGpus": 1,
                        "overrides": {
                            "ec_transfer_config": {"ec_connector_extra_config": {"ec_cpu_bytes": "1073741824"}}
                        },
                    },
                    {"workerType": "decode", "numGpus": 1},
                ],
            }
        ],
    },
    # No encoder group: no EC configuration at all.
    "text-only": {
        "models": [
            {"name": "chat", "model": "Qwen/Qwen3-0.6B", "serverGroups": [{"workerType": "regular", "numGpus": 1}]},
            {
                "name": "chat-pd",
                "model": "Qwen/Qwen3-0.6B",
                "serverGroups": [{"workerType": "prefill", "numGpus": 1}, {"workerType": "decode", "numGpus": 1}],
            },
        ],
    },
}


def raw_spec(case: str, version: str) -> dict[str, Any]:
    return {"image": f"vllm/vllm-openai:v{version}.0", **copy.deepcopy(CASES[case])}


def plans(case: str, version: str) -> list[ModelPlan]:
    return render(validate(raw_spec(case, version)), **OBJECT)
