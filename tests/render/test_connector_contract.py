"""Contract with vLLM's own EC connector classes (parser venvs from 0.34 on): what the operator
renders for placement Pools starts them as the engine would, and every config validation refuses
(ec/connectors.py) is one vLLM refuses too.

ECCPUConnector's scheduler side is constructed for real: its /dev/shm region of the rendered
`ec_cpu_bytes`, its NIXL agent, the encoder's ZMQ side channel at the rendered variables (the pod
IP is 127.0.0.1 here, the port a free one). ECMooncakeConnector's config class reads its config;
its transfer engine (Mooncake, RDMA) is not installed. The model's config is a stand-in (see
hack/epd_dev/vllm/parse_with_vllm.py): the real one needs the model's files.
"""

from __future__ import annotations

import copy
import json
import socket
from typing import Any

import pytest

from epd_dev.vllm.cli_parser import VllmParser
from epd_operator.api import EPDDeploymentSpec
from epd_operator.render import EngineCommand, render
from epd_operator.validation import CheckedSpec, SpecError, validate

from .cases import OBJECT

MODEL = "Qwen/Qwen2.5-VL-3B-Instruct"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pools(groups: list[dict[str, Any]], version: str, **model: Any) -> dict[str, Any]:
    # Small /dev/shm: the regions are real mmaps, filled at start.
    return {
        "image": f"vllm/vllm-openai:v{version}.0",
        "shm": {"sizeLimit": "32Mi"},
        "models": [
            {
                "name": "default",
                "model": MODEL,
                "placement": "Pools",
                "encoderPool": {"shm": {"sizeLimit": "16Mi"}},
                "serverGroups": groups,
                **model,
            }
        ],
    }


ENCODER_REGULAR = [{"workerType": "encoder", "numGpus": 2}, {"workerType": "regular", "numGpus": 2}]
ENCODER_PD = [
    {"workerType": "encoder", "numGpus": 1},
    {
        "workerType": "prefill",
        "numGpus": 1,
        "overrides": {"ec_transfer_config": {"ec_connector_extra_config": {"ec_cpu_bytes": "4194304"}}},
    },
    {"workerType": "decode", "numGpus": 1},
]
MOONCAKE = {"name": "ECMooncakeConnector", "extraConfig": {"push_wait_timeout_s": "30", "mooncake_protocol": "tcp"}}


def started_as(cmd: EngineCommand) -> dict[str, str]:
    """The engine's environment in its pod: the pod IP is loopback here, a side channel a free port."""
    env = dict(cmd.env)
    for name in cmd.field_env:
        env[name] = "127.0.0.1"  # status.podIP
    if "VLLM_EC_SIDE_CHANNEL_PORT" in env:
        env["VLLM_EC_SIDE_CHANNEL_PORT"] = str(_free_port())
    return env


def ec_engines(plans: list[Any]) -> list[EngineCommand]:
    return [cmd for plan in plans for cmd in plan.engines if "--ec-transfer-config" in cmd.args]


@pytest.mark.parametrize(
    ("groups", "model"),
    [(ENCODER_REGULAR, {}), (ENCODER_PD, {"ecConnector": {"extraConfig": {"consumer_ack_timeout_s": 30}}})],
    ids=["encoder-regular", "encoder-prefill-decode"],
)
def test_pools_engines_start_their_eccpuconnector(connector_parser: VllmParser, groups, model) -> None:
    engines = ec_engines(render(validate(pools(groups, connector_parser.version, **model)), **OBJECT))
    assert {cmd.worker_type.is_encoder for cmd in engines} == {True, False}  # producers and consumers
    answers = {cmd.container_name: connector_parser.ec_connector(cmd.args, started_as(cmd)) for cmd in engines}
    assert all(
        a == {"ok": True, "checked": "ECCPUConnector's scheduler side", "error": ""} for a in answers.values()
    ), json.dumps(answers, indent=1)


def test_pools_engines_on_mooncake_pass_its_config_class(connector_parser: VllmParser) -> None:
    spec = pools(ENCODER_PD, connector_parser.version, ecConnector=MOONCAKE)
    spec["models"][0]["serverGroups"][0]["overrides"] = {
        "ec_transfer_config": {"ec_connector_extra_config": {"cross_encoder_cache": True}}
    }
    engines = ec_engines(render(validate(spec), **OBJECT))
    answers = {cmd.container_name: connector_parser.ec_connector(cmd.args, started_as(cmd)) for cmd in engines}
    assert set(answers) == {"encoder-0", "prefill-0"}
    assert all(a == {"ok": True, "checked": "MooncakeECConfig", "error": ""} for a in answers.values()), answers


