"""What vLLM refuses in an engine's EC config as it starts is refused at apply time, naming the
field (ec/connectors.py). tests/render/test_connector_contract.py shows vLLM's own classes refuse
the same configs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from epd_operator.api import EPDDeploymentSpec
from epd_operator.ec.connectors import group_ec
from epd_operator.validation import SpecError, validate

GROUP = "spec.models[0].serverGroups"


def pools(connector: dict[str, Any] | None = None, *groups: dict[str, Any], **model: Any) -> dict[str, Any]:
    """A Pools model: an encoder and a regular group, or the groups given."""
    body: dict[str, Any] = {
        "name": "actor",
        "model": "m",
        "placement": "Pools",
        "serverGroups": list(groups)
        or [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1}],
        **model,
    }
    if connector is not None:
        body["ecConnector"] = connector
    return {"image": "vllm/vllm-openai:v0.34.0", "models": [body]}


def with_overrides(spec: dict[str, Any], group: int, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["models"][0]["serverGroups"][group]["overrides"] = overrides
    return spec


def ec_override(**config: Any) -> dict[str, Any]:
    return {"ec_transfer_config": config}


def errors_of(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as error:
        validate(spec)
    return error.value.errors


def test_the_defaults_and_what_vllm_accepts_pass():
    validate(pools())
    validate(
        pools({"name": "ECMooncakeConnector", "extraConfig": {"push_wait_timeout_s": "30", "mooncake_protocol": "tcp"}})
    )
    # An encoder made ec_both keeps a role vLLM knows; a consumer's ack timeout as a string still reads as a number.
    validate(with_overrides(pools(), 0, ec_override(ec_role="ec_both")))
    validate(with_overrides(pools(), 1, ec_override(ec_connector_extra_config={"consumer_ack_timeout_s": "45"})))
    # cross_encoder_cache where vLLM takes it: on the encoder-only producers.
    validate(
        with_overrides(
            pools({"name": "ECMooncakeConnector"}),
            0,
            ec_override(ec_connector_extra_config={"cross_encoder_cache": True}),
        )
    )
    # No EC config at all for a group: nothing to check.
    validate(with_overrides(pools(), 1, {"ec_transfer_config": None}))


@pytest.mark.parametrize(
    ("role", "message"),
    [
        ("ec_bogus", f"{GROUP}[1].overrides.ec_transfer_config.ec_role: 'ec_bogus' is not an EC role vLLM knows"),
        (
            None,
            f"{GROUP}[1].overrides.ec_transfer_config.ec_role: the EC connector ECCPUConnector would run without an ec_role",
        ),
    ],
)
def test_an_ec_role_vllm_refuses(role, message):
    [error] = errors_of(with_overrides(pools(), 1, ec_override(ec_role=role)))
    assert error.startswith(message)


def test_a_connector_added_to_a_group_without_a_role_is_refused():
    spec = {
        "image": "vllm/vllm-openai:v0.34.0",
        "models": [
            {
                "name": "actor",
                "model": "m",
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 1},
                    {"workerType": "prefill", "numGpus": 1},
                    {"workerType": "decode", "numGpus": 1, "overrides": ec_override(ec_connector="ECExampleConnector")},
                ],
            }
        ],
    }
    [error] = errors_of(spec)
    assert error.startswith(
        f"{GROUP}[2].overrides.ec_transfer_config.ec_connector: the EC connector ECExampleConnector"
    )


def test_eccpuconnector_without_its_region_is_refused():
    deleted = with_overrides(pools(), 1, ec_override(ec_connector_extra_config={"ec_cpu_bytes": None}))
    assert errors_of(deleted) == [
        (
            f"{GROUP}[1].overrides.ec_transfer_config.ec_connector_extra_config.ec_cpu_bytes: ECCPUConnector needs "
            "ec_cpu_bytes (the engine's region in /dev/shm) and vLLM refuses to start without it: leave it out of the "
            "overrides (the operator sizes it) or set a byte count"
        )
    ]
    dropped = with_overrides(pools(), 0, ec_override(ec_connector_extra_config=None))
    assert [e.split(":")[0] for e in errors_of(dropped)] == [
        f"{GROUP}[0].overrides.ec_transfer_config.ec_connector_extra_config",  # ec_cpu_bytes gone
        f"{GROUP}[0].overrides.ec_transfer_config.ec_connector_extra_config",  # ec_enable_nixl gone
    ]


@pytest.mark.parametrize("value", [False, "false", "0", None])
def test_a_pools_group_without_nixl_is_refused(value):
    spec = with_overrides(pools(), 1, ec_override(ec_connector_extra_config={"ec_enable_nixl": value}))
    assert errors_of(spec) == [
        (
            f"{GROUP}[1].overrides.ec_transfer_config.ec_connector_extra_config.ec_enable_nixl: without NIXL "
            "ECCPUConnector reads only its own pod's region, and a Pools model's encoders run in other pods: remove it"
        )
    ]


def test_an_ack_timeout_vllm_cannot_read_is_refused_where_it_was_set():
    model_level = pools({"extraConfig": {"consumer_ack_timeout_s": "half a minute"}})
    errors = errors_of(model_level)
    assert (
        errors
        == [
            (
                "spec.models[0].ecConnector.extraConfig.consumer_ack_timeout_s: 'half a minute' is not a number of seconds: "
                "vLLM reads it with float()"
            )
        ]
        * 2
    )  # both groups' engines read it
    group_level = with_overrides(pools(), 0, ec_override(ec_connector_extra_config={"consumer_ack_timeout_s": [30]}))
    assert errors_of(group_level) == [
        (
            f"{GROUP}[0].overrides.ec_transfer_config.ec_connector_extra_config.consumer_ack_timeout_s: [30] is not a "
            "number of seconds: vLLM reads it with float()"
        )
    ]


MOONCAKE = {"name": "ECMooncakeConnector"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"push_wait_timeout_s": 0}, "push_wait_timeout_s: 0 is not a positive number of seconds"),
        ({"control_timeout_s": "soon"}, "control_timeout_s: 'soon' is not a positive number of seconds"),
        ({"store_max_pending_items": 2.5}, "store_max_pending_items: 2.5 is not a positive whole number"),
        ({"store_read_buffer_bytes": True}, "store_read_buffer_bytes: True is not a positive whole number"),
        ({"cross_encoder_cache": "true"}, "cross_encoder_cache: 'true' is not true or false (a JSON boolean)"),
    ],
)
def test_mooncake_numbers_and_switches_vllm_refuses(extra, message):
    errors = errors_of(pools({**MOONCAKE, "extraConfig": extra}))
    assert errors and all(e == f"spec.models[0].ecConnector.extraConfig.{message}" for e in errors)


def test_mooncake_cross_encoder_cache_only_on_encoder_only_producers():
    errors = errors_of(pools({**MOONCAKE, "extraConfig": {"cross_encoder_cache": True}}))
    assert errors == [
        (
            "spec.models[0].ecConnector.extraConfig.cross_encoder_cache: vLLM reuses encoder outputs across encoders "
            f"only on an encoder-only producer, and refuses it on {GROUP}[1] (regular, ec_consumer): set it in the "
            "encoder group's overrides.ec_transfer_config.ec_connector_extra_config instead"
        )
    ]
    on_encoder = ec_override(ec_connector_extra_config={"cross_encoder_cache": True})
    both = with_overrides(pools(MOONCAKE), 0, {**on_encoder, "mm_processor_cache_gb": 0})
    assert errors_of(both) == [
        (
            f"{GROUP}[0].overrides.mm_processor_cache_gb: cross_encoder_cache needs the processor cache (vLLM refuses 0): "
            "remove it"
        )
    ]


def test_mooncake_producers_run_one_rank():
    # A Unit model's encoders (the Pools ones: the placement rule, tests/api/test_validation.py).
    unit = {
        "image": "vllm/vllm-openai:v0.34.0",
        "ecConnector": MOONCAKE,
        "models": [
            {
                "name": "actor",
                "model": "m",
                "serverGroups": [
                    {"workerType": "encoder", "numGpus": 2, "numGpusPerEngine": 2},
                    {"workerType": "regular", "numGpus": 1},
                ],
            }
        ],
    }
    assert errors_of(unit) == [
        (
            f"{GROUP}[0].numGpusPerEngine: ECMooncakeConnector producers run tensor_parallel_size 1 (vLLM refuses more): "
            "use 1"
        )
    ]
    dp = with_overrides(pools(MOONCAKE), 0, {"data_parallel_size": 2})
    assert errors_of(dp) == [
        f"{GROUP}[0].overrides.data_parallel_size: ECMooncakeConnector producers run 1 (vLLM refuses more)"
    ]
    port = with_overrides(pools(MOONCAKE), 1, ec_override(ec_port=70000))
    assert errors_of(port) == [
        (
            f"{GROUP}[1].overrides.ec_transfer_config.ec_port: 70000: ECMooncakeConnector's control ports (one per tensor "
            "parallel rank, from ec_port on) must lie in 1-65535"
        )
    ]


def test_the_effective_config_is_the_rendered_one_with_the_overrides_merged():
    spec = EPDDeploymentSpec.model_validate(
        with_overrides(
            pools(), 1, ec_override(ec_role="ec_both", ec_connector_extra_config={"consumer_ack_timeout_s": 9})
        )
    )
    model = spec.models[0]
    ec = group_ec(spec, 0, model, 1, model.server_groups[1])
    assert (ec.connector, ec.role) == ("ECCPUConnector", "ec_both")
    # 80% of the default 16Gi /dev/shm for the unit's one EC engine.
    assert ec.extra == {"ec_cpu_bytes": 13743895347, "ec_enable_nixl": True, "consumer_ack_timeout_s": 9}


def test_mooncake_cross_encoder_cache_before_034_needs_the_v2_runner():
    cache = ec_override(ec_connector_extra_config={"cross_encoder_cache": True})
    spec = with_overrides(pools(MOONCAKE), 0, cache)
    spec["image"] = "vllm/vllm-openai:v0.33.0"
    assert errors_of(spec) == [
        (
            f"{GROUP}[0].overrides.ec_transfer_config.ec_connector_extra_config.cross_encoder_cache: vLLM 0.33 reuses "
            f"encoder outputs across encoders only with its V2 model runner: add VLLM_USE_V2_MODEL_RUNNER=1 to "
            f"{GROUP}[0].env, or use vLLM 0.34 or later"
        )
    ]
    spec["models"][0]["serverGroups"][0]["env"] = [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]
    validate(spec)
