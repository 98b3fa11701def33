"""The janitor in the rendered EPD unit, the budgets, and the budget check (all pure)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from epd_operator.cli import build_parser
from epd_operator.ec.budget import ASSUMED_EMBEDDING_BYTES, budget_warning, default_max_bytes
from epd_operator.ec.quantity import parse_quantity
from epd_operator.render import render
from epd_operator.resources import JANITOR_METRICS_PORT, desired_children
from epd_operator.validation import validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
OPERATOR_IMAGE = "registry.example/epd-operator:1.2.3"


def rendered(example: str, **spec_changes):
    """(spec, plans, {model: pod spec}) of an example, with top-level spec fields replaced."""
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"].update(copy.deepcopy(spec_changes))
    checked = validate(manifest["spec"])
    spec = checked.spec
    name = manifest["metadata"]["name"]
    plans = render(checked, namespace="ns", name=name, uid="uid-1")
    pods = {
        child["metadata"]["labels"]["epd.vime.dev/model"]: child["spec"]["template"]["spec"]
        for child in desired_children(spec, name, plans, OPERATOR_IMAGE)
        if child["kind"] == "StatefulSet"
    }
    return spec, plans, pods


def janitor_of(pod: dict) -> dict:
    (janitor,) = [c for c in pod["containers"] if c["name"] == "janitor"]
    return janitor


def test_every_unit_with_encoders_runs_a_janitor_on_its_ec_store():
    _, (plan,), pods = rendered("encoder-regular.yaml")
    pod = pods["default"]
    janitor = janitor_of(pod)
    assert janitor["image"] == OPERATOR_IMAGE
    assert janitor["command"] == ["epd-operator", "janitor"]
    # Default budget: 80% of the 16Gi shm; no TTL.
    assert janitor["args"] == [
        "--path",
        plan.ec_storage_path,
        "--max-bytes",
        str(int(16 * 2**30 * 0.8)),
        "--metrics-port",
        str(JANITOR_METRICS_PORT),
    ]
    # It sees the store where the engines write it: the unit's memory-backed emptyDir.
    assert janitor["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert pod["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert plan.ec_storage_path.startswith("/dev/shm/vime-ec-")
    assert janitor["ports"] == [{"name": "janitor-metrics", "containerPort": 9400}]
    assert janitor["resources"] == {"requests": {"cpu": "10m", "memory": "48Mi"}, "limits": {"memory": "128Mi"}}
    assert "nvidia.com/gpu" not in json.dumps(janitor)
    # The pod's uid, the engines' (it deletes what they wrote), never root: Pod Security restricted.
    assert "runAsUser" not in janitor["securityContext"]
    assert pod["securityContext"]["runAsUser"] != 0 and pod["securityContext"]["runAsNonRoot"] is True
    assert janitor["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    ports = [p["containerPort"] for c in pod["initContainers"] + pod["containers"] for p in c["ports"]]
    assert len(ports) == len(set(ports))


def test_the_janitor_command_is_what_the_cli_parses():
    _, (plan,), pods = rendered("encoder-regular.yaml", ecStorage={"maxBytes": 5000, "ttlSeconds": 600})
    janitor = janitor_of(pods["default"])
    args = build_parser().parse_args([*janitor["command"][1:], *janitor["args"]])
    assert (args.path, args.max_bytes, args.ttl_seconds, args.metrics_port) == (
        [plan.ec_storage_path],
        5000,
        600,
        JANITOR_METRICS_PORT,
    )


def test_text_only_models_have_no_store_and_no_janitor():
    _, _, pods = rendered("multi-model-overrides.yaml")
    assert "janitor" in [c["name"] for c in pods["actor"]["containers"]]
    assert "janitor" not in [c["name"] for c in pods["reward"]["containers"]]


def test_nothing_in_the_unit_creates_the_store():
    """The connector creates the folder on its first write (and a fresh emptyDir starts empty)."""
    _, _, pods = rendered("encoder-prefill-decode.yaml")
    pod = pods["default"]
    assert [c["name"] for c in pod["initContainers"]] == ["encoder-0"]  # no init step preparing it
    commands = json.dumps(
        [[*c.get("command", []), *c.get("args", [])] for c in [*pod["initContainers"], *pod["containers"]]]
    )
    assert "mkdir" not in commands and "install -d" not in commands


def test_a_store_on_a_user_volume_is_mounted_into_the_janitor():
    _, (plan,), pods = rendered(
        "encoder-regular.yaml",
        ecConnector={"storageRoot": "/ec"},
        ecStorage={"maxBytes": 10**9},
        volumes=[{"name": "ec", "emptyDir": {}}, {"name": "models", "emptyDir": {}}],
        volumeMounts=[{"name": "ec", "mountPath": "/ec"}, {"name": "models", "mountPath": "/models"}],
    )
    assert plan.ec_storage_path.startswith("/ec/vime-ec-")
    assert janitor_of(pods["default"])["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "ec", "mountPath": "/ec"},
    ]


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [
        ("16Gi", 16 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1Ki", 1024),
        ("2Ti", 2 * 2**40),
        ("1k", 1000),
        ("5M", 5 * 10**6),
        ("3G", 3 * 10**9),
        ("1T", 10**12),
        ("1024", 1024),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("2E", 2 * 10**18),  # exa, not an exponent without digits
        ("1Ei", 2**60),
        ("1.5Gi", 3 * 2**29),
        ("0.5k", 500),
        ("+1Mi", 2**20),
        ("1.0001", 2),  # byte quantities round up, as Kubernetes does
    ],
)
def test_quantities(quantity, expected):
    assert parse_quantity(quantity) == expected


@pytest.mark.parametrize("quantity", ["", "Gi", "16GB", "16 Gi", "100m", "-1Gi", "1Ki2", "1e999999999", "1e100"])
def test_what_is_not_a_byte_quantity(quantity):
    with pytest.raises(ValueError):
        parse_quantity(quantity)


def test_default_budget_is_80_percent_of_the_shm_size_limit():
    assert default_max_bytes("16Gi") == 13743895347
    assert default_max_bytes("10G") == 8 * 10**9
    assert default_max_bytes("1") == 0


def test_default_budgets_raise_no_warning():
    for example in ("encoder-regular.yaml", "encoder-prefill-decode.yaml", "multi-model-overrides.yaml"):
        spec, plans, _ = rendered(example)
        assert [budget_warning(spec, spec.model(plan.name)) for plan in plans] == [None] * len(plans), example


def test_a_budget_smaller_than_one_image_per_running_sequence_is_warned_about():
    # 1Gi shm -> 0.8 GiB budget; one regular engine at vLLM's default 256 sequences needs ~2.3 GiB.
    spec, (plan,), _ = rendered("encoder-regular.yaml", shm={"sizeLimit": "1Gi"})
    warning = budget_warning(spec, spec.model(plan.name))
    assert warning is not None and "fewer than one image per sequence" in warning and "256 sequences" in warning
    assert budget_warning(spec, spec.model(plan.name), embedding_bytes=ASSUMED_EMBEDDING_BYTES // 4) is None

    # Fewer sequences per consumer fit.
    manifest_models = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())["spec"]["models"]
    manifest_models[0]["serverGroups"][1]["overrides"] = {"max_num_seqs": 32}
    spec, (plan,), _ = rendered("encoder-regular.yaml", shm={"sizeLimit": "1Gi"}, models=manifest_models)
    assert budget_warning(spec, spec.model(plan.name)) is None


def test_prefill_engines_count_as_consumers_and_decode_engines_do_not():
    spec, (plan,), _ = rendered("encoder-prefill-decode.yaml", shm={"sizeLimit": "1Gi"})
    assert "(256 sequences" in budget_warning(spec, spec.model(plan.name))


def test_a_budget_not_below_the_shm_size_limit_is_warned_about():
    spec, (plan,), _ = rendered("encoder-regular.yaml", ecStorage={"maxBytes": 16 * 2**30})
    assert "not below shm.sizeLimit" in budget_warning(spec, spec.model(plan.name))
