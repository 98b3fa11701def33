"""The seed's layout rules and field checks, in Python (the CEL twin is tested on the cluster)."""

import itertools

import pytest

from epd_operator.validation import LAYOUT_RULES, Limits, SpecError, validate, vllm_minor

TYPES = ("encoder", "regular", "prefill", "decode")
VALID_LAYOUTS = [{"encoder", "regular"}, {"encoder", "prefill", "decode"}, {"regular"}, {"prefill", "decode"}]


def spec_with(*types, **extra):
    groups = [{"workerType": t, "numGpus": 1} for t in types]
    return {
        "image": "vllm/vllm-openai:v0.33.0",
        "models": [{"name": "actor", "model": "m", "serverGroups": groups}],
        **extra,
    }


def all_layouts():
    for size in range(1, 5):
        yield from itertools.combinations_with_replacement(TYPES, size)


@pytest.mark.parametrize("types", list(all_layouts()), ids="+".join)
def test_every_layout_of_one_to_four_groups_matches_the_seed(types):
    valid = set(types) in VALID_LAYOUTS
    if valid:
        validate(spec_with(*types))
    else:
        with pytest.raises(SpecError) as error:
            validate(spec_with(*types))
        assert all(m.startswith("model 'actor': ") for m in error.value.errors)


@pytest.mark.parametrize(
    ("types", "message"),
    [
        (("encoder", "prefill"), "model 'actor': encoder+prefill is incomplete: add a decode group"),
        (("encoder", "decode"), "model 'actor': encoder+decode is incomplete: add a prefill group"),
        (("encoder",), "model 'actor': an encoder group alone serves nothing"),
        (("regular", "prefill", "decode"), "model 'actor': regular cannot be mixed with prefill or decode"),
        (("prefill",), "model 'actor': prefill without decode: add a decode group"),
        (("decode",), "model 'actor': decode without prefill: add a prefill group"),
    ],
)
def test_invalid_layouts_say_how_to_fix_them(types, message):
    with pytest.raises(SpecError) as error:
        validate(spec_with(*types))
    assert any(m.startswith(message) for m in error.value.errors), error.value.errors


def test_every_rule_is_reachable():
    fired = set()
    for types in all_layouts():
        fired |= {r.message for r in LAYOUT_RULES if r.violated_by(set(types))}
    assert fired == {r.message for r in LAYOUT_RULES}


def test_field_errors_name_the_field():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["numGpus"] = 0
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert error.value.errors == ["spec.models[0].serverGroups[1].numGpus: Input should be greater than or equal to 1"]


def test_num_gpus_must_be_a_multiple_of_gpus_per_engine():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1].update(numGpus=3, numGpusPerEngine=2)
    with pytest.raises(
        SpecError, match=r"serverGroups\[1\]: numGpus \(3\) must be a multiple of numGpusPerEngine \(2\)"
    ):
        validate(spec)


def test_unknown_fields_are_rejected_but_override_values_stay_open():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][0]["overrides"] = {"hf_overrides": {"nested": True}}
    assert validate(spec).spec.models[0].server_groups[0].overrides == {"hf_overrides": {"nested": True}}
    spec["models"][0]["servergroups"] = []
    with pytest.raises(SpecError, match=r"spec.models\[0\].servergroups: Extra inputs are not permitted"):
        validate(spec)


def test_model_names_are_unique_dns_labels():
    spec = spec_with("regular")
    spec["models"].append(dict(spec["models"][0]))
    with pytest.raises(SpecError, match="used twice"):
        validate(spec)
    spec = spec_with("regular")
    spec["models"][0]["name"] = "Actor_1"
    with pytest.raises(SpecError, match=r"spec.models\[0\].name: 'Actor_1' is not a DNS-1123 label"):
        validate(spec)


def test_host_path_volumes_are_refused():
    spec = spec_with("regular", volumes=[{"name": "cache", "hostPath": {"path": "/data"}}])
    with pytest.raises(SpecError, match="hostPath"):
        validate(spec)


def test_all_errors_are_reported_at_once():
    spec = spec_with("encoder", image="vllm/vllm-openai:latest")
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert len(error.value.errors) == 2


