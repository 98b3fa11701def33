"""One focused test per rendering rule (docs/rendering.md); each fails when its rule breaks."""

from __future__ import annotations

import json
import shlex
from typing import Any

import pytest

from epd_operator.api import Placement
from epd_operator.layout import pool_ports, unit_ports
from epd_operator.render import (
    EngineCommand,
    ModelPlan,
    commands_json,
    ec_storage_path,
    engine_flags,
    format_commands,
    render,
)
from epd_operator.validation import SpecError, validate

OBJECT = {"namespace": "team-a", "name": "demo", "uid": "uid-1"}


def spec(groups: list[dict[str, Any]], version: str = "0.33", **extra: Any) -> dict[str, Any]:
    return {
        "image": f"vllm/vllm-openai:v{version}.0",
        "models": [{"name": "default", "model": "org/vlm", "serverGroups": groups}],
        **extra,
    }


def plan_of(raw: dict[str, Any], **obj: str) -> ModelPlan:
    [plan] = render(validate(raw), **{**OBJECT, **obj})
    return plan


def flag_value(cmd: EngineCommand, flag: str) -> str | None:
    """The value after `flag`, None when absent; fails when the flag appears twice."""
    assert cmd.args.count(flag) <= 1, f"{flag} appears twice in {cmd.args}"
    return cmd.args[cmd.args.index(flag) + 1] if flag in cmd.args else None


def ec_config(cmd: EngineCommand) -> dict[str, Any] | None:
    text = flag_value(cmd, "--ec-transfer-config")
    return None if text is None else json.loads(text)


def kv_config(cmd: EngineCommand) -> dict[str, Any] | None:
    text = flag_value(cmd, "--kv-transfer-config")
    return None if text is None else json.loads(text)


ENC_REG = [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1}]
ENC_PD = [
    {"workerType": "encoder", "numGpus": 1},
    {"workerType": "prefill", "numGpus": 1},
    {"workerType": "decode", "numGpus": 1},
]


def by_type(plan: ModelPlan) -> dict[str, EngineCommand]:
    return {cmd.worker_type: cmd for cmd in plan.engines}


# --------------------------------------------------------------------------- every engine


def test_every_engine_serves_the_model_on_all_interfaces_at_its_port() -> None:
    plan = plan_of(spec(ENC_PD))
    for cmd in plan.engines:
        assert cmd.args[:3] == ["vllm", "serve", "org/vlm"]
        assert flag_value(cmd, "--host") == "0.0.0.0"
        assert flag_value(cmd, "--port") == str(cmd.port)
        assert flag_value(cmd, "--served-model-name") == "org/vlm"


def test_served_model_name_from_spec() -> None:
    raw = spec(ENC_REG)
    raw["models"][0]["servedModelName"] = "actor"
    plan = plan_of(raw)
    assert plan.served_model_name == "actor"
    assert {flag_value(cmd, "--served-model-name") for cmd in plan.engines} == {"actor"}


def test_tensor_parallel_size_is_gpus_per_engine() -> None:
    plan = plan_of(
        spec([{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 4, "numGpusPerEngine": 2}])
    )
    regulars = [cmd for cmd in plan.engines if cmd.worker_type == "regular"]
    assert len(regulars) == 2
    assert [(flag_value(c, "--tensor-parallel-size"), c.gpus) for c in regulars] == [("2", 2), ("2", 2)]
    assert flag_value(plan.engines[0], "--tensor-parallel-size") == "1"


# --------------------------------------------------------------------------- layout


def test_encoders_first_ports_and_names_per_type_across_groups() -> None:
    plan = plan_of(
        spec(
            [
                {"workerType": "prefill", "numGpus": 1},
                {"workerType": "encoder", "numGpus": 1},
                {"workerType": "decode", "numGpus": 2},
                {"workerType": "encoder", "numGpus": 1},
                {"workerType": "prefill", "numGpus": 1},
            ],
            ports={"engineBase": 9000, "nixlSideChannelBase": 7000},
        )
    )
    assert [(c.container_name, c.group_index, c.engine_index, c.port, c.nixl_port) for c in plan.engines] == [
        ("encoder-0", 1, 0, 9000, None),
        ("encoder-1", 3, 1, 9001, None),
        ("prefill-0", 0, 2, 9002, 7002),
        ("decode-0", 2, 3, 9003, 7003),
        ("decode-1", 2, 4, 9004, 7004),
        ("prefill-1", 4, 5, 9005, 7005),
    ]


