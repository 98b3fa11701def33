"""ECCPUConnector's regions (placement Pools): pure functions of the spec.

Every EC engine that runs ECCPUConnector maps its own `/dev/shm/vllm_ec_<engine>.mmap` of
`ec_cpu_bytes` and fills it at start (vLLM's ECSharedRegion), so the regions of one pod must fit
in that pod's /dev/shm emptyDir together, with room left for vLLM's own shared memory: the same
80% share the EC store's default budget uses.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .budget import DEFAULT_BUDGET_SHARE
from .quantity import human_bytes, parse_quantity

if TYPE_CHECKING:
    from ..api import EPDDeploymentSpec, ModelSpec, ServerGroup

CPU_CONNECTOR = "ECCPUConnector"
CPU_BYTES = "ec_cpu_bytes"
# Smaller than any image embedding (a 7B-class VL model's is ~9 MiB, budget.py): a region this
# small, or 0 from a tiny /dev/shm, makes every save fail.
MIN_REGION_BYTES = 2**20


def uses_cpu_regions(model: ModelSpec) -> bool:
    return model.pooled and model.pools_connector.name == CPU_CONNECTOR


def pod_shm_limit(spec: EPDDeploymentSpec, model: ModelSpec, *, pool: bool) -> str:
    """The /dev/shm sizeLimit of the model's encoder pool pods (`pool`) or of its units."""
    return (spec.pool_shm(model) if pool else spec.shm).size_limit


def _in_pool(group: ServerGroup) -> bool:
    return group.worker_type.is_encoder


def _region_groups(model: ModelSpec, *, pool: bool) -> list[ServerGroup]:
    """The groups whose engines map a region in one pod: encoders in the pool, EC consumers in a unit."""
    return [g for g in model.server_groups if g.worker_type.ec_role and _in_pool(g) == pool]


def explicit_cpu_bytes(model: ModelSpec, group: ServerGroup) -> Any:
    """`ec_cpu_bytes` as the user set it (the group's overrides win over the model's connector), or None."""
    transfer = group.overrides.get("ec_transfer_config")
    extra = transfer.get("ec_connector_extra_config") if isinstance(transfer, dict) else None
    if isinstance(extra, dict) and extra.get(CPU_BYTES) is not None:
        return extra[CPU_BYTES]
    return model.pools_connector.extra_config.get(CPU_BYTES)


def default_cpu_bytes(spec: EPDDeploymentSpec, model: ModelSpec, group: ServerGroup) -> int:
    """An equal share of 80% of the pod's /dev/shm for each engine of the pod that maps a region."""
    pool = _in_pool(group)
    engines = sum(g.engines for g in _region_groups(model, pool=pool))
    shm = parse_quantity(pod_shm_limit(spec, model, pool=pool))
    return math.floor(shm * DEFAULT_BUDGET_SHARE / max(engines, 1))


def _whole_bytes(value: Any) -> int | None:
    """vLLM reads ec_cpu_bytes with int(): a positive integer, or a string of digits."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value > 0 else None
    if isinstance(value, str) and value.strip().isdigit() and int(value) > 0:
        return int(value)
    return None


def cpu_bytes(spec: EPDDeploymentSpec, model: ModelSpec, group: ServerGroup) -> int:
    """The region of each engine of `group` (region_errors refused values that are no byte count)."""
    explicit = _whole_bytes(explicit_cpu_bytes(model, group))
    return explicit if explicit is not None else default_cpu_bytes(spec, model, group)


def region_errors(spec: EPDDeploymentSpec, index: int, model: ModelSpec) -> list[str]:
    """ec_cpu_bytes that vLLM cannot read, or regions that do not fit in their pod's /dev/shm."""
    if not uses_cpu_regions(model):
        return []
    where = f"spec.models[{index}]"
    errors = []
    for g_index, group in enumerate(model.server_groups):
        value = explicit_cpu_bytes(model, group)
        if group.worker_type.ec_role and value is not None and _whole_bytes(value) is None:
            errors.append(
                f"{where}: ec_cpu_bytes {value!r} (serverGroups[{g_index}]) is not a positive whole number of "
                "bytes: vLLM reads it with int()"
            )
    if errors:
        return errors
    for pool, pod, field in (
        (True, "an encoder pool pod", f"{where}.encoderPool.shm.sizeLimit"),
        (False, "a unit", "spec.shm.sizeLimit"),
    ):
        groups = _region_groups(model, pool=pool)
        total = sum(g.engines * cpu_bytes(spec, model, g) for g in groups)
        limit = pod_shm_limit(spec, model, pool=pool)
        room = math.floor(parse_quantity(limit) * DEFAULT_BUDGET_SHARE)
        smallest = min((cpu_bytes(spec, model, g) for g in groups), default=MIN_REGION_BYTES)
        if smallest < MIN_REGION_BYTES:
            errors.append(
                f"{where}: an ECCPUConnector region of {pod} of model '{model.name}' would be {smallest} bytes, "
                f"below 1Mi: too small for any image embedding; raise {field} or set ec_cpu_bytes"
            )
        elif total > room:
            errors.append(
                f"{where}: the ECCPUConnector regions of {pod} of model '{model.name}' take "
                f"{human_bytes(total)} of /dev/shm ({sum(g.engines for g in groups)} engines), more than 80% of "
                f"its sizeLimit {limit} ({human_bytes(room)}; vLLM needs the rest): lower ec_cpu_bytes or raise {field}"
            )
    return errors
