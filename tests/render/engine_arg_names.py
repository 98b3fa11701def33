"""Write each supported vLLM version's engine argument names, read from its REAL `vllm serve`
parser, to operator/epd_operator/templates/vllm-<minor>/engine_args.txt (`make engine-args`).

    python -m tests.render.engine_arg_names

`accepted_names` is the one rule that turns the parser's actions into the list; the drift test
(tests/render/test_engine_args_contract.py) applies it again and compares with the files.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from epd_dev.vllm import envs

from .cases import VERSIONS
from .vllm_parser import VllmParser

TEMPLATES = Path(__file__).resolve().parents[2] / "operator" / "epd_operator" / "templates"


def accepted_names(actions: Iterable[dict[str, Any]]) -> list[str]:
    """The dest names an override may use, sorted.

    An override `foo_bar` renders as `--foo-bar`, so a name counts when its own action answers to
    that spelling. Short aliases (-tp) and alternative spellings (--no-x, 0.33's --disable-x) are
    not names of their own: one key per argument keeps each flag single. `--help` is no argument.
    """
    return sorted(
        a["dest"] for a in actions if a["kind"] != "_HelpAction" and "--" + a["dest"].replace("_", "-") in a["options"]
    )


def data_file(version: str) -> Path:
    return TEMPLATES / f"vllm-{version}" / "engine_args.txt"


def file_text(version: str, names: list[str]) -> str:
    header = (
        f"# Engine arguments (argparse dest names) that vLLM {version}'s `vllm serve` parser accepts.\n"
        "# Generated from the real parser by `make engine-args` (tests/render/engine_arg_names.py):\n"
        "# do not edit; tests/render/test_engine_args_contract.py fails when it drifts.\n"
    )
    return header + "".join(f"{name}\n" for name in names)


def main() -> None:
    parsers = {version: VllmParser(version, envs.parser_python(version)) for version in VERSIONS}
    try:
        for version, parser in parsers.items():
            names = accepted_names(parser.actions())
            data_file(version).write_text(file_text(version, names))
            print(f"{data_file(version)}: {len(names)} engine arguments")
    finally:
        for parser in parsers.values():
            parser.close()


if __name__ == "__main__":
    main()