def _with(spec: dict[str, Any], group: int, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    spec["models"][0]["serverGroups"][group]["overrides"] = overrides
    return spec


def _ec(**config: Any) -> dict[str, Any]:
    return {"ec_transfer_config": config}


def _extra(**extra: Any) -> dict[str, Any]:
    return _ec(ec_connector_extra_config=extra)


# name -> (spec for a version, the group vLLM refuses, the field validation names, what vLLM says)
REFUSED = {
    "role-bogus": (
        lambda v: _with(pools(ENCODER_REGULAR, v), 1, _ec(ec_role="ec_bogus")),
        1,
        "overrides.ec_transfer_config.ec_role",
        "ec_role",
    ),
    "role-dropped": (
        lambda v: _with(pools(ENCODER_REGULAR, v), 1, _ec(ec_role=None)),
        1,
        "overrides.ec_transfer_config.ec_role",
        "Please specify ec_role",
    ),
    "cpu-bytes-dropped": (
        lambda v: _with(pools(ENCODER_REGULAR, v), 1, _extra(ec_cpu_bytes=None)),
        1,
        "overrides.ec_transfer_config.ec_connector_extra_config.ec_cpu_bytes",
        "ec_cpu_bytes must be specified",
    ),
    "ack-timeout-no-number": (
        lambda v: _with(pools(ENCODER_REGULAR, v), 1, _extra(consumer_ack_timeout_s="half a minute")),
        1,
        "overrides.ec_transfer_config.ec_connector_extra_config.consumer_ack_timeout_s",
        "could not convert string to float",
    ),
    "mooncake-encoder-tensor-parallel": (
        lambda v: pools(
            [{"workerType": "encoder", "numGpus": 2, "numGpusPerEngine": 2}, {"workerType": "regular", "numGpus": 1}],
            v,
            ecConnector=MOONCAKE,
        ),
        0,
        "model 'default': ECMooncakeConnector's producers",
        "producers require tensor_parallel_size=1",
    ),
    "mooncake-encoder-data-parallel": (
        lambda v: _with(pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE), 0, {"data_parallel_size": 2}),
        0,
        "overrides.data_parallel_size",
        "producers require data_parallel_size=1",
    ),
    "mooncake-cache-on-consumers": (
        lambda v: pools(
            ENCODER_REGULAR,
            v,
            ecConnector={"name": "ECMooncakeConnector", "extraConfig": {"cross_encoder_cache": True}},
        ),
        1,
        "ecConnector.extraConfig.cross_encoder_cache",
        "cross_encoder_cache requires an Encoder-only producer",
    ),
    "mooncake-cache-not-a-boolean": (
        lambda v: _with(pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE), 0, _extra(cross_encoder_cache="true")),
        0,
        "overrides.ec_transfer_config.ec_connector_extra_config.cross_encoder_cache",
        "cross_encoder_cache must be a boolean",
    ),
    "mooncake-cache-without-processor-cache": (
        lambda v: _with(
            pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE),
            0,
            {**_extra(cross_encoder_cache=True), "mm_processor_cache_gb": 0},
        ),
        0,
        "overrides.mm_processor_cache_gb",
        "cross_encoder_cache requires mm_processor_cache_gb > 0",
    ),
    "mooncake-timeout-zero": (
        lambda v: _with(pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE), 1, _extra(push_wait_timeout_s=0)),
        1,
        "overrides.ec_transfer_config.ec_connector_extra_config.push_wait_timeout_s",
        "requires push_wait_timeout_s > 0",
    ),
    "mooncake-count-fraction": (
        lambda v: _with(pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE), 1, _extra(store_max_pending_items=2.5)),
        1,
        "overrides.ec_transfer_config.ec_connector_extra_config.store_max_pending_items",
        "store_max_pending_items to be a positive integer",
    ),
    "mooncake-port-out-of-range": (
        lambda v: _with(pools(ENCODER_REGULAR, v, ecConnector=MOONCAKE), 1, _ec(ec_port=70000)),
        1,
        "overrides.ec_transfer_config.ec_port",
        "ec_port must be in 1..65535",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_validation_refuses_the_connector_refuses(connector_parser: VllmParser, case: str) -> None:
    make, group, field, vllm_says = REFUSED[case]
    raw = make(connector_parser.version)
    with pytest.raises(SpecError) as refused:
        validate(raw)
    assert any(field in error for error in refused.value.errors), refused.value.errors
    # Rendered all the same, as an operator without the rule would have.
    plans = render(CheckedSpec(EPDDeploymentSpec.model_validate(raw), connector_parser.version), **OBJECT)
    engines = [cmd for cmd in ec_engines(plans) if cmd.group_index == group]
    assert engines
    for cmd in engines:
        answer = connector_parser.ec_connector(cmd.args, started_as(cmd))
        assert not answer["ok"] and vllm_says in answer["error"], (cmd.container_name, answer)
