"""`epd-operator convert` on Vime's documented configs: the engines Vime would start, the notes on
what the EPDDeployment cannot carry, and the refusals."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from epd_operator.cli import main
from epd_operator.convert import UPDATE_WEIGHTS_ANNOTATION, vime_to_manifest
from epd_operator.render import render
from epd_operator.validation import SpecError, validate

from .vime_examples import ACCEPTED, HF_CHECKPOINT, REFUSED, VIME

EXAMPLES = Path(__file__).resolve().parents[2] / "docs/examples"


def convert(capsys: pytest.CaptureFixture[str], path: Path | str, *flags: str) -> tuple[int, Any, str]:
    """(exit code, the manifest printed, stderr) of `epd-operator convert`."""
    code = main(["convert", "-f", str(path), *flags])
    out, err = capsys.readouterr()
    return code, yaml.safe_load(out) if out else None, err


def write(tmp_path: Path, vime: dict[str, Any]) -> Path:
    path = tmp_path / "vime.yaml"
    path.write_text(yaml.safe_dump(vime))
    return path


def rendered_engines(manifest: dict[str, Any]) -> dict[str, list[tuple[str, int, int]]]:
    """Per model: (worker type, engines, --tensor-parallel-size) per group, from the rendered argv."""
    plans = render(validate(manifest["spec"]), namespace="ns", name="vime", uid="uid")
    engines: dict[str, list[tuple[str, int, int]]] = {}
    for plan in plans:
        groups = Counter(
            (e.group_index, e.worker_type, e.args[e.args.index("--tensor-parallel-size") + 1]) for e in plan.engines
        )
        engines[plan.name] = [(kind, count, int(tp)) for (_, kind, tp), count in sorted(groups.items())]
    return engines


# --------------------------------------------------------------------------- Vime's documented configs


@pytest.mark.parametrize("example", ACCEPTED.values(), ids=list(ACCEPTED))
def test_vimes_documented_configs_render_the_engines_vime_starts(capsys, example) -> None:
    code, manifest, err = convert(capsys, example.path, "--hf-checkpoint", HF_CHECKPOINT, *example.flags)
    assert code == 0, err
    assert rendered_engines(manifest) == example.engines
    assert {m["name"]: m["model"] for m in manifest["spec"]["models"]} == example.paths
    annotations = manifest["metadata"].get("annotations", {})
    assert annotations.get(UPDATE_WEIGHTS_ANNOTATION, "").split(",") == example.update_weights


def test_a_model_level_num_gpus_per_engine_sizes_every_group_without_one(capsys) -> None:
    # The issue: 2 encoders and 6 regular engines at TP 1 instead of 1 and 3 at TP 2, silently.
    code, manifest, err = convert(capsys, VIME / "model_level_tp.yaml", "--hf-checkpoint", "m")
    assert code == 0, err
    assert [g["numGpusPerEngine"] for g in manifest["spec"]["models"][0]["serverGroups"]] == [2, 2]
    assert rendered_engines(manifest) == {"actor": [("encoder", 1, 2), ("regular", 3, 2)]}
    assert (
        "note: vllm[0] (actor): 1 encoder engine at TP 2 + 3 regular engines at TP 2 = 8 GPUs in each "
        "EPD unit (one pod on one node)"
    ) in err.splitlines()


def test_gpus_per_engine_resolve_group_then_model_then_the_global_default(tmp_path, capsys) -> None:
    vime = {
        "vllm": [
            {
                "name": "a",
                "num_gpus_per_engine": 4,
                "server_groups": [
                    {"worker_type": "prefill", "num_gpus": 2, "num_gpus_per_engine": 1},
                    {"worker_type": "decode", "num_gpus": 8},
                ],
            },
            {"name": "b", "server_groups": [{"worker_type": "regular", "num_gpus": 6}]},
        ]
    }
    code, manifest, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m", "--num-gpus-per-engine", "3")
    assert code == 0, err
    assert rendered_engines(manifest) == {"a": [("prefill", 2, 1), ("decode", 2, 4)], "b": [("regular", 2, 3)]}


def test_engine_groups_is_server_groups(capsys) -> None:
    flags = ("--hf-checkpoint", HF_CHECKPOINT)
    assert (
        convert(capsys, VIME / "engine_groups.yaml", *flags)[1] == convert(capsys, VIME / "docstring.yaml", *flags)[1]
    )


def test_both_server_groups_and_engine_groups_are_refused(tmp_path, capsys) -> None:
    groups = [{"worker_type": "regular", "num_gpus": 1}]
    vime = {"vllm": [{"name": "a", "server_groups": groups, "engine_groups": groups}]}
    code, _, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 1
    assert "vllm[0]: both server_groups and engine_groups (its older name): keep server_groups" in err


def test_placeholder_groups_are_dropped_saying_why(capsys) -> None:
    code, manifest, err = convert(capsys, VIME / "placeholder.yaml", "--hf-checkpoint", "m")
    assert code == 0, err
    assert [g["workerType"] for g in manifest["spec"]["models"][0]["serverGroups"]] == ["regular"]
    assert (
        "note: vllm[0].server_groups[1]: placeholder group dropped: in Vime it reserves 2 GPUs for co-located "
        "training, which has no meaning for an EPDDeployment (its pods run engines only)"
    ) in err.splitlines()


def test_a_model_of_placeholders_only_is_dropped_and_nothing_left_is_an_error(tmp_path, capsys) -> None:
    placeholder = {"name": "spare", "server_groups": [{"worker_type": "placeholder", "num_gpus": 2}]}
    serving = {"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 1}]}
    code, manifest, err = convert(capsys, write(tmp_path, {"vllm": [placeholder, serving]}), "--hf-checkpoint", "m")
    assert code == 0, err
    assert [m["name"] for m in manifest["spec"]["models"]] == ["a"]
    assert "note: vllm[0] (spare): only placeholder groups: no engines, so no model in the EPDDeployment" in err
    code, _, err = convert(capsys, write(tmp_path, {"vllm": [placeholder]}), "--hf-checkpoint", "m")
    assert code == 1
    assert "vllm: no model has an engine to run (only placeholder groups)" in err


def test_update_weights_is_inferred_as_vime_does_and_kept_in_an_annotation(tmp_path, capsys) -> None:
    regular = [{"worker_type": "regular", "num_gpus": 1}]
    vime = {
        "vllm": [
            {"name": "actor", "server_groups": regular},  # the --hf-checkpoint model: true
            {"name": "same", "model_path": "/ckpt", "server_groups": regular},  # is --hf-checkpoint: true
            {"name": "ref", "model_path": "/ref", "server_groups": regular},  # differs: false, with a note
            {"name": "frozen", "update_weights": False, "server_groups": regular},
            {"name": "forced", "model_path": "/ref", "update_weights": True, "server_groups": regular},
        ]
    }
    code, manifest, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "/ckpt")
    assert code == 0, err
    assert manifest["metadata"]["annotations"] == {UPDATE_WEIGHTS_ANNOTATION: "actor,same,forced"}
    assert (
        "note: vllm[2] (ref).update_weights: not set, so false: its model path /ref is not --hf-checkpoint "
        "(set it to say so)"
    ) in err.splitlines()
    assert f"the annotation {UPDATE_WEIGHTS_ANNOTATION} for the trainer's own sync" in err


def test_no_model_taking_weights_means_no_annotation() -> None:
    vime = {
        "vllm": [{"name": "ref", "model_path": "/ref", "server_groups": [{"worker_type": "regular", "num_gpus": 1}]}]
    }
    conversion = vime_to_manifest(vime, name="x", image="vllm/vllm-openai:v0.33.0")
    assert "annotations" not in conversion.manifest["metadata"]
    assert not any(note.startswith("update_weights:") for note in conversion.notes)


def test_a_groups_overrides_model_path_is_the_model_path_and_must_agree(tmp_path, capsys) -> None:
    vime = {
        "vllm": [
            {
                "name": "a",
                "model_path": "/model",
                "server_groups": [
                    {
                        "worker_type": "prefill",
                        "num_gpus": 1,
                        "overrides": {"model_path": "/group", "max_model_len": 4096},
                    },
                    {"worker_type": "decode", "num_gpus": 1, "overrides": {"model-path": "/group"}},
                ],
            }
        ]
    }
    code, manifest, err = convert(capsys, write(tmp_path, vime))
    assert code == 0, err
    [model] = manifest["spec"]["models"]
    assert model["model"] == "/group"
    assert [g.get("overrides") for g in model["serverGroups"]] == [{"max_model_len": 4096}, None]
    del vime["vllm"][0]["server_groups"][1]["overrides"]  # decode serves /model: two paths
    code, _, err = convert(capsys, write(tmp_path, vime))
    assert code == 1
    assert (
        "vllm[0]: its groups use different model paths (/group, /model): Vime requires one per model: "
        "put each path in a model of its own"
    ) in err


def test_vimes_disaggregation_overrides_are_dropped_with_a_note(tmp_path, capsys) -> None:
    vime = {
        "vllm": [
            {
                "name": "a",
                "server_groups": [
                    {"worker_type": "prefill", "num_gpus": 1, "overrides": {"disaggregation_mode": "prefill"}},
                    {"worker_type": "decode", "num_gpus": 1},
                ],
            }
        ]
    }
    code, manifest, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 0, err
    assert "overrides" not in manifest["spec"]["models"][0]["serverGroups"][0]
    assert (
        "note: vllm[0].server_groups[0].overrides.disaggregation_mode: dropped: Vime skips it too; the operator "
        "sets each engine's role"
    ) in err.splitlines()


def test_keys_outside_the_vllm_section_are_reported(tmp_path, capsys) -> None:
    vime = {"vllm": [{"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 1}]}], "sglang": []}
    code, _, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 0, err
    assert "note: sglang: ignored: only the `vllm:` section describes engines" in err.splitlines()


def test_seed_topologies_convert_to_the_documented_examples(capsys) -> None:
    for topology in ("encoder-regular", "encoder-prefill-decode"):
        code, converted, err = convert(capsys, VIME / f"{topology}.yaml", "--model", "Qwen/Qwen2.5-VL-7B-Instruct")
        assert code == 0, err
        example = yaml.safe_load((EXAMPLES / f"{topology}.yaml").read_text())
        assert validate(converted["spec"]) == validate(example["spec"])


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("file", REFUSED)
@pytest.mark.parametrize("version", ["0.32", "0.33", "0.34"])
def test_sglang_override_names_are_refused_with_vllms_name(capsys, file, version) -> None:
    code, manifest, err = convert(
        capsys, VIME / file, "--hf-checkpoint", "m", "--image", f"vllm/vllm-openai:v{version}.0"
    )
    assert (code, manifest) == (1, None)
    assert err.startswith("error: invalid Vime config:\n")
    for path, name in REFUSED[file]:
        assert f"  - {path}: not an engine argument of vLLM {version} (SGLang's name): did you mean `{name}`?" in err


def test_an_override_misspelt_names_the_closest_arguments(tmp_path, capsys) -> None:
    vime = {
        "vllm": [
            {
                "name": "a",
                "server_groups": [
                    {"worker_type": "regular", "num_gpus": 1, "overrides": {"gpu_memory_utilisation": 0.8}}
                ],
            }
        ]
    }
    code, _, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 1
    assert (
        "vllm[0].server_groups[0].overrides.gpu_memory_utilisation: not an engine argument of vLLM 0.34: "
        "did you mean `gpu_memory_utilization`?"
    ) in err


@pytest.mark.parametrize(
    ("key", "instead"),
    [
        ("tensor_parallel_size", "set num_gpus_per_engine instead"),
        ("tensor-parallel-size", "set num_gpus_per_engine instead"),
        ("model", "set model_path instead"),
        ("port", "remove it"),
    ],
)
def test_an_override_the_operator_sets_is_refused(tmp_path, capsys, key, instead) -> None:
    vime = {
        "vllm": [{"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 1, "overrides": {key: 2}}]}]
    }
    code, _, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 1
    assert f"vllm[0].server_groups[0].overrides.{key}: the operator sets it (spec." in err
    assert err.rstrip().endswith(instead)


def test_num_gpus_must_hold_whole_engines_of_the_resolved_size(tmp_path, capsys) -> None:
    vime = {
        "vllm": [{"name": "a", "num_gpus_per_engine": 4, "server_groups": [{"worker_type": "regular", "num_gpus": 6}]}]
    }
    code, _, err = convert(capsys, write(tmp_path, vime), "--hf-checkpoint", "m")
    assert code == 1
    assert (
        "vllm[0].server_groups[0].num_gpus: 6 is not a multiple of 4 GPUs per engine (from the model's "
        "num_gpus_per_engine): a unit runs whole engines"
    ) in err


def test_invalid_vime_layout_fails_with_the_rule(capsys) -> None:
    code, _, err = convert(capsys, VIME / "encoder-prefill.yaml", "--model", "m")
    assert code == 1
    assert "model 'actor': encoder+prefill is incomplete: add a decode group" in err


def test_missing_model_path_says_how_to_fix(capsys) -> None:
    code, _, err = convert(capsys, VIME / "encoder-regular.yaml")
    assert code == 1
    assert "vllm[0]: no model path: set model_path, or pass --hf-checkpoint (as to Vime)" in err


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"name": "a", "num_gpu_per_engine": 2},
            "vllm[0].num_gpu_per_engine: not a field of Vime's vllm config: did you mean num_gpus_per_engine?",
        ),
        ({"name": "a", "model": "/m"}, "vllm[0].model: not a field of Vime's vllm config: did you mean model_path?"),
        (
            {"server_groups": [{"worker_type": "regular", "num_gpu": 1}]},
            "vllm[0].server_groups[0].num_gpu: not a field of Vime's vllm config: did you mean num_gpus?",
        ),
        (
            {"server_groups": [{"worker_type": "encode", "num_gpus": 1}]},
            "vllm[0].server_groups[0].worker_type: 'encode' is not one of encoder, regular, prefill, decode, placeholder",
        ),
        (
            {"server_groups": [{"worker_type": "regular", "num_gpus": 0}]},
            "vllm[0].server_groups[0].num_gpus: expected a GPU count (1 or more), got 0",
        ),
        ({"name": "a", "server_groups": []}, "vllm[0].server_groups: expected a non-empty list of server groups"),
    ],
)
def test_vime_config_mistakes_are_named(tmp_path, capsys, entry, message) -> None:
    entry = {"name": "a", "server_groups": [{"worker_type": "regular", "num_gpus": 1}], **entry}
    code, _, err = convert(capsys, write(tmp_path, {"vllm": [entry]}), "--hf-checkpoint", "m")
    assert code == 1
    assert f"  - {message}\n" in err


def test_an_entry_without_a_name_is_refused_as_vime_does() -> None:
    with pytest.raises(SpecError) as error:
        vime_to_manifest(
            {"vllm": [{"server_groups": [{"worker_type": "regular", "num_gpus": 1}]}]},
            name="x",
            image="vllm/vllm-openai:v0.33.0",
            hf_checkpoint="m",
        )
    assert error.value.errors == ["vllm[0].name: required: the model's name (Vime's key for its router)"]
