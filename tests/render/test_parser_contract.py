"""Contract with the REAL vLLM parser: every rendered engine command of every case is parsed by the
`vllm serve` parser of its version (0.32.0, 0.33.0, 0.34.0, each in its own venv, see
hack/epd_dev/vllm/envs.py), and vLLM must understand what the seed's rules say.
"""

from __future__ import annotations

import json
from typing import Any

from epd_dev.vllm.cli_parser import VllmParser
from epd_operator.render import engine_flags

from .cases import CASES, plans

EC_ROLE = {"encoder": "ec_producer", "regular": "ec_consumer", "prefill": "ec_consumer", "decode": None}
KV_ROLE = {"encoder": None, "regular": None, "prefill": "kv_producer", "decode": "kv_consumer"}

# What each override case's groups change, by (case, group index), in vLLM's own terms.
OVERRIDDEN: dict[tuple[str, int], dict[str, Any]] = {
    ("overrides-regular", 0): {
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.85,
        "middleware": ["a.b:m1", "a.b:m2"],
        "ec_connector_module_path": "my_connectors.ec",
    },
    ("overrides-regular", 1): {
        "mm_encoder_only": False,
        "enable_prefix_caching": True,
        "enforce_eager": False,
        "ec_buffer_device": "cpu",
        "ec_connector_module_path": "my_connectors.ec",
    },
    ("overrides-prefill-decode", 0): {"disable_log_stats": True},
    ("overrides-prefill-decode", 1): {
        "enable_prefix_caching": False,
        "max_num_batched_tokens": 8192,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"backends": ["UCX"], "num_threads": 4},
    },
    ("overrides-prefill-decode", 2): {"kv_connector_extra_config": {"backends": ["UCX"]}},
    ("overrides-prefill-decode", 3): {"kv_connector_extra_config": {"backends": ["UCX"]}},
}
# spec.proxy.media.allowedDomains, by case: vLLM's allowed_media_domains (None: any host).
MEDIA_DOMAINS = {"pools-regular": ["images.example.com", "10.0.0.5"]}
EC_EXTRA = {"overrides-regular": {"flush_interval_s": 5}}
EC_EXTRA_OVERRIDDEN = {("overrides-regular", 1): {"shm_budget": "4Gi"}}
# Placement Pools: ECCPUConnector's extra config of each group, worked out by hand. pools-regular:
# 2 encoders share 80% of the pool pod's 4Gi, 2 regular engines 80% of the unit's 8Gi.
# pools-prefill-decode: the model's connector sets 2Gi, the prefill group's overrides 1Gi.
POOLS_EC_EXTRA: dict[tuple[str, int], dict[str, Any]] = {
    ("pools-regular", 0): {"ec_cpu_bytes": 1717986918, "ec_enable_nixl": True},
    ("pools-regular", 1): {"ec_cpu_bytes": 3435973836, "ec_enable_nixl": True},
    ("pools-prefill-decode", 0): {"ec_cpu_bytes": 2147483648, "ec_enable_nixl": True, "consumer_ack_timeout_s": 30},
    ("pools-prefill-decode", 1): {"ec_cpu_bytes": "1073741824", "ec_enable_nixl": True, "consumer_ack_timeout_s": 30},
}


def _understood(result: dict[str, Any]) -> dict[str, Any]:
    """What vLLM made of a command: parsed namespace, engine args, EC and KV config, flattened."""
    engine = dict(result["engine"])
    ec, kv = engine.pop("ec_transfer_config"), engine.pop("kv_transfer_config")
    flat = {**result["namespace"], **engine, "ec_role": None, "kv_role": None}
    if ec:
        assert ec.pop("is_ec_transfer_config"), ec
        flat.update(ec)
    if kv:
        assert kv.pop("is_kv_transfer_config"), kv
        flat.update(kv)
    return flat