def test_prefill_and_decode_get_their_own_nixl_side_channel() -> None:
    plan = plan_of(spec(ENC_PD))
    for cmd in plan.engines:
        nixl = {k: v for k, v in cmd.env.items() if k.startswith("VLLM_NIXL_")}
        if cmd.worker_type in ("prefill", "decode"):
            assert nixl == {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(cmd.nixl_port),
            }
        else:
            assert nixl == {} and cmd.nixl_port is None
    assert len({c.nixl_port for c in plan.engines if c.nixl_port}) == 2


# --------------------------------------------------------------------------- EC roles


@pytest.mark.parametrize("layout", [ENC_REG, ENC_PD], ids=["encoder-regular", "encoder-prefill-decode"])
def test_ec_role_from_worker_type(layout: list[dict[str, Any]]) -> None:
    plan = plan_of(spec(layout))
    expected = {"encoder": "ec_producer", "regular": "ec_consumer", "prefill": "ec_consumer", "decode": None}
    for cmd in plan.engines:
        config = ec_config(cmd)
        role = config and config["ec_role"]
        assert role == expected[cmd.worker_type], cmd.container_name
        if config:
            assert config["ec_connector"] == "ECExampleConnector"
            assert config["ec_connector_extra_config"] == {"shared_storage_path": plan.ec_storage_path}


def test_text_only_models_get_no_ec_config() -> None:
    for layout in (
        [{"workerType": "regular", "numGpus": 2}],
        [{"workerType": "prefill", "numGpus": 1}, {"workerType": "decode", "numGpus": 1}],
    ):
        plan = plan_of(spec(layout))
        assert plan.ec_storage_path is None
        assert all(ec_config(cmd) is None for cmd in plan.engines)


def test_ec_connector_spec_fields() -> None:
    plan = plan_of(
        spec(
            ENC_REG,
            ecConnector={
                "name": "MyECConnector",  # a custom one: vLLM's registered names take no module path
                "modulePath": "my.ec",
                "storageRoot": "/mnt/ec/",
                "pathPrefix": "x-",
                "extraConfig": {"ec_enable_nixl": True, "shared_storage_path": "/elsewhere"},
            },
        )
    )
    assert plan.ec_storage_path.startswith("/mnt/ec/x-demo-default-")
    for cmd in plan.engines:
        assert ec_config(cmd) == {
            "ec_connector": "MyECConnector",
            "ec_connector_module_path": "my.ec",
            "ec_role": "ec_producer" if cmd.worker_type == "encoder" else "ec_consumer",
            # extraConfig is merged, but each model keeps its isolated path.
            "ec_connector_extra_config": {"ec_enable_nixl": True, "shared_storage_path": plan.ec_storage_path},
        }


# --------------------------------------------------------------------------- EC storage path


def test_ec_storage_path_is_isolated_per_object_and_model_and_stable() -> None:
    raw = spec(ENC_REG)
    raw["models"].append({"name": "other", "model": "org/vlm", "serverGroups": ENC_REG})
    first, second = render(validate(raw), **OBJECT)
    assert first.ec_storage_path != second.ec_storage_path
    again = render(validate(raw), **OBJECT)
    assert [p.ec_storage_path for p in again] == [first.ec_storage_path, second.ec_storage_path]
    recreated = render(validate(raw), **{**OBJECT, "uid": "uid-2"})
    assert recreated[0].ec_storage_path != first.ec_storage_path
    other_ns = render(validate(raw), **{**OBJECT, "namespace": "team-b"})
    assert other_ns[0].ec_storage_path != first.ec_storage_path


