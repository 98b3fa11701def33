"""`epd-operator convert` on the seed's topologies and its invalid ones."""

from pathlib import Path

import yaml

from epd_operator.cli import main
from epd_operator.validation import validate

VIME = Path(__file__).parent / "vime"
EXAMPLES = Path(__file__).resolve().parents[2] / "docs/examples"


def test_seed_topologies_convert_to_the_documented_examples(capsys):
    for topology in ("encoder-regular", "encoder-prefill-decode"):
        assert main(["convert", "-f", str(VIME / f"{topology}.yaml"), "--model", "Qwen/Qwen2.5-VL-7B-Instruct"]) == 0
        converted = yaml.safe_load(capsys.readouterr().out)
        example = yaml.safe_load((EXAMPLES / f"{topology}.yaml").read_text())
        assert validate(converted["spec"]) == validate(example["spec"])


def test_invalid_vime_layout_fails_with_the_rule(capsys):
    assert main(["convert", "-f", str(VIME / "encoder-prefill.yaml"), "--model", "m"]) == 1
    err = capsys.readouterr().err
    assert "model 'actor': encoder+prefill is incomplete: add a decode group" in err


def test_missing_model_path_says_how_to_fix(capsys, tmp_path):
    assert main(["convert", "-f", str(VIME / "encoder-regular.yaml")]) == 1
    assert "vllm[0]: no model path: add `model:` to the entry or pass --model" in capsys.readouterr().err


def test_unknown_vime_keys_are_named(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("vllm:\n- name: a\n  model: m\n  server_groups:\n  - worker_type: regular\n    num_gpu: 1\n")
    assert main(["convert", "-f", str(bad)]) == 1
    assert "vllm[0].server_groups[0]: unknown key(s) num_gpu" in capsys.readouterr().err
