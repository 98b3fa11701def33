"""`epd-operator render` as people call it, on the documented examples."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from epd_dataplane.cli import build_parser as dataplane_parser
from epd_operator.cli import build_parser

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "encoder-prefill-decode.yaml"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epd_operator.cli", "render", *args], capture_output=True, text=True, check=False
    )


def test_render_prints_one_line_per_engine_and_router():
    out = run("-f", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split("]")[0] + "]" for line in lines] == [
        "[default group=0 engine=0 encoder-0]",
        "[default group=1 engine=1 prefill-0]",
        "[default group=2 engine=2 decode-0]",
        "[default router]",
    ]
    assert "--mm-encoder-only" in lines[0] and "--disable-prefix-caching" in lines[0]  # the image is v0.34


def test_render_json_has_the_documented_keys():
    out = run("-f", str(EXAMPLE), "-o", "json")
    entries = json.loads(out.stdout)
    assert [e["workerType"] for e in entries] == ["encoder", "prefill", "decode", "router"]
    assert all(set(e) == {"model", "workerType", "engineIndex", "args", "env", "fieldEnv"} for e in entries)
    assert entries[1]["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"


def test_render_refuses_an_invalid_manifest_naming_the_rule(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("workerType: decode", "workerType: encoder"))
    out = run("-f", str(bad))
    assert out.returncode == 1
    assert "model 'default': encoder+prefill is incomplete: add a decode group" in out.stderr


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize(
    ("program", "parser", "expected"),
    [
        ("epd-operator", build_parser, {"run", "render", "convert", "crds", "janitor"}),
        ("epd-dataplane", dataplane_parser, {"proxy", "gateway"}),
    ],
)
def test_every_subcommand_says_what_it_does_and_every_option_what_it_means(program, parser, expected):
    subcommands = _subcommands(parser())
    assert set(subcommands) == expected
    for name, subparser in subcommands.items():
        assert subparser.description and len(subparser.description) > 80, f"`{program} {name}` has no description"
        undocumented = [
            action.option_strings[0]
            for action in subparser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help
        ]
        assert undocumented == [], f"`{program} {name}` options without help: {undocumented}"


def test_the_top_level_help_speaks_to_users():
    out = subprocess.run(
        [sys.executable, "-m", "epd_operator.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "EPDDeployment" in out and "epd-operator render -f" in out and "Helm chart" in out
    for name in _subcommands(build_parser()):
        assert f"    {name} " in out