@pytest.mark.parametrize(
    ("image", "version", "minor"),
    [
        ("vllm/vllm-openai:v0.33.0", None, "0.33"),
        ("registry.example.com:5000/vllm/vllm-openai:v0.32.1", None, "0.32"),
        ("vllm/vllm-openai:0.32.0-cu129", None, "0.32"),
        ("vllm/vllm-openai:latest", "0.33.1", "0.33"),
        ("vllm/vllm-openai@sha256:abc", "v0.32", "0.32"),
        ("vllm/vllm-openai:v0.34.0", None, "0.34"),
        ("vllm/vllm-openai:v0.33.0", "0.34.1", "0.34"),  # the field wins over the tag
    ],
)
def test_vllm_version_from_field_or_image_tag(image, version, minor):
    checked = validate(spec_with("regular", image=image, vllmVersion=version))
    assert checked.vllm_minor == vllm_minor(checked.spec) == minor


@pytest.mark.parametrize(
    ("image", "version", "message"),
    [
        ("vllm/vllm-openai:latest", None, "spec.image: cannot tell the vLLM version from 'latest'"),
        ("vllm/vllm-openai", None, "spec.image: cannot tell the vLLM version"),
        ("vllm/vllm-openai:v0.31.0", None, "spec.image: vLLM 0.31 is not supported: use one of 0.32, 0.33, 0.34"),
        (
            "vllm/vllm-openai:latest",
            "0.35.0",
            "spec.vllmVersion: vLLM 0.35 is not supported: use one of 0.32, 0.33, 0.34",
        ),
        ("vllm/vllm-openai:v0.35.0", None, "spec.image: vLLM 0.35 is not supported"),
    ],
)
def test_unsupported_versions_are_errors_not_guesses(image, version, message):
    with pytest.raises(SpecError) as error:
        validate(spec_with("regular", image=image, vllmVersion=version))
    assert error.value.errors[0].startswith(message)


@pytest.mark.parametrize("size", ["100m", "-1Gi", "16 GiB"])
def test_shm_size_must_be_bytes(size):
    with pytest.raises(SpecError) as error:
        validate(spec_with("encoder", "regular", shm={"sizeLimit": size}))
    assert error.value.errors == [f"spec.shm.sizeLimit: {size!r} is not a byte quantity such as 16Gi, 512Mi or 1e9"]


@pytest.mark.parametrize("value", [1, 3, "1%", "25%", "100%"])
def test_max_unavailable_accepts_counts_and_percentages(value):
    assert validate(spec_with("encoder", "regular", maxUnavailable=value)).spec.max_unavailable == value


@pytest.mark.parametrize("kind", ["NodePort", "LoadBalancer"])
def test_a_headless_front_service_must_be_a_cluster_ip_one(kind):
    assert validate(spec_with("encoder", "regular", service={"headless": True})).spec.service.headless
    with pytest.raises(SpecError) as error:
        validate(spec_with("encoder", "regular", service={"type": kind, "headless": True}))
    assert error.value.errors == [
        (
            "spec.service.headless: a headless Service has no virtual IP, which a NodePort or LoadBalancer Service "
            f"needs: set spec.service.type to ClusterIP, or headless to false (type is {kind})"
        )
    ]


@pytest.mark.parametrize("value", [0, -1, "0%", "101%", "25", "1.5%"])
def test_max_unavailable_refuses_what_could_not_roll_or_drain(value):
    with pytest.raises(SpecError, match=r"spec.maxUnavailable: .* is not a unit count of 1 or more"):
        validate(spec_with("encoder", "regular", maxUnavailable=value))


# --------------------------------------------------------------------------- placement Pools

POOLS_CASES = {
    # name: (model changes, message that must be among the errors, or None when valid)
    "pools": ({"placement": "Pools"}, None),
    "pools-cpu": ({"placement": "Pools", "ecConnector": {"name": "ECCPUConnector"}}, None),
    "pools-example": (
        {"placement": "Pools", "ecConnector": {"name": "ECExampleConnector"}},
        (
            "model 'actor': placement Pools cannot use ECExampleConnector: it exchanges embeddings as files in a "
            "node-local /dev/shm, which cannot span nodes; use ECCPUConnector"
        ),
    ),
    "unit-connector": (
        {"ecConnector": {"name": "ECCPUConnector"}},
        "model 'actor': ecConnector is for placement Pools: a Unit model uses spec.ecConnector",
    ),
    "pools-mooncake": ({"placement": "Pools", "ecConnector": {"name": "ECMooncakeConnector"}}, None),
    "pools-mooncake-tensor-parallel-encoder": (
        {
            "placement": "Pools",
            "ecConnector": {"name": "ECMooncakeConnector"},
            "serverGroups": [
                {"workerType": "encoder", "numGpus": 2, "numGpusPerEngine": 2},
                {"workerType": "regular", "numGpus": 1},
            ],
        },
        "model 'actor': ECMooncakeConnector's producers (the encoder groups) run tensor_parallel_size 1",
    ),
    "pools-text-only": (
        {"placement": "Pools", "serverGroups": [{"workerType": "regular", "numGpus": 1}]},
        "model 'actor': placement Pools needs an encoder group",
    ),
}


