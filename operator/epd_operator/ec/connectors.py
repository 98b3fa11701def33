"""What vLLM checks in an engine's EC transfer config as it starts, checked at apply time.

vLLM builds its ECTransferConfig from `--ec-transfer-config`, then the connector reads its extra
config: a value either refuses makes every engine of the group exit at start, after its pod was
scheduled, and crash-loop. These are vLLM's own rules (0.32 to 0.34 alike), applied to each
group's EC config as its engines get it: the one engine.yaml.j2 renders, with the group's
overrides merged over it. tests/render/test_connector_contract.py runs vLLM's own classes on what
the operator renders, and on what each rule here refuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine_args import V2_MODEL_RUNNER_ENV, known_env_vars, merge_patch
from .regions import CPU_BYTES, CPU_CONNECTOR, cpu_bytes, uses_cpu_regions

if TYPE_CHECKING:
    from ..api import EPDDeploymentSpec, ModelSpec, ServerGroup

EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
PRODUCER_ROLES = ("ec_producer", "ec_both")
NIXL = "ec_enable_nixl"
ACK_TIMEOUT = "consumer_ack_timeout_s"
MOONCAKE_CONNECTOR = "ECMooncakeConnector"
CROSS_ENCODER_CACHE = "cross_encoder_cache"
# ECMooncakeConnector's numbers (vLLM's MooncakeECConfig.from_vllm_config): positive and finite.
MOONCAKE_SECONDS = ("control_timeout_s", "push_wait_timeout_s")
MOONCAKE_COUNTS = ("store_max_pending_items", "store_max_pending_bytes", "store_read_buffer_bytes")
MOONCAKE_DEFAULT_PORT = 14579  # ECTransferConfig.ec_port
MOONCAKE_PRODUCER_TP = "ECMooncakeConnector producers run tensor_parallel_size 1 (vLLM refuses more): use 1"


@dataclass(frozen=True)
class GroupEC:
    """One group's EC config as its engines get it, and the fields that set it."""

    config: dict[str, Any]  # the effective ec_transfer_config, {} when the group has none
    override: dict[str, Any]  # the group's overrides.ec_transfer_config, {} when it has none
    override_path: str  # spec.models[i].serverGroups[g].overrides.ec_transfer_config
    connector_path: str  # spec.ecConnector, or spec.models[i].ecConnector (placement Pools)

    @property
    def connector(self) -> Any:
        return self.config.get("ec_connector")

    @property
    def role(self) -> Any:
        return self.config.get("ec_role")

    @property
    def extra(self) -> dict[str, Any]:
        extra = self.config.get("ec_connector_extra_config")
        return extra if isinstance(extra, dict) else {}

    def where(self, key: str) -> str:
        """The field that set extra config `key`: the group's override, else the connector's."""
        extra = self.override.get("ec_connector_extra_config", {})
        if not isinstance(extra, dict):
            return f"{self.override_path}.ec_connector_extra_config"
        if key in extra:
            return f"{self.override_path}.ec_connector_extra_config.{key}"
        return f"{self.connector_path}.extraConfig.{key}"

    def where_top(self, key: str) -> str:
        return f"{self.override_path}.{key}"


def rendered_ec_config(spec: EPDDeploymentSpec, model: ModelSpec, group: ServerGroup) -> dict[str, Any]:
    """The EC config engine.yaml.j2 gives the group's engines before their overrides, as far as
    vLLM's checks read it (the store path of a Unit model stands for the model's own)."""
    role = group.worker_type.ec_role
    if not role or not model.has_encoders:
        return {}
    if model.pooled:
        connector: Any = model.pools_connector
        extra = dict(connector.extra_config)
        if uses_cpu_regions(model):
            extra.update({CPU_BYTES: cpu_bytes(spec, model, group), NIXL: True})
    else:
        connector = spec.ec_connector
        extra = {**connector.extra_config, "shared_storage_path": "<the model's store>"}
    config = {"ec_connector": connector.name, "ec_role": role, "ec_connector_extra_config": extra}
    if connector.module_path:
        config["ec_connector_module_path"] = connector.module_path
    return config


