"""The supported vLLM minors, the engine arguments and environment variables each one reads, and
the check of a group's overrides.

A minor is supported when it has a `templates/vllm-<minor>/` folder, generated from its real
package by `make vllm-minor V=<minor>`: `engine_args.txt` lists the argparse dest names of its
`vllm serve` parser, `env_vars.txt` the variables `vllm.envs` reads; drift tests compare both with
the package. An override that is not one of the names would render into a flag vLLM refuses at
start-up, so every engine of the unit would crash-loop after its pod was scheduled: it is refused
before that.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

# Selects vLLM's V2 model runner, which ECCPUConnector and Mooncake's cross_encoder_cache need;
# from 0.34 on there is no other, and vLLM no longer reads the variable.
V2_MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# What an override key may look like: snake_case as Vime writes it, dashes tolerated.
OVERRIDE_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")

# Vime's docs and scripts show SGLang's ServerArgs names (Vime grew out of an SGLang framework):
# the vLLM argument that does the same job. No close spelling would lead there.
SGLANG_EQUIVALENTS = {
    "mem_fraction_static": "gpu_memory_utilization",
    "context_length": "max_model_len",
    "chunked_prefill_size": "max_num_batched_tokens",
    "max_running_requests": "max_num_seqs",
    "page_size": "block_size",
    "schedule_policy": "scheduling_policy",
    "disable_cuda_graph": "enforce_eager",
    "cuda_graph_max_bs": "max_cudagraph_capture_size",
    "dp_size": "data_parallel_size",
    "pp_size": "pipeline_parallel_size",
    "disable_radix_cache": "enable_prefix_caching",
    "enable_torch_compile": "compilation_config",
    "tp_size": "tensor_parallel_size",
}
# SGLang switches whose vLLM equivalent reads the other way round (true there is false here).
INVERTED_EQUIVALENTS = frozenset({"disable_radix_cache"})


def engine_arg_name(key: Any) -> Any:
    """One spelling per argument: vLLM accepts `max-model-len` and `max_model_len` alike, and its
    own is snake_case. A key that is no argument name at all is kept as written, for
    override_errors to name it so."""
    return key.replace("-", "_") if isinstance(key, str) and OVERRIDE_KEY.match(key) else key


def spelling_errors(keys: Iterable[Any]) -> list[str]:
    """Keys that set one argument twice, in two spellings."""
    spellings: dict[Any, list[Any]] = {}
    for key in keys:
        spellings.setdefault(engine_arg_name(key), []).append(key)
    return [f"{' and '.join(map(repr, k))} both set {name}: keep one" for name, k in spellings.items() if len(k) > 1]


def _shipped_minors() -> tuple[str, ...]:
    folders = (p.name for p in (resources.files(__package__) / "templates").iterdir())
    minors = [name.removeprefix("vllm-") for name in folders if re.fullmatch(r"vllm-0\.[1-9][0-9]*", name)]
    return tuple(sorted(minors, key=lambda minor: int(minor.split(".")[1])))


# The vLLM minors with templates, oldest first: ("0.32", "0.33", "0.34").
SUPPORTED_MINORS = _shipped_minors()


def _listed(minor: str, file: str) -> frozenset[str]:
    path = resources.files(__package__) / "templates" / f"vllm-{minor}" / file
    if not path.is_file():
        return frozenset()
    return frozenset(line for line in path.read_text().splitlines() if line and not line.startswith("#"))


@functools.cache
def known_engine_args(minor: str) -> frozenset[str]:
    """The argument names vLLM `minor` ("0.33") accepts, in snake_case."""
    return _listed(minor, "engine_args.txt")


@functools.cache
def known_env_vars(minor: str) -> frozenset[str]:
    """The environment variables vLLM `minor` reads (a VLLM_* name it does not, it warns about)."""
    return _listed(minor, "env_vars.txt")


@functools.cache
def removed_env_vars(minor: str) -> frozenset[str]:
    """The environment variables vLLM `minor` names as removed: it refuses to start with one set."""
    return _listed(minor, "removed_env_vars.txt")


def environ_errors(minor: str, env: Iterable[tuple[str, str, str | None]], *, fail_on_unknown: bool) -> list[str]:
    """What vLLM `minor`'s check of an engine's environment at start would refuse, for each
    (field path, name, literal value or None) of the variables the engine gets.
    `fail_on_unknown`: the group's `fail_on_environ_validation`, which makes a VLLM_* variable
    vLLM does not read fatal instead of a warning."""
    known, errors = known_env_vars(minor), []
    for where, name, value in env:
        if name == V2_MODEL_RUNNER_ENV and name not in known:
            # From 0.34, which has only the V2 runner: "1" is redundant, anything else refused.
            if value is not None and value != "1":
                errors.append(
                    f"{where}: vLLM {minor} has only its V2 model runner and refuses to start with "
                    f"{name}={value}: remove the variable"
                )
        elif name in removed_env_vars(minor):
            errors.append(f"{where}: vLLM {minor} removed {name} and refuses to start with it set: remove it")
        elif fail_on_unknown and name.startswith("VLLM_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"did you mean {close[0]}? Else remove it" if close else "remove it"
            errors.append(
                f"{where}: vLLM {minor} does not read {name}, and the group's overrides.fail_on_environ_validation "
                f"makes that fatal at start: {hint}, or drop fail_on_environ_validation"
            )
    return errors


def closest_engine_args(minor: str, key: Any) -> list[str]:
    """The accepted names `key` was probably meant as, best first: the name itself in another
    spelling, vLLM's name for an SGLang argument, else up to three close spellings."""
    known = known_engine_args(minor)
    name = _normalised(key)
    if name in known:
        return [name]
    if SGLANG_EQUIVALENTS.get(name) in known:
        return [SGLANG_EQUIVALENTS[name]]
    return difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)


def override_errors(minor: str, overrides: Mapping[str, Any], where: str) -> list[str]:
    """Messages for the keys of one group's `overrides` (at field path `where`) that vLLM `minor`
    would not accept, each naming the closest valid names; empty when all are fine.

    Keys may use dashes (normalised to underscores, as render does); a null value deletes a
    default but must still name a real argument. Keys the operator owns are render's to refuse.
    """
    errors = []
    known = known_engine_args(minor)
    for key in overrides:
        if not (isinstance(key, str) and OVERRIDE_KEY.match(key)):
            hint = _did_you_mean(minor, key) or " such as max_model_len"
            errors.append(f"{where}: {key!r} is not a vLLM engine argument name: use snake_case{hint}")
            continue
        name = engine_arg_name(key)
        if name not in known:
            origin = " (SGLang's name)" if name in SGLANG_EQUIVALENTS else ""
            hint = _did_you_mean(minor, key) or ": remove it, or use an argument `vllm serve --help` lists"
            errors.append(f"{where}.{key}: not an engine argument of vLLM {minor}{origin}{hint}")
    return errors + [f"{where}: {message}" for message in spelling_errors(overrides)]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, how overrides apply: dicts merge key by key, null deletes,
    anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def _did_you_mean(minor: str, key: Any) -> str:
    names = closest_engine_args(minor, key)
    if not names:
        return ""
    quoted = [f"`{name}`" for name in names]
    if _normalised(key) in INVERTED_EQUIVALENTS and names == [SGLANG_EQUIVALENTS[_normalised(key)]]:
        quoted[0] += " (with the opposite value)"
    listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f": did you mean {listed}?"


def _normalised(key: Any) -> str:
    # As a person may have meant it: `--Max-Model-Len` -> max_model_len.
    return str(key).strip().lstrip("-").lower().replace("-", "_")