def pools_spec(changes: dict) -> dict:
    spec = spec_with("encoder", "regular")
    spec["models"][0].update(changes)
    return spec


@pytest.mark.parametrize("case", POOLS_CASES)
def test_placement_rules(case):
    changes, message = POOLS_CASES[case]
    if message is None:
        validate(pools_spec(changes))
        return
    with pytest.raises(SpecError) as error:
        validate(pools_spec(changes))
    assert any(m.startswith(message) for m in error.value.errors), error.value.errors


def test_every_placement_rule_is_reachable():
    from epd_operator.validation import PLACEMENT_RULES

    fired = set()
    for changes, _message in POOLS_CASES.values():
        try:
            validate(pools_spec(changes))
        except SpecError as error:
            fired |= {r.message for r in PLACEMENT_RULES for m in error.errors if r.message in m}
    assert fired == {r.message for r in PLACEMENT_RULES}


def test_placement_defaults_to_unit_and_pools_to_eccpuconnector():
    unit = validate(spec_with("encoder", "regular")).spec.models[0]
    assert unit.placement == "Unit" and not unit.pooled and unit.encoder_replicas == 1
    pools = validate(pools_spec({"placement": "Pools"})).spec.models[0]
    assert pools.pooled and pools.pools_connector.name == "ECCPUConnector"


def test_eccpuconnector_regions_must_fit_in_their_pods_shm():
    # Two encoders of 8Gi each in a pool pod whose /dev/shm is 16Gi: 80% of it is 12.8Gi.
    spec = pools_spec({"placement": "Pools", "ecConnector": {"extraConfig": {"ec_cpu_bytes": 8 * 2**30}}})
    spec["models"][0]["serverGroups"][0]["numGpus"] = 2
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert error.value.errors == [
        (
            "spec.models[0]: the ECCPUConnector regions of an encoder pool pod of model 'actor' take 16.0Gi of /dev/shm "
            "(2 engines), more than 80% of its sizeLimit 16Gi (12.8Gi; vLLM needs the rest): lower ec_cpu_bytes or "
            "raise spec.models[0].encoderPool.shm.sizeLimit"
        )
    ]
    spec["models"][0]["encoderPool"] = {"shm": {"sizeLimit": "24Gi"}}
    validate(spec)  # the pool's own /dev/shm: the units keep spec.shm
    # A group's overrides win over the model's connector, and are checked against the unit's /dev/shm.
    spec["models"][0]["serverGroups"][1]["overrides"] = {
        "ec_transfer_config": {"ec_connector_extra_config": {"ec_cpu_bytes": 14 * 2**30}}
    }
    with pytest.raises(SpecError, match="regions of a unit of model 'actor' take 14.0Gi.*raise spec.shm.sizeLimit"):
        validate(spec)


@pytest.mark.parametrize("value", ["8Gi", -1, 0, True, 1.5])
def test_ec_cpu_bytes_must_be_what_vllm_can_read(value):
    spec = pools_spec({"placement": "Pools", "ecConnector": {"extraConfig": {"ec_cpu_bytes": value}}})
    with pytest.raises(SpecError, match="is not a positive whole number of bytes: vLLM reads it with int"):
        validate(spec)


def test_pools_refuses_eccpuconnector_without_nixl():
    spec = pools_spec({"placement": "Pools", "ecConnector": {"extraConfig": {"ec_enable_nixl": False}}})
    with pytest.raises(SpecError, match=r"ecConnector.extraConfig.ec_enable_nixl: without NIXL ECCPUConnector"):
        validate(spec)


def test_a_model_cannot_take_the_name_of_another_models_encoder_pool():
    spec = pools_spec({"placement": "Pools"})
    spec["models"].append(
        {"name": "actor-encoders", "model": "m", "serverGroups": [{"workerType": "regular", "numGpus": 1}]}
    )
    with pytest.raises(SpecError, match="whose encoder pool is named like model 'actor-encoders': rename one"):
        validate(spec)


def test_pool_pods_and_units_are_checked_for_ports_separately():
    # The pool's side channels would overlap its second encoder's HTTP port; the unit has none.
    spec = pools_spec({"placement": "Pools"}) | {"ports": {"ecSideChannelBase": 8101}}
    spec["models"][0]["serverGroups"][0]["numGpus"] = 2
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert error.value.errors == [
        (
            "spec.ports.engineBase: model 'actor' would use ports 8100-8101 for ports.engineBase and 8101-8102 "
            "for ports.ecSideChannelBase: move one range"
        )
    ]
    # Consumers start at engineBase in their own pod, so a Unit's janitor port is no concern either.
    validate(pools_spec({"placement": "Pools"}) | {"ports": {"engineBase": 9400}})