def test_ec_storage_path_is_one_readable_safe_component() -> None:
    parsed = validate(spec(ENC_REG)).spec
    path = ec_storage_path(parsed, namespace="ns", name="My.Deploy/../x" + "y" * 300, uid="u", model="default")
    root, _, leaf = path.rpartition("/")
    assert root == "/dev/shm"
    assert leaf.startswith("vime-ec-my-deploy-xyyy")
    assert set(leaf) <= set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert len(leaf) <= 8 + 48 + 9
    assert ec_storage_path(parsed, namespace="ns", name="demo", uid="u", model="default").startswith(
        "/dev/shm/vime-ec-demo-default-"
    )


# --------------------------------------------------------------------------- role defaults


@pytest.mark.parametrize(
    ("version", "caching_off"),
    [
        ("0.32", "--no-enable-prefix-caching"),
        ("0.33", "--disable-prefix-caching"),
        ("0.34", "--disable-prefix-caching"),
    ],
)
def test_encoder_defaults(version: str, caching_off: str) -> None:
    encoder = by_type(plan_of(spec(ENC_REG, version)))["encoder"]
    for flag in ("--mm-encoder-only", caching_off, "--enforce-eager"):
        assert encoder.args.count(flag) == 1, flag
    assert "--enable-scale-out" not in encoder.args


def test_consumers_enable_scale_out_and_keep_vllm_defaults() -> None:
    for layout in (ENC_REG, ENC_PD):
        for cmd in plan_of(spec(layout)).engines:
            if cmd.worker_type != "encoder":
                assert cmd.args.count("--enable-scale-out") == 1
                assert not {"--mm-encoder-only", "--enforce-eager", "--disable-prefix-caching"} & set(cmd.args)


def test_kv_transfer_for_prefill_and_decode_only() -> None:
    plan = plan_of(spec(ENC_PD, kvConnector={"name": "MooncakeConnector", "extraConfig": {"num_workers": 2}}))
    roles = {cmd.worker_type: kv_config(cmd) for cmd in plan.engines}
    assert roles == {
        "encoder": None,
        "prefill": {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"num_workers": 2},
        },
        "decode": {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"num_workers": 2},
        },
    }
    assert kv_config(by_type(plan_of(spec(ENC_REG)))["regular"]) is None
    assert kv_config(by_type(plan_of(spec(ENC_PD)))["prefill"]) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
    }


# --------------------------------------------------------------------------- overrides


def with_overrides(layout: list[dict[str, Any]], worker_type: str, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**g, "overrides": overrides} if g["workerType"] == worker_type else g for g in layout]


@pytest.mark.parametrize("version", ["0.32", "0.33", "0.34"])
def test_overrides_replace_encoder_defaults(version: str) -> None:
    layout = with_overrides(ENC_REG, "encoder", {"mm_encoder_only": False, "enable_prefix_caching": True})
    encoder = by_type(plan_of(spec(layout, version)))["encoder"]
    assert "--no-mm-encoder-only" in encoder.args and "--mm-encoder-only" not in encoder.args
    assert "--enable-prefix-caching" in encoder.args
    assert not {"--no-enable-prefix-caching", "--disable-prefix-caching"} & set(encoder.args)
    flags = [a for a in encoder.args if a.startswith("--")]
    assert len(flags) == len(set(flags))


def test_ec_transfer_config_override_is_deep_merged() -> None:
    layout = with_overrides(
        ENC_REG,
        "regular",
        {
            "ec_transfer_config": {
                "ec_role": "ec_both",
                "ec_buffer_device": "cpu",
                "ec_connector_extra_config": {"extra": 1},
            }
        },
    )
    plan = plan_of(spec(layout))
    assert ec_config(by_type(plan)["regular"]) == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_both",
        "ec_buffer_device": "cpu",
        "ec_connector_extra_config": {"extra": 1, "shared_storage_path": plan.ec_storage_path},
    }


def test_kv_transfer_config_override_is_deep_merged() -> None:
    layout = with_overrides(ENC_PD, "decode", {"kv_transfer_config": {"kv_buffer_device": "cpu"}})
    assert kv_config(by_type(plan_of(spec(layout)))["decode"]) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
    }


def test_override_null_removes_a_default_and_a_nested_key() -> None:
    layout = with_overrides(
        ENC_PD,
        "decode",
        {"enforce_eager": None, "kv_transfer_config": {"kv_connector_extra_config": {"num_workers": None}}},
    )
    decode = by_type(plan_of(spec(layout, kvConnector={"extraConfig": {"num_workers": 2, "x": 1}})))["decode"]
    assert "--enforce-eager" not in decode.args
    assert kv_config(decode)["kv_connector_extra_config"] == {"x": 1}


