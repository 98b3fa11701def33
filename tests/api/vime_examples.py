"""Vime's documented `vllm:` configs (tests/api/vime/, each file names its source) and what Vime
starts for each: the engines, model paths and weight-synced models convert must reproduce."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VIME = Path(__file__).parent / "vime"
# Vime's --hf-checkpoint in its complete example.
HF_CHECKPOINT = "/data/models/Qwen3-8B"


@dataclass(frozen=True)
class Example:
    file: str
    # Per model, in order: (worker type, engines, GPUs per engine) per group, in group order.
    engines: dict[str, list[tuple[str, int, int]]]
    # Per model: the checkpoint its engines serve.
    paths: dict[str, str]
    # The models Vime syncs the trainer's weights into.
    update_weights: list[str]
    # convert flags besides --hf-checkpoint, as given to Vime's train.py.
    flags: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return VIME / self.file


ACCEPTED = {
    example.file: example
    for example in (
        Example(
            "vllm_basic.yaml",
            {"default": [("regular", 4, 2)]},
            {"default": HF_CHECKPOINT},
            ["default"],
            flags=("--rollout-num-gpus-per-engine", "2"),
        ),
        Example("vllm_pd.yaml", {"actor": [("prefill", 2, 2), ("decode", 3, 4)]}, {"actor": HF_CHECKPOINT}, ["actor"]),
        Example(
            "vllm_multi_model.yaml",
            {"actor": [("regular", 2, 4)], "ref": [("regular", 2, 2)], "reward": [("regular", 2, 2)]},
            {"actor": HF_CHECKPOINT, "ref": "/path/to/ref_model", "reward": "/path/to/reward_model"},
            ["actor"],
        ),
        Example(
            "vllm_full.yaml",
            {"actor": [("prefill", 2, 2), ("decode", 2, 4)], "ref": [("regular", 2, 2)]},
            {"actor": HF_CHECKPOINT, "ref": "/path/to/ref_model"},
            ["actor"],
        ),
        Example("placeholder.yaml", {"actor": [("regular", 3, 2)]}, {"actor": HF_CHECKPOINT}, ["actor"]),
        Example("overrides_vllm.yaml", {"actor": [("regular", 2, 4)]}, {"actor": HF_CHECKPOINT}, ["actor"]),
        Example(
            "vllm_epd.yaml",
            {"actor": [("encoder", 2, 1), ("prefill", 6, 1), ("decode", 8, 1)]},
            {"actor": HF_CHECKPOINT},
            ["actor"],
        ),
        # The model's num_gpus_per_engine for prefill (2, also its own); the global default for ref.
        Example(
            "docstring.yaml",
            {"actor": [("prefill", 2, 2), ("decode", 2, 4)], "ref": [("regular", 4, 1)]},
            {"actor": "/path/to/actor", "ref": "/path/to/ref"},
            ["actor"],
        ),
        Example(
            "engine_groups.yaml",
            {"actor": [("prefill", 2, 2), ("decode", 2, 4)], "ref": [("regular", 4, 1)]},
            {"actor": "/path/to/actor", "ref": "/path/to/ref"},
            ["actor"],
        ),
        Example(
            "model_level_tp.yaml",
            {"actor": [("encoder", 1, 2), ("regular", 3, 2)]},
            {"actor": HF_CHECKPOINT},
            ["actor"],
        ),
    )
}

# SGLang's argument names in Vime's docs: refused, by (file, Vime path of the key, suggestion).
REFUSED = {
    "overrides.yaml": [
        ("vllm[0].server_groups[0].overrides.mem_fraction_static", "gpu_memory_utilization"),
        ("vllm[0].server_groups[0].overrides.context_length", "max_model_len"),
        ("vllm[0].server_groups[0].overrides.chunked_prefill_size", "max_num_batched_tokens"),
        ("vllm[0].server_groups[0].overrides.enable_torch_compile", "compilation_config"),
    ],
    "vllm_agent.yaml": [
        ("vllm[0].server_groups[0].overrides.chunked_prefill_size", "max_num_batched_tokens"),
        ("vllm[0].server_groups[1].overrides.mem_fraction_static", "gpu_memory_utilization"),
    ],
}