def group_ec(spec: EPDDeploymentSpec, index: int, model: ModelSpec, g_index: int, group: ServerGroup) -> GroupEC:
    override = group.overrides.get("ec_transfer_config", {})
    rendered = rendered_ec_config(spec, model, group)
    # A null override drops the whole config, as it drops any default; a value that is no object
    # replaces it (an empty list renders no flag at all).
    config = {} if override is None else merge_patch(rendered, override)
    return GroupEC(
        config=config if isinstance(config, dict) else {},
        override=override if isinstance(override, dict) else {},
        override_path=f"spec.models[{index}].serverGroups[{g_index}].overrides.ec_transfer_config",
        connector_path=f"spec.models[{index}].ecConnector" if model.pooled else "spec.ecConnector",
    )


def _truthy(value: Any) -> bool:
    """ECCPUConnector's reading of ec_enable_nixl: a bool, or a string such as "true"."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def _positive_count(value: Any) -> bool:
    """vLLM's `_positive_int`: an int, an integral finite float or a string of one; above 0."""
    if isinstance(value, bool):
        return False
    if isinstance(value, float):
        return math.isfinite(value) and value.is_integer() and value > 0
    try:
        return int(value) > 0
    except (TypeError, ValueError):
        return False


def _positive_seconds(value: Any) -> bool:
    """vLLM's `_positive_float`: float() of it, finite and above 0."""
    if isinstance(value, bool):
        return False
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(seconds) and seconds > 0


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _transfer_errors(ec: GroupEC) -> list[str]:
    """ECTransferConfig's own checks: a known role, and one whenever a connector is set."""
    if ec.role is not None and ec.role not in EC_ROLES:
        return [
            f"{ec.where_top('ec_role')}: {ec.role!r} is not an EC role vLLM knows: use one of {', '.join(EC_ROLES)}"
        ]
    if ec.connector is not None and ec.role is None:
        field = ec.where_top("ec_role" if "ec_role" in ec.override else "ec_connector")
        return [
            (
                f"{field}: the EC connector {ec.connector} would run without an ec_role, which vLLM refuses: set "
                f"ec_role (one of {', '.join(EC_ROLES)}) or drop the connector (ec_connector: null)"
            )
        ]
    return []


def _cpu_errors(model: ModelSpec, ec: GroupEC) -> list[str]:
    """ECCPUConnector's checks as its scheduler starts (vLLM's ECCPUScheduler)."""
    errors = []
    if ec.extra.get(CPU_BYTES) is None:  # a value that is no byte count: region_errors says so
        errors.append(
            f"{ec.where(CPU_BYTES)}: ECCPUConnector needs ec_cpu_bytes (the engine's region in /dev/shm) and vLLM "
            "refuses to start without it: leave it out of the overrides (the operator sizes it) or set a byte count"
        )
    nixl = _truthy(ec.extra.get(NIXL, False))
    if model.pooled and not nixl:
        errors.append(
            f"{ec.where(NIXL)}: without NIXL ECCPUConnector reads only its own pod's region, and a Pools model's "
            "encoders run in other pods: remove it"
        )
    timeout = ec.extra.get(ACK_TIMEOUT)
    if nixl and timeout is not None and not _is_number(timeout):
        errors.append(f"{ec.where(ACK_TIMEOUT)}: {timeout!r} is not a number of seconds: vLLM reads it with float()")
    return errors


def _v2_model_runner(spec: EPDDeploymentSpec, group: ServerGroup, group_path: str) -> bool:
    """Whether the group's engines get VLLM_USE_V2_MODEL_RUNNER=1 from the spec's env lists."""
    found = spec.engine_env(group, group_path).get(V2_MODEL_RUNNER_ENV)
    return found is not None and found[1].value == "1"


