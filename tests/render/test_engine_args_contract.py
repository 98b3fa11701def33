"""Contract with the REAL vLLM parsers (hack/epd_dev/vllm/envs.py): the files each minor's support
is generated into (`make vllm-minor`) are exactly what its package says, byte for byte, so that
`make vllm-minor V=<minor>` on a clean tree changes nothing; and what validation refuses, vLLM
refuses too."""

from __future__ import annotations

from epd_dev.vllm.cli_parser import VllmParser
from epd_dev.vllm.minor import HAND_WRITTEN_FLAGS, accepted_names, flag_tables, generated_files, template_dir
from epd_operator.engine_args import (
    SGLANG_EQUIVALENTS,
    V2_MODEL_RUNNER_ENV,
    environ_errors,
    known_engine_args,
    known_env_vars,
    override_errors,
    removed_env_vars,
)
from epd_operator.render import engine_flags, flag_spelling


def test_the_shipped_names_are_the_parsers(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    names = accepted_names(vllm_parser.actions())
    shipped = known_engine_args(version)
    assert shipped == set(names), (
        f"vLLM {version}'s engine_args.txt drifted from its parser: missing {sorted(set(names) - shipped)}, "
        f"extra {sorted(shipped - set(names))}: run `make vllm-minor V={version}`"
    )
    assert known_env_vars(version) == vllm_parser.envs()
    assert removed_env_vars(version) == vllm_parser.removed_envs()


def test_make_vllm_minor_would_write_the_committed_files(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    files = generated_files(version, vllm_parser.actions(), vllm_parser.envs(), vllm_parser.removed_envs())
    expected = {"engine_args.txt", "env_vars.txt"} | ({"flags.yaml"} if version not in HAND_WRITTEN_FLAGS else set())
    expected |= {"removed_env_vars.txt"} if vllm_parser.removed_envs() else set()
    assert {path.name for path in files} == expected
    differ = [path.name for path, text in files.items() if not path.is_file() or path.read_text() != text]
    assert not differ, f"{template_dir(version)}: {differ} differ from the parser's: run `make vllm-minor V={version}`"


def test_the_flag_tables_are_the_parsers(vllm_parser: VllmParser) -> None:
    """The hand-written flags.yaml files included: their tables are what the generator finds."""
    tables, shipped = flag_tables(vllm_parser.actions()), flag_spelling(vllm_parser.version)
    assert (tables.negated_prefixes, set(tables.store_true), set(tables.append)) == (
        shipped.negated_prefixes,
        shipped.store_true,
        shipped.append,
    )


def test_what_validation_refuses_vllm_refuses(vllm_parser: VllmParser) -> None:
    version = vllm_parser.version
    refused = [*SGLANG_EQUIVALENTS, "max_modle_len", "disable_prefix_caching_typo"]
    assert all(override_errors(version, {key: 1}, "o") for key in refused)
    argvs = {key: ["vllm", "serve", "m", *engine_flags(version, {key: "1"})] for key in refused}
    results = vllm_parser.parse(argvs, full=False)
    accepted = {key: r for key, r in results.items() if r["ok"] or "unrecognized arguments" not in r["error"]}
    assert accepted == {}


def test_what_validation_refuses_in_the_environment_vllm_refuses(vllm_parser: VllmParser) -> None:
    """The engine's own check of its environment at start (EngineArgs calls the platform's
    validate_environ), on each variable alone, with and without fail_on_environ_validation."""
    version = vllm_parser.version
    variables = [
        (V2_MODEL_RUNNER_ENV, "0"),
        (V2_MODEL_RUNNER_ENV, "1"),
        ("VLLM_LOGGIN_LEVEL", "DEBUG"),
        ("VLLM_LOGGING_LEVEL", "DEBUG"),
        ("HF_HOME", "/cache"),
        *((name, "x") for name in sorted(vllm_parser.removed_envs())),
    ]
    cases = [(name, value, strict) for name, value in variables for strict in (False, True)]
    answers = vllm_parser.environ([({name: value}, strict) for name, value, strict in cases])
    theirs = {case: not answer["ok"] for case, answer in zip(cases, answers, strict=True)}
    ours = {(n, v, s): bool(environ_errors(version, [("env", n, v)], fail_on_unknown=s)) for n, v, s in cases}
    assert ours == theirs
    assert any(theirs.values()) and not all(theirs.values())