def test_override_in_dash_spelling_replaces_the_default() -> None:
    layout = with_overrides(ENC_REG, "encoder", {"mm-encoder-only": False})
    encoder = by_type(plan_of(spec(layout)))["encoder"]
    assert "--no-mm-encoder-only" in encoder.args and "--mm-encoder-only" not in encoder.args


def test_new_override_args_are_appended_in_a_stable_order() -> None:
    one = with_overrides(ENC_REG, "regular", {"max_num_seqs": 8, "dtype": "bfloat16", "max_model_len": 4096})
    two = with_overrides(ENC_REG, "regular", {"max_model_len": 4096, "max_num_seqs": 8, "dtype": "bfloat16"})
    regular = by_type(plan_of(spec(one)))["regular"]
    assert regular.args == by_type(plan_of(spec(two)))["regular"].args
    assert regular.args[-6:] == ["--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "8"]


@pytest.mark.parametrize(
    ("key", "field"),
    [
        ("port", "ports.engineBase"),
        ("model", "models[].model"),
        ("served-model-name", "models[].servedModelName"),
        ("tensor_parallel_size", "serverGroups[].numGpusPerEngine"),
    ],
)
def test_overriding_operator_wiring_is_rejected(key: str, field: str) -> None:
    with pytest.raises(SpecError) as error:
        plan_of(spec(with_overrides(ENC_REG, "regular", {key: 1})))
    [message] = error.value.errors
    assert message.startswith(f"spec.models[0].serverGroups[1].overrides.{key.replace('-', '_')}:")
    assert field in message


# --------------------------------------------------------------------------- flag spelling


@pytest.mark.parametrize(
    ("version", "args", "argv"),
    [
        ("0.32", {"enable_prefix_caching": False}, ["--no-enable-prefix-caching"]),
        ("0.33", {"enable_prefix_caching": False}, ["--disable-prefix-caching"]),
        ("0.33", {"disable_sliding_window": False}, ["--enable-sliding-window"]),
        ("0.32", {"disable_sliding_window": False}, ["--no-disable-sliding-window"]),
        ("0.33", {"mm_encoder_only": False, "enforce_eager": True}, ["--no-mm-encoder-only", "--enforce-eager"]),
        ("0.32", {"disable_log_stats": False, "headless": True}, ["--headless"]),
        (
            "0.33",
            {"max_model_len": 4096, "gpu_memory_utilization": 0.9},
            ["--max-model-len", "4096", "--gpu-memory-utilization", "0.9"],
        ),
        (
            "0.33",
            {"hf_overrides": {"b": [1, True], "a": {"z": None}}},
            ["--hf-overrides", '{"a":{"z":null},"b":[1,true]}'],
        ),
        ("0.33", {"allowed_media_domains": ["a.com", "b.com"]}, ["--allowed-media-domains", "a.com", "b.com"]),
        ("0.33", {"middleware": ["m1", "m2"]}, ["--middleware", "m1", "--middleware", "m2"]),
        ("0.33", {"lora_modules": [{"name": "x", "path": "/x"}]}, ["--lora-modules", '{"name":"x","path":"/x"}']),
        ("0.33", {"quantization": None, "allowed_origins": []}, []),
        ("0.34", {"enable_extensible_kv_cache": False}, ["--disable-extensible-kv-cache"]),  # new in 0.34
        ("0.34", {"shuffle_safetensors_files": False}, ["--no-shuffle-safetensors-files"]),  # new in 0.34
    ],
)
def test_engine_flags(version: str, args: dict[str, Any], argv: list[str]) -> None:
    assert engine_flags(version, args) == argv


def test_version_from_vllm_version_field_selects_the_spelling() -> None:
    plan = plan_of(spec(ENC_REG, "0.33", vllmVersion="0.32.4"))
    assert "--no-enable-prefix-caching" in by_type(plan)["encoder"].args


def test_unsupported_version_is_refused_before_rendering() -> None:
    with pytest.raises(SpecError, match="0.31 is not supported"):
        validate(spec(ENC_REG, vllmVersion="0.31.0"))


# --------------------------------------------------------------------------- router


def test_no_router_for_a_single_consumer() -> None:
    assert plan_of(spec(ENC_REG)).router is None
    assert plan_of(spec([{"workerType": "regular", "numGpus": 1}])).router is None


def test_router_for_several_regular_engines() -> None:
    plan = plan_of(
        spec(
            [{"workerType": "encoder", "numGpus": 2}, {"workerType": "regular", "numGpus": 2}],
            router={"policy": "power_of_two", "requestTimeoutSeconds": 60, "extraArgs": ["--log-level", "debug"]},
            ports={"router": 9999, "routerLoopback": 9998},
        )
    )
    router = plan.router
    # Behind the EPD proxy (on ports.router) the router serves the pod's loopback only.
    assert (router.container_name, router.port) == ("router", 9998)
    assert (plan.proxy.port, plan.proxy.upstream_port, plan.front_port) == (9999, 9998, 9999)
    assert router.args == [
        "vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        "9998",
        "--request-timeout-secs",
        "60",
        "--policy",
        "power_of_two",
        "--worker-urls",
        "http://127.0.0.1:8102",
        "http://127.0.0.1:8103",
        "--log-level",
        "debug",
    ]


def test_router_for_prefill_decode_never_lists_encoders() -> None:
    plan = plan_of(
        spec(
            [
                {"workerType": "encoder", "numGpus": 2},
                {"workerType": "prefill", "numGpus": 2},
                {"workerType": "decode", "numGpus": 1},
            ]
        )
    )
    args = plan.router.args
    assert args[args.index("--policy") :] == [
        "--policy",
        "round_robin",
        "--vllm-pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:8102",
        "--prefill",
        "http://127.0.0.1:8103",
        "--decode",
        "http://127.0.0.1:8104",
        "--kv-connector",
        "nixl",
    ]
    encoder_urls = {f"http://127.0.0.1:{c.port}" for c in plan.engines if c.worker_type == "encoder"}
    assert not encoder_urls & set(args)


def test_router_for_text_only_prefill_decode() -> None:
    plan = plan_of(spec([{"workerType": "prefill", "numGpus": 1}, {"workerType": "decode", "numGpus": 1}]))
    assert "--vllm-pd-disaggregation" in plan.router.args


def test_router_needs_a_kv_connector_it_knows() -> None:
    with pytest.raises(SpecError, match=r"spec.kvConnector.name: vllm-router coordinates"):
        plan_of(spec(ENC_PD, kvConnector={"name": "LMCacheConnectorV1"}))


# --------------------------------------------------------------------------- CLI output


def test_format_commands_one_shell_line_per_command() -> None:
    plan = plan_of(spec(ENC_PD))
    lines = format_commands([plan]).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith(
        "[default group=0 engine=0 encoder-0] VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 vllm serve org/vlm "
    )
    assert lines[1].startswith(
        "[default group=1 engine=1 prefill-0] VLLM_MEDIA_URL_ALLOW_REDIRECTS=0 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 "
        "VLLM_NIXL_SIDE_CHANNEL_PORT=5601 vllm serve"
    )
    assert lines[3].startswith("[default router] vllm-router ")
    # The part after the prefix is a shell command line: it splits back into env and argv.
    assert shlex.split(lines[0].split("] ", 1)[1])[1:] == plan.engines[0].args
    assert shlex.split(lines[1].split("] ", 1)[1])[3:] == plan.engines[1].args


def test_commands_json() -> None:
    plan = plan_of(spec(ENC_PD))
    entries = commands_json([plan])
    assert [(e["model"], e["workerType"], e["engineIndex"]) for e in entries] == [
        ("default", "encoder", 0),
        ("default", "prefill", 1),
        ("default", "decode", 2),
        ("default", "router", -1),
    ]
    assert entries[1]["args"] == plan.engines[1].args and entries[1]["env"] == plan.engines[1].env
    assert set(entries[0]) == {"model", "workerType", "engineIndex", "args", "env", "fieldEnv"}
    json.dumps(entries)


def test_user_strings_survive_the_yaml_templates_verbatim() -> None:
    tricky = 'a\'b<c>&: #d "e" {f}'
    raw = spec(
        [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 2}],
        ecConnector={"extraConfig": {tricky: tricky}},
        router={"extraArgs": ["--request-id-headers", tricky]},
    )
    raw["models"][0]["servedModelName"] = tricky
    plan = plan_of(raw)
    assert flag_value(plan.engines[0], "--served-model-name") == tricky
    assert ec_config(plan.engines[0])["ec_connector_extra_config"][tricky] == tricky
    assert plan.router.args[-2:] == ["--request-id-headers", tricky]