def _expected(case: str, plan, cmd) -> dict[str, Any]:
    encoder = cmd.worker_type == "encoder"
    ec_role = EC_ROLE[cmd.worker_type] if plan.ec_storage_path or plan.pooled else None
    want: dict[str, Any] = {
        "model": cmd.args[2],
        "served_model_name": [plan.served_model_name],
        "host": "0.0.0.0",
        "port": cmd.port,
        "tensor_parallel_size": cmd.gpus,
        "mm_encoder_only": encoder,
        "enable_prefix_caching": False if encoder else None,
        "enforce_eager": encoder,
        "enable_scale_out": not encoder,
        "ec_role": ec_role,
        "kv_role": KV_ROLE[cmd.worker_type],
        "allowed_media_domains": MEDIA_DOMAINS.get(case),
        "allowed_local_media_path": "",  # never: no file: URL is served
    }
    if ec_role and plan.pooled:
        want["ec_connector"] = want["connector_class"] = "ECCPUConnector"
        want["ec_connector_extra_config"] = POOLS_EC_EXTRA[(case, cmd.group_index)]
        want["is_ec_producer"], want["is_ec_consumer"] = encoder, not encoder
    elif ec_role:
        want["ec_connector"] = want["connector_class"] = "ECExampleConnector"
        want["ec_connector_extra_config"] = {
            **EC_EXTRA.get(case, {}),
            **EC_EXTRA_OVERRIDDEN.get((case, cmd.group_index), {}),
            "shared_storage_path": plan.ec_storage_path,
        }
    if want["kv_role"]:
        want["kv_connector"] = "NixlConnector"
        want["kv_connector_extra_config"] = {}
    want.update(OVERRIDDEN.get((case, cmd.group_index), {}))
    return want