def test_a_tiny_shm_leaves_no_room_for_a_region():
    spec = pools_spec({"placement": "Pools", "encoderPool": {"shm": {"sizeLimit": "1Mi"}}})
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert error.value.errors == [
        (
            "spec.models[0]: an ECCPUConnector region of an encoder pool pod of model 'actor' would be 838860 bytes, "
            "below 1Mi: too small for any image embedding; raise spec.models[0].encoderPool.shm.sizeLimit or set "
            "ec_cpu_bytes"
        )
    ]


def test_overrides_are_read_in_one_spelling_and_two_spellings_of_one_argument_are_refused():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["overrides"] = {"max-num-seqs": 8, "enforce_eager": True}
    group = validate(spec).spec.models[0].server_groups[1]
    assert group.overrides == {"max_num_seqs": 8, "enforce_eager": True}  # everything after reads this

    spec["models"][0]["serverGroups"][1]["overrides"] = {"max-num-seqs": 8, "max_num_seqs": 16}
    with pytest.raises(SpecError) as error:
        validate(spec)
    assert error.value.errors == [
        "spec.models[0].serverGroups[1].overrides: 'max-num-seqs' and 'max_num_seqs' both set max_num_seqs: keep one"
    ]


# --------------------------------------------------------------------------- bounds and owned arguments


def refusals(spec, **kwargs) -> list[str]:
    try:
        validate(spec, **kwargs)
    except SpecError as error:
        return error.errors
    return []


@pytest.mark.parametrize("name", ["qwen2.5-vl", "7b-vl", "Qwen", "a" * 64, "vl-"])
def test_a_name_no_child_could_carry_is_refused_naming_the_longest_allowed(name):
    (message,) = refusals(spec_with("encoder", "regular"), name=name)
    assert message.startswith(f"metadata.name: {name!r} is not a DNS-1035 label of at most 63 characters")
    assert refusals(spec_with("encoder", "regular"), name="a" * 63) == []


def test_more_engines_than_one_epddeployment_may_have_are_refused():
    groups = [{"workerType": "encoder", "numGpus": 8}, {"workerType": "regular", "numGpus": 8}]
    spec = {"image": "vllm/vllm-openai:v0.33.0", "replicas": 1}
    spec["models"] = [{"name": f"m{i}", "model": "m", "serverGroups": groups} for i in range(16)]
    assert refusals(spec) == []  # 16 models x 16 engines: the most allowed
    spec["models"][0]["serverGroups"] = [*groups, {"workerType": "regular", "numGpus": 1}]
    assert refusals(spec) == [
        (
            "spec.models: 257 engines in all, more than the 256 one EPDDeployment may have: lower numGpus, "
            "raise numGpusPerEngine, or split the models over several EPDDeployments"
        )
    ]


def test_a_pod_with_more_gpus_than_the_operator_allows_is_refused():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["numGpus"] = 64
    (message,) = refusals(spec)
    assert message.startswith(
        "spec.models[0].serverGroups: a unit of model 'actor' would need 65 GPUs, more than the 64"
    )
    assert refusals(spec, limits=Limits(max_gpus_per_pod=128)) == []
    spec["models"][0]["placement"] = "Pools"  # the encoder moves to its pool: 64 GPUs a unit
    assert refusals(spec) == []


@pytest.mark.parametrize(
    ("override", "start"),
    [
        ({"host": "0.0.0.0"}, ".host: set by the operator"),
        ({"api_key": "sk-1"}, ".api_key: a secret must not be an argument"),
        ({"hf_token": "hf_x"}, ".hf_token: a secret must not be an argument"),
        ({"allowed_media_domains": ["a.example"]}, ".allowed_media_domains: set by the operator from spec.proxy.media"),
        ({"allowed-local-media-path": "/data"}, ".allowed_local_media_path: refused: it lets any client"),
        ({"allowed_origins": ["*", "--port", "9999"]}, ".allowed_origins: '--port' starts with '-'"),
        ({"chat_template": "-x"}, ".chat_template: '-x' starts with '-'"),
        ({"runner": "pooling"}, ".runner: 'pooling' would make a pooling engine"),
        ({"convert": "embed"}, ".convert: 'embed' would make a pooling engine"),
        (
            {"ec_transfer_config": {"ec_connector_extra_config": {"shared_storage_path": "/dev/shm/other"}}},
            ".ec_transfer_config.ec_connector_extra_config.shared_storage_path: set by the operator",
        ),
    ],
)
def test_overrides_cannot_set_what_the_operator_owns_secrets_or_flags(override, start):
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][0]["overrides"] = override
    (message,) = refusals(spec)
    assert message.startswith("spec.models[0].serverGroups[0].overrides" + start), message


