"""Contract with the REAL vLLM parsers for Vime's documented configs: converted, then rendered for
each supported version, every engine command is accepted and read with the tensor parallel size,
model and overrides Vime would have started it with."""

from __future__ import annotations

import json

import pytest
import yaml

from epd_dev.vllm.cli_parser import VllmParser
from epd_operator.cli import main
from epd_operator.render import render
from epd_operator.validation import validate
from tests.api.vime_examples import ACCEPTED, HF_CHECKPOINT

# What the overrides of overrides_vllm.yaml mean to vLLM.
OVERRIDDEN = {"gpu_memory_utilization": 0.85, "max_model_len": 32768, "max_num_batched_tokens": 4096}


def test_converted_vime_configs_mean_what_vime_configured(vllm_parser: VllmParser, capsys: pytest.CaptureFixture[str]):
    version = vllm_parser.version
    engines = {}
    for file, example in ACCEPTED.items():
        image = f"vllm/vllm-openai:v{version}.0"
        assert (
            main(
                ["convert", "-f", str(example.path), "--hf-checkpoint", HF_CHECKPOINT, "--image", image, *example.flags]
            )
            == 0
        ), capsys.readouterr().err
        manifest = yaml.safe_load(capsys.readouterr().out)
        for plan in render(validate(manifest["spec"]), namespace="ns", name="vime", uid="uid"):
            for cmd in plan.engines:
                engines[f"{file}/{plan.name}/{cmd.container_name}"] = (file, plan, cmd)
    results = vllm_parser.parse({key: cmd.args for key, (_, _, cmd) in engines.items()})
    rejected = {key: r["error"] for key, r in results.items() if not r["ok"]}
    assert not rejected, f"vLLM {version} rejected converted Vime configs:\n" + json.dumps(rejected, indent=1)
    wrong = {}
    for key, (file, plan, cmd) in engines.items():
        understood = {**results[key]["namespace"], **results[key]["engine"]}
        want = {
            "tensor_parallel_size": cmd.gpus,
            "model": ACCEPTED[file].paths[plan.name],
            **(OVERRIDDEN if file == "overrides_vllm.yaml" else {}),
        }
        got = {name: understood.get(name) for name in want}
        if got != want:
            wrong[key] = {"want": want, "got": got}
    assert not wrong, json.dumps(wrong, indent=1)
    # The sizes Vime documents, as vLLM reads them (the rest is in tests/api/test_convert.py).
    sizes = {key: results[key]["engine"]["tensor_parallel_size"] for key in engines if key.startswith("model_level_tp")}
    assert sizes == {
        "model_level_tp.yaml/actor/encoder-0": 2,
        **{f"model_level_tp.yaml/actor/regular-{i}": 2 for i in range(3)},
    }
