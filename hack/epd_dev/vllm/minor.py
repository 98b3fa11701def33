"""A new vLLM minor in one command, and the files each minor's support is generated into.

    make vllm-minor V=0.35                  # python -m epd_dev.vllm.minor 0.35
    make vllm-minor V=0.35 MANIFESTS=dir/   # also report what your manifests use that 0.35 lacks

1. installs the parser venv of vLLM <minor>.0 (envs.parser_env), and the previous minor's;
2. writes operator/epd_operator/templates/vllm-<minor>/ from its real `vllm serve` parser:
   `engine_args.txt` (the argument names an override may use), `env_vars.txt` (the environment
   variables it reads), `removed_env_vars.txt` (those it refuses to start with, when it names any)
   and `flags.yaml` (how it spells booleans and lists). A minor is supported
   once its folder exists (engine_args.SUPPORTED_MINORS);
3. regenerates the CRD, whose CEL rule lists the supported minors (`make crds`);
4. writes the minor's golden renders (tests/render/golden/*.vllm-<minor>.yaml: review them);
5. runs tests/render against its parser;
6. prints what changed since the previous minor: arguments and flags removed or renamed that the
   operator's defaults, the examples or your manifests use, flag spellings, environment
   variables, EC/KV config fields and connectors, API routes.

Run for a supported minor on a clean tree, it writes the same bytes again: the contract tests
(tests/render/test_engine_args_contract.py) regenerate every minor's files from its parser in
`make test` and compare them byte for byte.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import envs
from .cli_parser import VllmParser

REPO = Path(__file__).resolve().parents[3]
TEMPLATES = REPO / "operator" / "epd_operator" / "templates"
EXAMPLES = REPO / "docs" / "examples"
README = REPO / "README.md"
# flags.yaml of these minors was written by hand before this generator; its tables are still
# checked against the parser, its comments are its own.
HAND_WRITTEN_FLAGS = ("0.32", "0.33")
BOOLEAN_KINDS = frozenset({"BooleanOptionalAction", "EnableDisableAction", "_StoreTrueAction"})
# The prefix pairs a parser may spell a boolean's false with (vLLM 0.33's EnableDisableAction).
PREFIX_PAIRS = (("enable-", "disable-"), ("disable-", "enable-"))
MINOR = re.compile(r"0\.[1-9][0-9]*")


def _log(message: str) -> None:
    print(f"[vllm-minor] {message}", flush=True)


def minor_key(minor: str) -> tuple[int, ...]:
    return tuple(int(part) for part in minor.split("."))


# --------------------------------------------------------------------------- the files


def accepted_names(actions: Iterable[Mapping[str, Any]]) -> list[str]:
    """The dest names an override may use, sorted.

    An override `foo_bar` renders as `--foo-bar`, so a name counts when its own action answers to
    that spelling. Short aliases (-tp) and alternative spellings (--no-x, 0.33's --disable-x) are
    not names of their own: one key per argument keeps each flag single. `--help` is no argument.
    """
    return sorted(
        a["dest"] for a in actions if a["kind"] != "_HelpAction" and "--" + a["dest"].replace("_", "-") in a["options"]
    )


@dataclass(frozen=True)
class FlagTables:
    """What flags.yaml holds: the exceptions to `--foo-bar value`."""

    negated_prefixes: dict[str, str]
    store_true: list[str]
    append: list[str]


class UnknownSpelling(ValueError):
    """The parser spells a boolean's false in a way flags.yaml cannot say: the renderer needs work."""


def flag_tables(actions: Iterable[Mapping[str, Any]]) -> FlagTables:
    """The parser's spelling of false and its store_true and append flags.

    False is `--no-<flag>` unless the parser pairs prefixes (`--enable-x` with `--disable-x`): a
    pair is used when every boolean flag with that prefix has the swapped spelling. Every boolean
    must then have the spelling the tables give it, or UnknownSpelling says which do not.
    """
    actions = list(actions)
    booleans = [a for a in actions if a["kind"] in BOOLEAN_KINDS - {"_StoreTrueAction"}]

    def flag(action: Mapping[str, Any]) -> str:
        return "--" + action["dest"].replace("_", "-")

    prefixes = {}
    for prefix, inverse in PREFIX_PAIRS:
        using = [a for a in booleans if flag(a).startswith("--" + prefix)]
        if using and all("--" + inverse + flag(a).removeprefix("--" + prefix) in a["options"] for a in using):
            prefixes[prefix] = inverse

    def negation(action: Mapping[str, Any]) -> str:
        for prefix, inverse in prefixes.items():
            if flag(action).startswith("--" + prefix):
                return "--" + inverse + flag(action).removeprefix("--" + prefix)
        return "--no-" + flag(action).removeprefix("--")

    odd = sorted(a["dest"] for a in booleans if negation(a) not in a["options"])
    if odd:
        raise UnknownSpelling(
            f"no spelling of false for {odd}: the parser offers neither --no-<flag> nor a prefix swap"
        )
    return FlagTables(
        negated_prefixes=prefixes,
        store_true=sorted(a["dest"] for a in actions if a["kind"] == "_StoreTrueAction"),
        append=sorted(a["dest"] for a in actions if a["kind"] == "_AppendAction"),
    )


def engine_args_text(minor: str, names: Iterable[str]) -> str:
    header = (
        f"# Engine arguments (argparse dest names) that vLLM {minor}'s `vllm serve` parser accepts.\n"
        "# Generated from the real parser by `make vllm-minor` (hack/epd_dev/vllm/minor.py):\n"
        "# do not edit; tests/render/test_engine_args_contract.py fails when it drifts.\n"
    )
    return header + "".join(f"{name}\n" for name in names)


def env_vars_text(minor: str, names: Iterable[str], *, removed: bool = False) -> str:
    """`env_vars.txt`, or with `removed` `removed_env_vars.txt`."""
    if removed:
        header = (
            f"# Environment variables that vLLM {minor} names as removed (vllm.envs.removed_environment_variables):\n"
            "# it refuses to start with one set. Generated from the real package by `make vllm-minor`\n"
            "# (hack/epd_dev/vllm/minor.py): do not edit; tests/render/test_engine_args_contract.py fails when it drifts.\n"
        )
    else:
        header = (
            f"# Environment variables that vLLM {minor} reads (vllm.envs.environment_variables).\n"
            "# Generated from the real package by `make vllm-minor` (hack/epd_dev/vllm/minor.py):\n"
            "# do not edit; tests/render/test_engine_args_contract.py fails when it drifts.\n"
        )
    return header + "".join(f"{name}\n" for name in sorted(names))


def flags_text(minor: str, tables: FlagTables) -> str:
    def block(names: list[str]) -> str:
        return "\n" + "".join(f"  - {name}\n" for name in names) if names else " []\n"

    if tables.negated_prefixes:
        negation = (
            "# false -> swap the flag's prefix, as the parser pairs them (--enable-x with --disable-x,\n"
            "# e.g. --disable-prefix-caching), else `--no-<flag>`.\n"
            "negated_prefixes:\n" + "".join(f"  {p}: {q}\n" for p, q in tables.negated_prefixes.items())
        )
    else:
        negation = "# false -> `--no-<flag>`: the parser pairs no prefixes.\nnegated_prefixes: {}\n"
    return (
        f"# How vLLM {minor}'s `vllm serve` parser spells engine arguments. `foo_bar: value` renders as\n"
        "# `--foo-bar value`, a dict as compact JSON, a list as `--foo-bar a b`; these are the exceptions.\n"
        "# Generated from the real parser by `make vllm-minor` (hack/epd_dev/vllm/minor.py): do not edit;\n"
        "# tests/render/test_parser_contract.py checks every boolean and list flag against the parser.\n"
        "\n" + negation + "\n"
        "# store_true flags have no negation: false is their default, so it renders as nothing.\n"
        "store_true:" + block(tables.store_true) + "\n"
        '# Lists given as one flag per value (argparse action="append").\n'
        "append:" + block(tables.append)
    )


def template_dir(minor: str) -> Path:
    return TEMPLATES / f"vllm-{minor}"


def generated_files(
    minor: str, actions: list[dict[str, Any]], env_names: Iterable[str], removed_env_names: Iterable[str] = ()
) -> dict[Path, str]:
    """Every file `make vllm-minor` writes for `minor` from its parser's answers (the removed
    variables' only when it names any)."""
    folder = template_dir(minor)
    files = {
        folder / "engine_args.txt": engine_args_text(minor, accepted_names(actions)),
        folder / "env_vars.txt": env_vars_text(minor, env_names),
    }
    if removed := sorted(removed_env_names):
        files[folder / "removed_env_vars.txt"] = env_vars_text(minor, removed, removed=True)
    if minor not in HAND_WRITTEN_FLAGS:
        files[folder / "flags.yaml"] = flags_text(minor, flag_tables(actions))
    return files


# --------------------------------------------------------------------------- what changed


@dataclass(frozen=True)
class Facts:
    """What one minor's real package says, for the comparison."""

    minor: str
    actions: list[dict[str, Any]]
    env_names: set[str]
    config: dict[str, Any]
    post_routes: set[str]
    removed_env_names: frozenset[str] = frozenset()

    @property
    def options(self) -> set[str]:
        return {option for action in self.actions for option in action["options"]}


def facts(parser: VllmParser) -> Facts:
    return Facts(
        parser.version,
        parser.actions(),
        parser.envs(),
        parser.config(),
        parser.post_routes(),
        frozenset(parser.removed_envs()),
    )


def documented_manifests(manifests: Iterable[Path] = ()) -> dict[str, dict[str, Any]]:
    """The EPDDeployments of docs/examples, of the README and of the given files or folders."""
    found: dict[str, dict[str, Any]] = {}

    def add(where: str, text: str) -> None:
        for index, document in enumerate(yaml.safe_load_all(text)):
            if isinstance(document, dict) and document.get("kind") == "EPDDeployment":
                found[f"{where}#{index}" if index else where] = document

    for path in sorted(EXAMPLES.glob("*.yaml")):
        add(str(path.relative_to(REPO)), path.read_text())
    for number, block in enumerate(re.findall(r"```yaml\n(.*?)```", README.read_text(), re.DOTALL)):
        add(f"README.md (yaml block {number + 1})", block)
    for given in manifests:
        for path in sorted(given.rglob("*.y*ml")) if given.is_dir() else [given]:
            add(str(path), path.read_text())
    return found


@dataclass(frozen=True)
class Used:
    """What the engines of the specs render with for one minor, each with the specs using it."""

    flags: dict[str, set[str]]
    env_names: dict[str, set[str]]


def used_by_renders(minor: str, manifests: Iterable[Path]) -> Used:
    """The flags and environment variables the engines of the specs render with for `minor` (a
    supported one): the operator's defaults and the overrides alike."""
    from epd_operator.render import render
    from epd_operator.validation import SpecError, validate

    used = Used({}, {})
    for where, manifest in documented_manifests(manifests).items():
        try:
            plans = render(
                validate({**manifest.get("spec", {}), "vllmVersion": minor}), namespace="ns", name="x", uid="uid"
            )
        except SpecError as error:
            _log(f"{where}: not valid for vLLM {minor}, left out: {error}")
            continue
        for plan in plans:
            for cmd in plan.engines:
                for token in cmd.args:
                    if token.startswith("--"):
                        used.flags.setdefault(token, set()).add(where)
                for name in [*cmd.env, *cmd.field_env]:
                    used.env_names.setdefault(name, set()).add(where)
    return used


def _listed(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _renamed(removed: Iterable[str], added: Iterable[str]) -> dict[str, list[str]]:
    return {name: difflib.get_close_matches(name, sorted(added), n=2, cutoff=0.7) for name in sorted(removed)}


def changes(old: Facts, new: Facts, used: Used) -> list[str]:
    """What changed from `old` to `new`, for people: one line per topic (and one per problem)."""
    lines = [f"vLLM {new.minor} against {old.minor}:"]
    old_names, new_names = set(accepted_names(old.actions)), set(accepted_names(new.actions))
    added, removed = new_names - old_names, old_names - new_names
    lines.append(f"  engine arguments: {len(added)} added ({_listed(added)}); {len(removed)} removed")
    for name, guesses in _renamed(removed, added).items():
        lines.append(f"    removed {name}" + (f" (renamed to {' or '.join(guesses)}?)" if guesses else ""))
    gone = {flag: where for flag, where in used.flags.items() if flag not in new.options}
    if gone:
        for flag, where in sorted(gone.items()):
            guesses = difflib.get_close_matches(flag, sorted(new.options), n=2, cutoff=0.7)
            hint = f"; did it become {' or '.join(guesses)}?" if guesses else ""
            lines.append(
                f"  ! {flag} is rendered for {old.minor} (by {_listed(where, 4)}) but {new.minor} has no such flag{hint}"
            )
    else:
        lines.append(
            f"  flags rendered for {old.minor} (the operator's defaults, the examples' and given manifests' "
            f"overrides: {len(used.flags)} flags): all accepted by {new.minor}"
        )
    before, after = flag_tables(old.actions), flag_tables(new.actions)
    if before == after:
        lines.append("  boolean and list spellings (flags.yaml): unchanged")
    else:
        lines.append(f"  boolean and list spellings (flags.yaml): {before} -> {after}")
    env_added, env_removed = new.env_names - old.env_names, old.env_names - new.env_names
    lines.append(f"  environment variables: {len(env_added)} added, removed {_listed(env_removed)}")
    refused = new.removed_env_names - old.removed_env_names
    lines.append(f"  environment variables it refuses to start with (removed_env_vars.txt): new {_listed(refused)}")
    for name, where in sorted(used.env_names.items()):
        if name in new.removed_env_names:
            lines.append(
                f"  ! {name} is rendered for {old.minor} (by {_listed(where, 4)}) and {new.minor} refuses to start with "
                f"it set: leave it out of {new.minor}'s renders"
            )
        elif name not in new.env_names:
            lines.append(
                f"  ! {name} is rendered for {old.minor} (by {_listed(where, 4)}) and {new.minor} does not read it: "
                f"check that {new.minor}'s goldens leave it out (vLLM warns about VLLM_* variables it does not know)"
            )
    for config in ("ec_transfer_config", "kv_transfer_config"):
        was, now = set(old.config[config]), set(new.config[config])
        lines.append(f"  {config} fields: added {_listed(now - was)}, removed {_listed(was - now)}")
    was_ec, now_ec = old.config["ec_connectors"], new.config["ec_connectors"]
    lines.append(
        f"  EC connectors: {_listed(now_ec)} (added {_listed(set(now_ec) - set(was_ec))}, removed {_listed(set(was_ec) - set(now_ec))})"
    )
    for name in sorted(set(was_ec) & set(now_ec)):
        keys_added, keys_removed = set(now_ec[name]) - set(was_ec[name]), set(was_ec[name]) - set(now_ec[name])
        if keys_added or keys_removed:
            lines.append(f"    {name} extra config keys: added {_listed(keys_added)}, removed {_listed(keys_removed)}")
    was_kv, now_kv = set(old.config["kv_connectors"]), set(new.config["kv_connectors"])
    lines.append(f"  KV connectors: added {_listed(now_kv - was_kv)}, removed {_listed(was_kv - now_kv)}")
    routes_added, routes_removed = new.post_routes - old.post_routes, old.post_routes - new.post_routes
    lines.append(
        f"  POST routes: added {_listed(routes_added)}, removed {_listed(routes_removed)}"
        + (" (tests/render/test_proxy_routes_contract.py must account for the new ones)" if routes_added else "")
    )
    return lines


# --------------------------------------------------------------------------- the command


def previous_minor(minor: str) -> str | None:
    from epd_operator.engine_args import SUPPORTED_MINORS

    older = [m for m in SUPPORTED_MINORS if minor_key(m) < minor_key(minor)]
    return older[-1] if older else None


def _start(minor: str) -> VllmParser:
    return VllmParser(minor, envs.parser_python(minor))


def _run(cmd: list[str], **env: str) -> int:
    _log("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]))
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("minor", help="the vLLM minor, e.g. 0.35")
    parser.add_argument("--manifests", nargs="*", type=Path, default=[], help="your EPDDeployment files or folders")
    parser.add_argument("--no-tests", action="store_true", help="write the files only, run no tests")
    args = parser.parse_args(argv)
    minor = args.minor.removeprefix("v")
    if not MINOR.fullmatch(minor):
        parser.error(f"{args.minor!r} is not a vLLM minor such as 0.35")
    previous = previous_minor(minor)
    names = [f"parser-{minor}"] + ([f"parser-{previous}"] if previous else [])
    _log(f"1/6 the parser venvs: {', '.join(names)}")
    try:
        envs.install(names)
    except subprocess.CalledProcessError:
        _log(f"FAILED: no parser venv for vLLM {minor}.0 (the installer's error is above: is vllm=={minor}.0 on PyPI?)")
        _log("nothing was written")
        return 1
    _log(f"2/6 vLLM {minor}'s files from its parser" + (f" (and {previous}'s, to compare)" if previous else ""))
    with concurrent.futures.ThreadPoolExecutor() as pool:
        parsers = list(pool.map(_start, [minor] + ([previous] if previous else [])))
        try:
            found = list(pool.map(facts, parsers))
        finally:
            for started in parsers:
                started.close()
    new = found[0]
    for path, text in generated_files(minor, new.actions, new.env_names, new.removed_env_names).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        unchanged = path.exists() and path.read_text() == text
        path.write_text(text)
        _log(f"   {path.relative_to(REPO)}: {'unchanged' if unchanged else 'written'}")
    if minor in HAND_WRITTEN_FLAGS:
        _log(f"   {template_dir(minor).relative_to(REPO)}/flags.yaml: hand-written, left as it is")
    failed = []
    _log("3/6 the CRD (its CEL rule lists the supported minors)")
    if _run(["make", "--no-print-directory", "crds"]):
        failed.append("make crds")
    if not args.no_tests:
        _log(f"4/6 the golden renders of {minor} (review the diff)")
        golden = ["tests/render/test_golden.py", "-k", f"vllm-{minor}"]
        if _run([sys.executable, "-m", "pytest", "-q", *golden], UPDATE_GOLDEN="1"):
            failed.append("the golden renders")
        _log(f"5/6 tests/render against vLLM {minor}'s parser")
        if _run([sys.executable, "-m", "pytest", "-q", "tests/render", "-k", f"vllm-{minor} or router"]):
            failed.append("tests/render")
    _log("6/6 what changed")
    if previous:
        print("\n".join(changes(found[1], new, used_by_renders(previous, args.manifests))), flush=True)
    else:
        print(f"vLLM {minor} is the oldest supported minor: nothing to compare with", flush=True)
    if failed:
        _log(f"FAILED: {', '.join(failed)}: see above")
        return 1
    _log(f"vLLM {minor} is supported; add it to docs/rendering.md's table of minors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