# Found by fuzzing: a character beyond U+FFFF became a JSON surrogate pair that YAML refuses.
@pytest.mark.parametrize("text", ["𐀀", "\x85", "\x80", "\u2028", "\ufffe", "é", "<&>'\"\\"])
def test_any_text_reaches_the_command_unchanged(text: str) -> None:
    plan = plan_of(
        spec(
            [{"workerType": "regular", "numGpus": 2, "overrides": {"chat_template": f"t{text}"}}],
            router={"extraArgs": [f"--x{text}"]},
        )
    )
    assert plan.router is not None and plan.router.args[-1] == f"--x{text}"
    assert all(flag_value(engine, "--chat-template") == f"t{text}" for engine in plan.engines)


@pytest.mark.parametrize("placement", ["Unit", "Pools"])
def test_a_plan_carries_its_models_placement_as_the_enum(placement):
    raw = spec([{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1}])
    raw["models"][0]["placement"] = placement
    plan = plan_of(raw)
    assert plan.placement is Placement(placement)
    assert plan.pooled is (placement == "Pools")


@pytest.mark.parametrize("placement", ["Unit", "Pools"])
def test_every_rendered_port_lies_in_a_block_its_pod_reserves_and_none_twice(placement):
    groups = [{"workerType": t, "numGpus": 2} for t in ("encoder", "prefill", "decode")]
    raw = spec(groups, ports={"engineBase": 9000, "nixlSideChannelBase": 7000, "ecSideChannelBase": 6000})
    raw["models"][0]["placement"] = placement
    checked = validate(raw)
    model = checked.spec.models[0]
    [plan] = render(checked, **OBJECT)
    pods = {"unit": (unit_ports(checked.spec, model), plan.unit_engines)}
    if placement == "Pools":
        pods["pool"] = (pool_ports(checked.spec, model), plan.encoders)
    for blocks, engines in pods.values():
        used = [p for e in engines for p in (e.port, e.nixl_port, e.ec_side_channel_port) if p is not None]
        assert len(used) == len(set(used))
        assert all(any(low <= p <= high for low, high in blocks.values()) for p in used), (used, blocks)


