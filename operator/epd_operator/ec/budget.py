"""Each model's EC byte budget, and whether it is too small: pure functions of the spec."""

from __future__ import annotations

import math
from decimal import Decimal
from typing import TYPE_CHECKING

from .quantity import human_bytes, parse_quantity

if TYPE_CHECKING:
    from ..api import EPDDeploymentSpec, ModelSpec

DEFAULT_BUDGET_SHARE = Decimal("0.8")  # of shm.sizeLimit: /dev/shm also holds vLLM's own buffers

# budget_warning's assumptions. One image embedding of a 7B-class VL model at about one
# megapixel: ~1,344 tokens x hidden 3,584 x 2 bytes (bf16), ~9 MiB. The operator cannot know the
# real size (it depends on the model and image sizes); the janitor's metrics show it.
ASSUMED_EMBEDDING_BYTES = 1344 * 3584 * 2
# vLLM's default max_num_seqs for an API server on most GPUs (H100-class and larger: 1024).
VLLM_DEFAULT_MAX_NUM_SEQS = 256


def default_max_bytes(size_limit: str) -> int:
    """The default EC budget: 80% of the shm emptyDir's sizeLimit."""
    return math.floor(parse_quantity(size_limit) * DEFAULT_BUDGET_SHARE)


def effective_max_bytes(spec: EPDDeploymentSpec) -> int:
    return spec.ec_storage.max_bytes or default_max_bytes(spec.shm.size_limit)


def budget_warning(
    spec: EPDDeploymentSpec, model: ModelSpec, *, embedding_bytes: int = ASSUMED_EMBEDDING_BYTES
) -> str | None:
    """Why this model's EC budget is too small, or None (also for a text-only model).

    Too small means: at least sizeLimit (the emptyDir fills before the janitor can act), or
    fewer than one image embedding per sequence the unit's EC consumers run at once. Then
    entries are evicted before the consumers read them and they silently encode the images
    themselves, which EPD exists to avoid.
    """
    if not model.has_encoders or model.pooled:
        return None  # no EC store: a text-only model, or encoders in a pool
    budget = effective_max_bytes(spec)
    shm = parse_quantity(spec.shm.size_limit)
    if budget >= shm:
        return (
            f"model {model.name}: ecStorage.maxBytes ({human_bytes(budget)}) is not below shm.sizeLimit "
            f"({spec.shm.size_limit}); /dev/shm also holds vLLM's own shared memory, so it fills up "
            "(and the unit is evicted) before the janitor evicts anything"
        )
    sequences = 0
    for group in model.server_groups:
        if group.worker_type.is_ec_consumer:
            seqs = group.overrides.get("max_num_seqs")
            sequences += group.engines * (seqs if isinstance(seqs, int) and seqs > 0 else VLLM_DEFAULT_MAX_NUM_SEQS)
    needed = sequences * embedding_bytes
    if budget < needed:
        return (
            f"model {model.name}: EC budget {human_bytes(budget)} holds fewer than one image per sequence its "
            f"consumers run at once ({sequences} sequences x ~{human_bytes(embedding_bytes)}, an assumed image "
            f"embedding size, = {human_bytes(needed)}); consumers will re-encode evicted images themselves. "
            "Raise shm.sizeLimit or ecStorage.maxBytes, or lower max_num_seqs"
        )
    return None
