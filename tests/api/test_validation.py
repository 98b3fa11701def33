"""The seed's layout rules and field checks, in Python (the CEL twin is tested on the cluster)."""

import itertools

import pytest

from epd_operator.validation import LAYOUT_RULES, SpecError, validate, vllm_minor

TYPES = ("encoder", "regular", "prefill", "decode")
VALID_LAYOUTS = [{"encoder", "regular"}, {"encoder", "prefill", "decode"}, {"regular"}, {"prefill", "decode"}]


def spec_with(*types, **extra):
    groups = [{"workerType": t, "numGpus": 1} for t in types]
    return {"image": "vllm/vllm-openai:v0.33.0", "models": [{"name": "actor", "model": "m", "serverGroups": groups}], **extra}


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
    with pytest.raises(SpecError, match=r"serverGroups\[1\]: numGpus \(3\) must be a multiple of numGpusPerEngine \(2\)"):
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
        ("vllm/vllm-openai:v0.31.0", None, "spec.image: vLLM 0.31 is not supported: use one of 0.32, 0.33"),
        ("vllm/vllm-openai:latest", "0.34.0", "spec.vllmVersion: vLLM 0.34 is not supported"),
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


@pytest.mark.parametrize("value", [0, -1, "0%", "101%", "25", "1.5%"])
def test_max_unavailable_refuses_what_could_not_roll_or_drain(value):
    with pytest.raises(SpecError, match=r"spec.maxUnavailable: .* is not a unit count of 1 or more"):
        validate(spec_with("encoder", "regular", maxUnavailable=value))