def test_without_the_proxy_the_router_takes_the_front_port_on_every_address() -> None:
    plan = plan_of(spec([{"workerType": "regular", "numGpus": 2}], proxy={"enabled": False}))
    assert plan.proxy is None and plan.router.port == 8000 and plan.front_port == 8000
    assert plan.router.args[1:5] == ["--host", "0.0.0.0", "--port", "8000"]


# --------------------------------------------------------------------------- what validation reads


def test_validation_reads_each_groups_ec_config_as_rendered() -> None:
    """ec/connectors.py checks vLLM's rules on each group's EC config as its engines get it, worked
    out from the spec: it must be what render produces, for every case and version."""
    from epd_operator.ec.connectors import group_ec

    from .cases import CASES, OBJECT, VERSIONS, raw_spec

    for version in VERSIONS:
        for case in CASES:
            checked = validate(raw_spec(case, version))
            for index, (model, plan) in enumerate(zip(checked.spec.models, render(checked, **OBJECT), strict=True)):
                for cmd in plan.engines:
                    ec = group_ec(checked.spec, index, model, cmd.group_index, model.server_groups[cmd.group_index])
                    rendered = ec_config(cmd) or {}
                    if "shared_storage_path" in rendered.get("ec_connector_extra_config", {}):
                        rendered["ec_connector_extra_config"]["shared_storage_path"] = "<the model's store>"
                    assert ec.config == rendered, (version, case, cmd.container_name)