def test_engines_made_to_generate_explicitly_are_accepted():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["overrides"] = {"runner": "generate", "convert": "none"}
    assert refusals(spec) == []
    spec["models"][0]["serverGroups"][1]["overrides"] = {"runner": None, "convert": "auto"}
    assert refusals(spec) == []


def test_the_seed_keeps_group_overrides_above_the_rendered_ec_role():
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["overrides"] = {"ec_transfer_config": {"ec_role": "ec_both"}}
    assert refusals(spec) == []


@pytest.mark.parametrize(("arg", "says"), [("--host", "is set by the operator"), ("--api-key=x", "secret")])
def test_router_extra_args_cannot_repeat_the_operators_or_carry_a_secret(arg, says):
    (message,) = refusals(spec_with("encoder", "regular", router={"extraArgs": [arg]}))
    assert message.startswith("spec.router.extraArgs[0]: ") and says in message


@pytest.mark.parametrize("size", ["1e999999999", "99E", "18446744073709551616"])
def test_shm_sizes_beyond_what_kubernetes_holds_are_refused(size):
    assert refusals(spec_with("encoder", "regular", shm={"sizeLimit": size})) != []


def test_lists_and_maps_are_bounded():
    env = [{"name": f"V{i}", "value": "x"} for i in range(65)]
    assert refusals(spec_with("encoder", "regular", env=env)) == [
        "spec.env: List should have at most 64 items after validation, not 65"
    ]
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][1]["resources"] = {"limits": {"memory": "1e999999999"}}
    assert refusals(spec)[0].startswith("spec.models[0].serverGroups[1].resources.limits.memory")


def test_one_prime_attempt_must_fit_in_the_priming_with_its_retries():
    (message,) = refusals(spec_with("encoder", "regular", proxy={"primeAttemptTimeoutSeconds": 601}))
    assert message.startswith(
        "spec.proxy.primeAttemptTimeoutSeconds: 601 s is longer than primeTimeoutSeconds (600 s): one prime attempt"
    )
    assert "lower spec.proxy.primeAttemptTimeoutSeconds or raise primeTimeoutSeconds" in message
    fits = {"primeAttemptTimeoutSeconds": 30, "primeTimeoutSeconds": 30}
    assert refusals(spec_with("encoder", "regular", proxy=fits)) == []


def test_the_drain_must_end_within_the_grace_period():
    (message,) = refusals(spec_with("encoder", "regular", termination={"gracePeriodSeconds": 30, "drainSeconds": 30}))
    assert message.startswith("spec.termination.drainSeconds: 30 s is not below gracePeriodSeconds (30 s)")
    assert refusals(spec_with("encoder", "regular", termination={"gracePeriodSeconds": 31, "drainSeconds": 30})) == []


def test_a_weights_version_needs_the_gateway_and_the_gateway_needs_the_proxy():
    versioned = spec_with("encoder", "regular")
    versioned["models"][0]["weightsVersion"] = "step-42"
    with pytest.raises(SpecError) as error:
        validate(versioned)
    (message,) = error.value.errors
    assert message.startswith("spec.models[0].weightsVersion:") and "spec.gateway.enabled" in message
    validate({**versioned, "gateway": {"enabled": True}})
    with pytest.raises(SpecError) as error:
        validate({**versioned, "gateway": {"enabled": True}, "proxy": {"enabled": False}})
    assert any(m.startswith("spec.gateway.enabled:") for m in error.value.errors)
    versioned["models"][0]["weightsVersion"] = "step 42"  # a name, not text
    with pytest.raises(SpecError) as error:
        validate({**versioned, "gateway": {"enabled": True}})
    assert any("weightsVersion" in m for m in error.value.errors)


def test_media_allowed_domains_are_hosts_as_vllm_compares_them():
    spec = spec_with("encoder", "regular")
    spec["proxy"] = {"media": {"allowedDomains": ["images.example.com", "10.0.0.5", "xn--bcher-kva.example"]}}
    assert refusals(spec) == []
    for bad in ("Images.example.com", "*.example.com", "https://images.example.com", "[::1]", "a..b"):
        spec["proxy"] = {"media": {"allowedDomains": [bad]}}
        (message,) = refusals(spec)
        assert "proxy.media.allowedDomains" in message, message
