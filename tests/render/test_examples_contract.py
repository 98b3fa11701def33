"""The documented examples (docs/examples/*.yaml, the README's) as `epd-operator render -o json`
prints them, for every supported minor (the example's own image, or spec.vllmVersion), read by
that minor's REAL parser: every engine command is accepted, and its EC and KV configs are vLLM's
config classes with the connector its factory loads."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from epd_dev.vllm.cli_parser import VllmParser
from epd_dev.vllm.minor import documented_manifests
from epd_operator.cli import main
from epd_operator.validation import validate, vllm_minor

EXAMPLES = documented_manifests()


def rendered(manifest: dict, tmp_path, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    path = tmp_path / "epd.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert main(["render", "-f", str(path), "-o", "json"]) == 0, capsys.readouterr().err
    commands: list[dict] = json.loads(capsys.readouterr().out)
    return commands


def test_the_examples_cover_every_placement_and_topology():
    specs = [m["spec"] for m in EXAMPLES.values()]
    assert any(model.get("placement") == "Pools" for spec in specs for model in spec["models"])
    types = {g["workerType"] for spec in specs for model in spec["models"] for g in model["serverGroups"]}
    assert types == {"encoder", "regular", "prefill", "decode"}
    assert any(key.startswith("README.md") for key in EXAMPLES)


def test_every_example_renders_commands_the_parser_accepts(
    vllm_parser: VllmParser, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    version = vllm_parser.version
    engines = {}
    for name, example in EXAMPLES.items():
        manifest = copy.deepcopy(example)
        if vllm_minor(validate(manifest["spec"]).spec) != version:
            manifest["spec"]["vllmVersion"] = version
        for n, command in enumerate(rendered(manifest, tmp_path, capsys)):
            if command["workerType"] != "router":
                engines[f"{name}/{command['model']}/{n}"] = command
    results = vllm_parser.parse({key: command["args"] for key, command in engines.items()})
    rejected = {key: r["error"] for key, r in results.items() if not r["ok"]}
    assert not rejected, f"vLLM {version} rejected example commands:\n" + json.dumps(rejected, indent=1)
    ec_engines = 0
    for key, result in results.items():
        ec, kv = result["engine"]["ec_transfer_config"], result["engine"]["kv_transfer_config"]
        if ec:
            ec_engines += 1
            assert ec["is_ec_transfer_config"] and ec["connector_class"] == ec["ec_connector"], (key, ec)
        if kv:
            assert kv["is_kv_transfer_config"], (key, kv)
    pools = [
        r["engine"]["ec_transfer_config"] for k, r in results.items() if k.startswith("docs/examples/encoder-pools")
    ]
    assert pools and all(ec["ec_connector"] == "ECCPUConnector" for ec in pools)
    assert all(ec["ec_connector_extra_config"]["ec_enable_nixl"] is True for ec in pools)
    assert ec_engines > len(pools)