def test_every_rendered_engine_command_means_what_the_rules_say(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    engines = {
        f"{case}/{plan.name}/{cmd.container_name}": (case, plan, cmd)
        for case in CASES
        for plan in plans(case, version)
        for cmd in plan.engines
    }
    assert {case for case, _, _ in engines.values()} == set(CASES)
    results = vllm_parser.parse({key: cmd.args for key, (_, _, cmd) in engines.items()})
    rejected = {key: r["error"] for key, r in results.items() if not r["ok"]}
    assert not rejected, f"vLLM {version} rejected rendered commands:\n" + json.dumps(rejected, indent=1)
    mismatches = {}
    for key, (case, plan, cmd) in engines.items():
        understood = _understood(results[key])
        want = _expected(case, plan, cmd)
        got = {name: understood.get(name, "<missing>") for name in want}
        if got != want:
            mismatches[key] = {n: {"want": want[n], "got": got[n]} for n in want if got[n] != want[n]}
    assert not mismatches, json.dumps(mismatches, indent=1)


def test_every_rendered_environment_variable_is_one_vllm_reads(vllm_parser: VllmParser) -> None:
    known = vllm_parser.envs()
    rendered = {
        name
        for case in CASES
        for plan in plans(case, vllm_parser.version)
        for cmd in plan.engines
        for name in [*cmd.env, *cmd.field_env]
    }
    assert {"VLLM_EC_SIDE_CHANNEL_HOST", "VLLM_EC_SIDE_CHANNEL_PORT", "VLLM_MEDIA_URL_ALLOW_REDIRECTS"} <= rendered
    # The V2 model runner is chosen where vLLM still has another (0.32, 0.33), and only there.
    assert ("VLLM_USE_V2_MODEL_RUNNER" in rendered) == ("VLLM_USE_V2_MODEL_RUNNER" in known)
    assert rendered - known == set(), f"vLLM {vllm_parser.version} reads no such variables"


def test_pools_engines_run_eccpuconnector_over_nixl_with_their_own_side_channel(vllm_parser: VllmParser) -> None:
    has_v1_runner = "VLLM_USE_V2_MODEL_RUNNER" in vllm_parser.envs()
    for case in ("pools-regular", "pools-prefill-decode"):
        (plan,) = plans(case, vllm_parser.version)
        for cmd in plan.engines:
            ec = cmd.worker_type.ec_role is not None
            # ECCPUConnector raises without the V2 runner; decode shares it to exchange KV alike.
            assert cmd.env.get("VLLM_USE_V2_MODEL_RUNNER") == ("1" if has_v1_runner else None), cmd.container_name
            if cmd.worker_type == "encoder":
                assert cmd.env["VLLM_EC_SIDE_CHANNEL_PORT"] == str(cmd.ec_side_channel_port)
                assert cmd.field_env == {"VLLM_EC_SIDE_CHANNEL_HOST": "status.podIP"}
            else:
                assert cmd.ec_side_channel_port is None and not cmd.field_env, "consumers only dial out"
            assert ("--ec-transfer-config" in cmd.args) == ec
        ports = [c.ec_side_channel_port for c in plan.encoders]
        assert len(set(ports)) == len(ports), "one side channel per encoder of a pool pod"


def test_a_wrong_ec_role_is_rejected(vllm_parser: VllmParser) -> None:
    encoder = plans("encoder-regular", vllm_parser.version)[0].engines[0]
    argv = list(encoder.args)
    at = argv.index("--ec-transfer-config") + 1
    argv[at] = json.dumps({**json.loads(argv[at]), "ec_role": "ec_bogus"})
    [result] = vllm_parser.parse({"bad": argv}).values()
    assert not result["ok"] and result["exit_code"] == 2
    assert "ec_role" in result["error"]


def test_disable_prefix_caching_exists_from_0_33_on(vllm_parser: VllmParser) -> None:
    [result] = vllm_parser.parse({"x": ["vllm", "serve", "m", "--disable-prefix-caching"]}).values()
    if vllm_parser.version == "0.32":
        assert not result["ok"] and result["exit_code"] == 2
        assert "unrecognized arguments: --disable-prefix-caching" in result["error"]
    else:
        assert result["ok"] and result["engine"]["enable_prefix_caching"] is False


BOOLEAN_KINDS = {"BooleanOptionalAction", "EnableDisableAction", "_StoreTrueAction"}


def test_every_boolean_flag_is_spelled_the_way_the_parser_reads_it(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    booleans = [a["dest"] for a in vllm_parser.actions() if a["kind"] in BOOLEAN_KINDS]
    assert {"mm_encoder_only", "enable_prefix_caching", "enforce_eager", "enable_scale_out"} <= set(booleans)
    argvs = {
        f"{dest}={value}": ["vllm", "serve", "m", *engine_flags(version, {dest: value})]
        for dest in booleans
        for value in (True, False)
    }
    results = vllm_parser.parse(argvs, full=False)
    wrong = {
        key: argvs[key][3:] if not r["ok"] else r["namespace"][key.split("=")[0]]
        for key, r in results.items()
        if not r["ok"] or r["namespace"][key.split("=")[0]] is not (key.endswith("=True"))
    }
    assert not wrong, f"vLLM {version} read these boolean spellings differently: {wrong}"


def test_every_list_flag_is_spelled_the_way_the_parser_reads_it(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    lists = [a for a in vllm_parser.actions() if a["nargs"] in ("+", "*") or a["kind"] == "_AppendAction"]
    assert {"middleware", "served_model_name"} <= {a["dest"] for a in lists}

    def sample(action: dict[str, Any]) -> list[Any]:
        if action["dest"] == "lora_modules":  # JSON objects: dicts render as JSON
            return [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}]
        return [str(c) for c in action["choices"][:2]] if action["choices"] else ["1", "2"]

    samples = {a["dest"]: sample(a) for a in lists}
    argvs = {dest: ["vllm", "serve", "m", *engine_flags(version, {dest: value})] for dest, value in samples.items()}
    results = vllm_parser.parse(argvs, full=False)
    wrong = {}
    for dest, result in results.items():
        parsed = result["namespace"][dest] if result["ok"] else None
        if dest == "lora_modules":
            good = parsed is not None and len(parsed) == 2 and "'a'" in parsed[0] and "'b'" in parsed[1]
        else:
            good = parsed is not None and [str(item) for item in parsed] == samples[dest]
        if not good:
            wrong[dest] = {"argv": argvs[dest][3:], "parsed": parsed if result["ok"] else result["error"]}
    assert not wrong, f"vLLM {version} read these list spellings differently: {wrong}"
