"""`make vllm-minor`'s own rules (hack/epd_dev/vllm/minor.py), on parser answers made up for the
purpose; test_engine_args_contract.py runs them on the real parsers."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from epd_dev.vllm.minor import Facts, UnknownSpelling, changes, flag_tables, flags_text, used_by_renders


def action(dest: str, kind: str, *options: str) -> dict[str, Any]:
    flag = "--" + dest.replace("_", "-")
    return {"dest": dest, "kind": kind, "options": sorted({flag, *options}), "nargs": None, "type": None}


OLD_STYLE = [
    action("enable_prefix_caching", "BooleanOptionalAction", "--no-enable-prefix-caching"),
    action("mm_encoder_only", "BooleanOptionalAction", "--no-mm-encoder-only"),
    action("headless", "_StoreTrueAction"),
    action("middleware", "_AppendAction"),
    action("max_model_len", "_StoreAction"),
]
PAIRED = [
    action("enable_prefix_caching", "EnableDisableAction", "--disable-prefix-caching", "--no-enable-prefix-caching"),
    action("disable_sliding_window", "EnableDisableAction", "--enable-sliding-window", "--no-disable-sliding-window"),
    action("mm_encoder_only", "EnableDisableAction", "--no-mm-encoder-only"),
    action("headless", "_StoreTrueAction"),
    action("middleware", "_AppendAction"),
]


def test_flag_tables_follow_the_parsers_spelling_of_false():
    assert flag_tables(OLD_STYLE).negated_prefixes == {}
    tables = flag_tables(PAIRED)
    assert tables.negated_prefixes == {"enable-": "disable-", "disable-": "enable-"}
    assert (tables.store_true, tables.append) == (["headless"], ["middleware"])
    # One --enable-x without --disable-x: the pair cannot be used, and --no-x is not offered either.
    odd = [*PAIRED, action("enable_thing", "EnableDisableAction", "--enable-thing")]
    with pytest.raises(UnknownSpelling, match="enable_thing"):
        flag_tables(odd)


def test_flags_text_reads_back_as_the_tables():
    import yaml

    for actions in (OLD_STYLE, PAIRED):
        tables = flag_tables(actions)
        data = yaml.safe_load(flags_text("0.99", tables))
        assert data == {
            "negated_prefixes": tables.negated_prefixes,
            "store_true": tables.store_true,
            "append": tables.append,
        }


def facts(minor: str, actions: list[dict[str, Any]], env_names: set[str], routes: set[str], **config: Any) -> Facts:
    base = {
        "ec_transfer_config": ["ec_role"],
        "kv_transfer_config": ["kv_role"],
        "ec_connectors": {},
        "kv_connectors": [],
    }
    return Facts(minor, actions, env_names, {**base, **config}, routes)


def test_the_report_names_what_the_renders_use_and_the_new_minor_lacks():
    old = facts(
        "0.98",
        [*PAIRED, action("max_model_len", "_StoreAction")],
        {"VLLM_USE_V2_MODEL_RUNNER", "VLLM_SERVER_DEV_MODE"},
        {"/pause", "/fault_tolerance/apply"},
        ec_connectors={"ECCPUConnector": ["ec_cpu_bytes", "ec_enable_nixl"]},
    )
    new = facts(
        "0.99",
        [*PAIRED, action("max_model_length", "_StoreAction")],
        {"VLLM_SERVER_DEV_MODE"},
        {"/pause", "/v1/fault_tolerance/apply"},
        ec_transfer_config=["ec_role", "ec_new"],
        ec_connectors={"ECCPUConnector": ["ec_cpu_bytes"]},
    )
    new = dataclasses.replace(new, removed_env_names=frozenset({"VLLM_SERVER_DEV_MODE"}))
    used = used_by_renders("0.33", [])
    used.flags["--max-model-len"] = {"my.yaml"}
    used.env_names["VLLM_SERVER_DEV_MODE"] = {"my.yaml"}
    report = "\n".join(changes(old, new, used))
    assert "removed max_model_len (renamed to max_model_length?)" in report
    assert (
        "! --max-model-len is rendered for 0.98 (by my.yaml) but 0.99 has no such flag; did it become --max-model-length?"
        in report
    )
    assert "! VLLM_USE_V2_MODEL_RUNNER is rendered for 0.98 (by docs/examples/encoder-pools.yaml)" in report
    assert "refuses to start with (removed_env_vars.txt): new VLLM_SERVER_DEV_MODE" in report
    assert "! VLLM_SERVER_DEV_MODE is rendered for 0.98 (by my.yaml) and 0.99 refuses to start with it set" in report
    assert "ec_transfer_config fields: added ec_new, removed none" in report
    assert "ECCPUConnector extra config keys: added none, removed ec_enable_nixl" in report
    assert "POST routes: added /v1/fault_tolerance/apply, removed /fault_tolerance/apply" in report


def test_the_renders_include_the_examples_defaults_and_overrides():
    used = used_by_renders("0.33", [])
    assert {"--mm-encoder-only", "--disable-prefix-caching", "--enable-scale-out", "--ec-transfer-config"} <= set(
        used.flags
    )
    assert "docs/examples/multi-model-overrides.yaml" in used.flags["--max-model-len"]  # an override of it
    assert used.env_names["VLLM_USE_V2_MODEL_RUNNER"] == {"docs/examples/encoder-pools.yaml"}
