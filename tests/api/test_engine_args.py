"""Overrides are checked against the engine arguments of the spec's vLLM version, by the validation
the operator, `render` and `convert` share (tests/render/test_engine_args_contract.py checks the
lists against the real parsers)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml

from epd_operator.engine_args import SGLANG_EQUIVALENTS, known_engine_args, override_errors
from epd_operator.validation import SUPPORTED_VLLM_VERSIONS, SpecError, validate

WHERE = "spec.models[0].serverGroups[1].overrides"


def spec_with(overrides: dict[Any, Any], version: str = "0.33") -> dict[str, Any]:
    groups = [{"workerType": "encoder", "numGpus": 1}, {"workerType": "regular", "numGpus": 1, "overrides": overrides}]
    return {"image": f"vllm/vllm-openai:v{version}.0", "models": [{"name": "m", "model": "m", "serverGroups": groups}]}


def refusals(overrides: dict[Any, Any], version: str = "0.33") -> list[str]:
    with pytest.raises(SpecError) as error:
        validate(spec_with(overrides, version))
    return error.value.errors


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_sglang_names_are_refused_naming_vllms(version: str) -> None:
    assert refusals({"mem_fraction_static": 0.85, "context_length": 32768}, version) == [
        (
            f"{WHERE}.mem_fraction_static: not an engine argument of vLLM {version} (SGLang's name): "
            "did you mean `gpu_memory_utilization`?"
        ),
        (
            f"{WHERE}.context_length: not an engine argument of vLLM {version} (SGLang's name): "
            "did you mean `max_model_len`?"
        ),
    ]


def test_an_inverted_sglang_switch_says_so() -> None:
    [message] = refusals({"disable_radix_cache": True})
    assert message.endswith("did you mean `enable_prefix_caching` (with the opposite value)?")


def test_a_misspelt_name_gets_the_closest_ones() -> None:
    assert refusals({"max_modle_len": 4096}) == [
        f"{WHERE}.max_modle_len: not an engine argument of vLLM 0.33: did you mean `max_model_len` or `max_log_len`?"
    ]


def test_a_name_like_none_says_how_to_fix() -> None:
    assert refusals({"zzz": 1}) == [
        f"{WHERE}.zzz: not an engine argument of vLLM 0.33: remove it, or use an argument `vllm serve --help` lists"
    ]


def test_null_deletes_a_default_but_only_of_a_real_argument() -> None:
    assert validate(spec_with({"enable_scale_out": None, "gpu-memory-utilization": 0.8, "ec_transfer_config": {}}))
    [message] = refusals({"enable_scale_outt": None})
    assert message.startswith(f"{WHERE}.enable_scale_outt: not an engine argument")


def test_one_argument_in_both_spellings_is_refused() -> None:
    assert refusals({"max-model-len": 1, "max_model_len": 2}) == [
        f"{WHERE}: 'max-model-len' and 'max_model_len' both set max_model_len: keep one"
    ]


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("--max-model-len", ": did you mean `max_model_len`?"),
        ("Max_Model_Len", ": did you mean `max_model_len`?"),
        ("UPPER", " such as max_model_len"),
        (7, " such as max_model_len"),
    ],
)
def test_a_key_that_is_no_name_at_all(key: Any, hint: str) -> None:
    assert override_errors("0.33", {key: 1}, WHERE) == [
        f"{WHERE}: {key!r} is not a vLLM engine argument name: use snake_case{hint}"
    ]


def test_the_spec_version_decides() -> None:
    # sleep_mode_backend is new in vLLM 0.33.
    assert validate(spec_with({"sleep_mode_backend": "x"}, "0.33"))
    [message] = refusals({"sleep_mode_backend": "x"}, "0.32")
    assert message.startswith(f"{WHERE}.sleep_mode_backend: not an engine argument of vLLM 0.32")


def test_without_a_known_version_only_the_version_is_reported() -> None:
    spec = spec_with({"mem_fraction_static": 0.85})
    spec["image"] = "vllm/vllm-openai:latest"
    with pytest.raises(SpecError) as error:
        validate(spec)
    [message] = error.value.errors
    assert message.startswith("spec.image: cannot tell the vLLM version")


def test_every_sglang_equivalent_is_an_argument_of_every_version() -> None:
    for version in SUPPORTED_VLLM_VERSIONS:
        assert set(SGLANG_EQUIVALENTS.values()) <= known_engine_args(version), version


def test_render_refuses_what_vllm_would(tmp_path) -> None:
    manifest = tmp_path / "epd.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "epd.vime.dev/v1alpha1",
                "kind": "EPDDeployment",
                "metadata": {"name": "x"},
                "spec": spec_with({"mem_fraction_static": 0.85}),
            }
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "epd_operator.cli", "render", "-f", str(manifest)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert (
        f"  - {WHERE}.mem_fraction_static: not an engine argument of vLLM 0.33 (SGLang's name): did you mean "
        "`gpu_memory_utilization`?"
    ) in out.stderr


# --------------------------------------------------------------------------- the engines' environment


def env_spec(version: str, spec_env: list[dict], group_env: list[dict] = (), **overrides: Any) -> dict[str, Any]:
    spec = spec_with(overrides, version)
    spec["env"] = spec_env
    spec["models"][0]["serverGroups"][1]["env"] = list(group_env)
    return spec


def env_refusals(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as error:
        validate(spec)
    return error.value.errors


def test_a_v1_runner_asked_of_034_is_refused_once_naming_the_field() -> None:
    runner = [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"}]
    assert env_refusals(env_spec("0.34", runner)) == [
        (
            "spec.env[0]: vLLM 0.34 has only its V2 model runner and refuses to start with VLLM_USE_V2_MODEL_RUNNER=0: "
            "remove the variable"
        )
    ]
    validate(env_spec("0.33", runner))  # 0.33 still has the V1 runner
    validate(env_spec("0.34", [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]))  # redundant: vLLM warns
    # A group's own value wins over the spec's, as in its pods: the encoder group keeps the spec's.
    overridden = env_spec("0.34", runner, [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}])
    assert len(env_refusals(overridden)) == 1
    overridden["models"][0]["serverGroups"][0]["env"] = [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]
    validate(overridden)


def test_a_variable_vllm_removed_is_refused_where_it_is_removed() -> None:
    marlin = [{"name": "VLLM_MARLIN_INPUT_DTYPE", "value": "int8"}]
    assert env_refusals(env_spec("0.34", [], marlin)) == [
        (
            "spec.models[0].serverGroups[1].env[0]: vLLM 0.34 removed VLLM_MARLIN_INPUT_DTYPE and refuses to start "
            "with it set: remove it"
        )
    ]
    validate(env_spec("0.33", [], marlin))


@pytest.mark.parametrize("version", SUPPORTED_VLLM_VERSIONS)
def test_an_unknown_vllm_variable_is_refused_only_where_the_group_makes_it_fatal(version: str) -> None:
    typo = [{"name": "VLLM_LOGGIN_LEVEL", "value": "DEBUG"}, {"name": "HF_HOME", "value": "/cache"}]
    validate(env_spec(version, typo))  # vLLM warns
    assert env_refusals(env_spec(version, typo, **{"fail-on-environ-validation": True})) == [
        (
            f"spec.env[0]: vLLM {version} does not read VLLM_LOGGIN_LEVEL, and the group's "
            "overrides.fail_on_environ_validation makes that fatal at start: did you mean VLLM_LOGGING_LEVEL? Else "
            "remove it, or drop fail_on_environ_validation"
        )
    ]