def _mooncake_errors(
    spec: EPDDeploymentSpec, minor: str | None, model: ModelSpec, group: ServerGroup, ec: GroupEC, group_path: str
) -> list[str]:
    """ECMooncakeConnector's checks as it starts (vLLM's MooncakeECConfig.from_vllm_config)."""
    errors = []
    producer = ec.role in PRODUCER_ROLES
    # A Pools model's encoder groups: placement_errors' rule (the CRD's too) says it for them.
    if producer and group.num_gpus_per_engine > 1 and not (model.pooled and group.worker_type.is_encoder):
        errors.append(f"{group_path}.numGpusPerEngine: {MOONCAKE_PRODUCER_TP}")
    for parallel in ("pipeline_parallel_size", "data_parallel_size"):
        size = group.overrides.get(parallel)
        if producer and isinstance(size, int) and size > 1:
            errors.append(f"{group_path}.overrides.{parallel}: ECMooncakeConnector producers run 1 (vLLM refuses more)")
    if "ec_buffer_size" in ec.config and not _positive_count(ec.config["ec_buffer_size"]):
        errors.append(f"{ec.where_top('ec_buffer_size')}: ECMooncakeConnector needs a positive whole number of bytes")
    port = ec.config.get("ec_port", MOONCAKE_DEFAULT_PORT)
    first = port if isinstance(port, int) and not isinstance(port, bool) else 0
    if not 1 <= first <= first + group.num_gpus_per_engine - 1 <= 65535:
        errors.append(
            f"{ec.where_top('ec_port')}: {port!r}: ECMooncakeConnector's control ports (one per tensor parallel "
            "rank, from ec_port on) must lie in 1-65535"
        )
    for key in MOONCAKE_SECONDS:
        if key in ec.extra and not _positive_seconds(ec.extra[key]):
            errors.append(f"{ec.where(key)}: {ec.extra[key]!r} is not a positive number of seconds")
    for key in MOONCAKE_COUNTS:
        if key in ec.extra and not _positive_count(ec.extra[key]):
            errors.append(f"{ec.where(key)}: {ec.extra[key]!r} is not a positive whole number")
    cache = ec.extra.get(CROSS_ENCODER_CACHE, False)
    if not isinstance(cache, bool):
        errors.append(f"{ec.where(CROSS_ENCODER_CACHE)}: {cache!r} is not true or false (a JSON boolean)")
    elif cache and ec.role != "ec_producer":
        errors.append(
            f"{ec.where(CROSS_ENCODER_CACHE)}: vLLM reuses encoder outputs across encoders only on an encoder-only "
            f"producer, and refuses it on {group_path} ({group.worker_type.value}, {ec.role}): set it in the encoder "
            "group's overrides.ec_transfer_config.ec_connector_extra_config instead"
        )
    elif cache and group.overrides.get("mm_processor_cache_gb") == 0:
        errors.append(
            f"{group_path}.overrides.mm_processor_cache_gb: cross_encoder_cache needs the processor cache (vLLM "
            "refuses 0): remove it"
        )
    elif cache and group.overrides.get("enable_lora"):
        errors.append(f"{group_path}.overrides.enable_lora: vLLM's cross_encoder_cache does not support LoRA")
    elif (
        cache
        and minor
        and V2_MODEL_RUNNER_ENV in known_env_vars(minor)
        and not _v2_model_runner(spec, group, group_path)
    ):
        # Before 0.34, which has no V1 runner.
        errors.append(
            f"{ec.where(CROSS_ENCODER_CACHE)}: vLLM {minor} reuses encoder outputs across encoders only with its V2 "
            f"model runner: add {V2_MODEL_RUNNER_ENV}=1 to {group_path}.env, or use vLLM 0.34 or later"
        )
    return errors


def ec_config_errors(spec: EPDDeploymentSpec, index: int, model: ModelSpec, minor: str | None) -> list[str]:
    """Every EC config of the model's groups that vLLM `minor` (None: not known) would refuse at
    start, naming the field."""
    errors = []
    for g_index, group in enumerate(model.server_groups):
        group_path = f"spec.models[{index}].serverGroups[{g_index}]"
        ec = group_ec(spec, index, model, g_index, group)
        errors += _transfer_errors(ec)
        if ec.connector == CPU_CONNECTOR:
            errors += _cpu_errors(model, ec)
        elif ec.connector == MOONCAKE_CONNECTOR:
            errors += _mooncake_errors(spec, minor, model, group, ec, group_path)
    return errors
