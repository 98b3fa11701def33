"""Contract with the REAL vLLM parsers (0.32.0, 0.33.0; tests/vllm/envs.py): the engine argument
names shipped for each version are exactly the ones its `vllm serve` accepts, and what validation
refuses, vLLM refuses too. Regenerate the lists with `make engine-args`."""

from __future__ import annotations

from epd_operator.engine_args import SGLANG_EQUIVALENTS, known_engine_args, override_errors
from epd_operator.render import engine_flags

from .engine_arg_names import accepted_names, data_file, file_text
from .vllm_parser import VllmParser


def test_the_shipped_names_are_the_parsers(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    names = accepted_names(vllm_parser.actions())
    shipped = known_engine_args(version)
    assert shipped == set(names), (
        f"{data_file(version)} drifted from vLLM {version}'s parser: missing {sorted(set(names) - shipped)}, "
        f"extra {sorted(shipped - set(names))}: run `make engine-args`"
    )
    assert data_file(version).read_text() == file_text(version, names), "run `make engine-args`"


def test_what_validation_refuses_vllm_refuses(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    refused = [*SGLANG_EQUIVALENTS, "max_modle_len", "disable_prefix_caching_typo"]
    assert all(override_errors(version, {key: 1}, "o") for key in refused)
    argvs = {key: ["vllm", "serve", "m", *engine_flags(version, {key: "1"})] for key in refused}
    results = vllm_parser.parse(argvs, full=False)
    accepted = {key: r for key, r in results.items() if r["ok"] or "unrecognized arguments" not in r["error"]}
    assert accepted == {}
