"""The generated CRD on the real API server: CEL and Python give the same verdicts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from epd_operator.ec.quantity import MAX_BYTES
from epd_operator.validation import SpecError, validate

from .test_validation import all_layouts, spec_with

pytestmark = pytest.mark.cluster

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": "epd.vime.dev/v1alpha1", "kind": "EPDDeployment", "metadata": {"name": name}, "spec": spec}


def server_dry_run(cluster, namespace: str, documents: list[dict]) -> dict[str, str]:
    """Apply every document with server-side validation only; map name -> error text ('' if accepted)."""
    out = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-f",
        "-",
        input=yaml.safe_dump_all(documents),
        check=False,
        timeout=120,
    )
    verdicts = {d["metadata"]["name"]: "" for d in documents}
    for line in out.stderr.splitlines():
        # "EPDDeployment.epd.vime.dev "x" is invalid" for one object of many, without the group for one
        match = re.search(r'EPDDeployment(?:\.epd\.vime\.dev)? "([^"]+)" is invalid: (.*)', line)
        if match:
            verdicts[match[1]] = match[2]
    return verdicts


def python_verdict(spec: dict) -> list[str]:
    try:
        validate(spec)
        return []
    except SpecError as error:
        return error.errors


def test_cel_and_python_agree_on_every_layout_of_one_to_four_groups(cluster, crd, namespace):
    layouts = list(all_layouts())
    documents = [manifest(f"layout-{i}", spec_with(*types)) for i, types in enumerate(layouts)]
    cel = server_dry_run(cluster, namespace, documents)
    for i, types in enumerate(layouts):
        python = python_verdict(spec_with(*types))
        api_error = cel[f"layout-{i}"]
        assert bool(api_error) == bool(python), f"{types}: API server said {api_error!r}, Python {python}"
        for message in python:  # each broken rule's message, word for word, from the API server
            assert message in api_error, f"{types}: {message!r} not in {api_error!r}"


def test_examples_apply_and_invalid_layouts_fail_with_the_rule(cluster, crd, namespace):
    for example in sorted(EXAMPLES.glob("*.yaml")):
        cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))
    bad = manifest("bad", spec_with("encoder", "prefill"))
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert out.returncode != 0
    assert "model 'actor': encoder+prefill is incomplete: add a decode group" in out.stderr


def test_unknown_fields_are_rejected_but_overrides_stay_open(cluster, crd, namespace):
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][0]["overrides"] = {"max_num_seqs": 8, "compilation_config": {"level": 0}}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest("open", spec)))
    spec["models"][0]["serverGroups"][0]["numGPUs"] = 2
    out = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest("typo", spec)), check=False
    )
    assert out.returncode != 0 and 'unknown field "spec.models[0].serverGroups[0].numGPUs"' in out.stderr


def test_other_cel_rules(cluster, crd, namespace):
    cases = {
        "gpus": (
            lambda s: s["models"][0]["serverGroups"][1].update(numGpus=3, numGpusPerEngine=2),
            "numGpus must be a multiple of numGpusPerEngine",
        ),
        "version": (lambda s: s.update(image="vllm/vllm-openai:latest"), "unsupported or unknown vLLM version"),
        "hostpath": (
            lambda s: s.update(volumes=[{"name": "m", "hostPath": {"path": "/m"}}]),
            "hostPath volumes are not allowed",
        ),
        "dupname": (lambda s: s["models"].append(dict(s["models"][0])), "Duplicate value"),
        "headless": (
            lambda s: s.update(service={"type": "LoadBalancer", "headless": True}),
            "a headless Service has no virtual IP",
        ),
    }
    documents = []
    for name, (change, _message) in cases.items():
        spec = spec_with("encoder", "regular")
        change(spec)
        documents.append(manifest(name, spec))
        assert python_verdict(spec), f"{name}: Python accepted what the API server must refuse"
    verdicts = server_dry_run(cluster, namespace, documents)
    for name, (_change, message) in cases.items():
        assert message in verdicts[name], f"{name}: {verdicts[name]!r}"


def test_kubectl_explain_shows_the_field_descriptions(cluster, crd):
    out = cluster.kubectl("explain", "epd.spec.models.serverGroups").stdout
    assert "workerType" in out and "encoder (EC producer, never behind the router)" in out
    assert "numGpusPerEngine" in out and "numGpus must be a multiple of it" in out


def test_cel_and_python_agree_on_the_placement_rules(cluster, crd, namespace):
    from .test_validation import POOLS_CASES, pools_spec

    documents = [manifest(f"placement-{name}", pools_spec(changes)) for name, (changes, _m) in POOLS_CASES.items()]
    cel = server_dry_run(cluster, namespace, documents)
    for name, (changes, message) in POOLS_CASES.items():
        python = python_verdict(pools_spec(changes))
        api_error = cel[f"placement-{name}"]
        assert bool(api_error) == bool(python), f"{name}: API server said {api_error!r}, Python {python}"
        if message:
            assert message in api_error, f"{name}: {message!r} not in {api_error!r}"


def test_pools_with_ecexampleconnector_is_refused_at_apply_time(cluster, crd, namespace):
    spec = spec_with("encoder", "regular")
    spec["models"][0].update(placement="Pools", ecConnector={"name": "ECExampleConnector"})
    out = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest("pools-example", spec)), check=False
    )
    assert out.returncode != 0
    assert (
        "model 'actor': placement Pools cannot use ECExampleConnector: it exchanges embeddings as files in a "
        "node-local /dev/shm, which cannot span nodes; use ECCPUConnector"
    ) in out.stderr


def test_the_api_server_refuses_a_name_no_child_could_carry_and_too_many_engines(cluster, crd, namespace):
    groups = [{"workerType": "encoder", "numGpus": 8}, {"workerType": "regular", "numGpus": 9}]
    many = spec_with("encoder", "regular")
    many["models"] = [{"name": f"m{i}", "model": "m", "serverGroups": groups} for i in range(16)]
    verdicts = server_dry_run(
        cluster,
        namespace,
        [manifest("qwen2.5-vl", spec_with("encoder", "regular")), manifest("many", many)],
    )
    assert "metadata.name must be a DNS-1035 label of at most 63 characters" in verdicts["qwen2.5-vl"]
    assert "more than 256 engines in all" in verdicts["many"]
    assert python_verdict(many)[0].startswith("spec.models: 272 engines in all")


def test_the_api_server_refuses_a_drain_longer_than_the_grace_period(cluster, crd, namespace):
    spec = spec_with("encoder", "regular", termination={"gracePeriodSeconds": 30, "drainSeconds": 40})
    verdict = server_dry_run(cluster, namespace, [manifest("drain", spec)])["drain"]
    assert "the drain must end before the grace period does" in verdict
    assert python_verdict(spec) != []


def test_the_api_server_refuses_a_prime_attempt_longer_than_the_priming(cluster, crd, namespace):
    documents = [
        manifest("too-long", spec_with("encoder", "regular", proxy={"primeAttemptTimeoutSeconds": 601})),
        manifest("fits", spec_with("encoder", "regular", proxy={"primeAttemptTimeoutSeconds": 600})),
        manifest("null", spec_with("encoder", "regular", proxy={"primeAttemptTimeoutSeconds": None})),
    ]
    verdicts = server_dry_run(cluster, namespace, documents)
    assert "one prime attempt cannot outlast priming with all its retries" in verdicts["too-long"]
    assert verdicts["fits"] == verdicts["null"] == ""
    assert python_verdict(documents[0]["spec"]) != []


def test_the_api_server_takes_every_byte_bound_up_to_the_largest(cluster, crd, namespace):
    """Each integer bound of the CRD is one the API server can compare with: a bound it reads as
    something else than an int64 makes it refuse every object that sets the field at all."""
    documents = []
    for name, max_bytes in (("small", 1), ("largest", MAX_BYTES)):
        spec = spec_with("encoder", "regular")
        spec["ecStorage"] = {"maxBytes": max_bytes}
        documents.append(manifest(name, spec))
        assert not python_verdict(spec), name
    too_large = spec_with("encoder", "regular")
    too_large["ecStorage"] = {"maxBytes": MAX_BYTES + 1}
    documents.append(manifest("too-large", too_large))
    verdicts = server_dry_run(cluster, namespace, documents)
    assert verdicts["small"] == verdicts["largest"] == ""
    assert "should be less than or equal to" in verdicts["too-large"], verdicts["too-large"]


@pytest.mark.parametrize(
    ("quantity", "accepted"), [("two", False), ("1 Gi", False), (4, True), ("8Gi", True), ("1.5", True), ("1e3", True)]
)
def test_resource_quantities_are_checked_by_the_api_server_as_by_python(cluster, crd, namespace, quantity, accepted):
    spec = spec_with("encoder", "regular")
    spec["models"][0]["serverGroups"][0]["resources"] = {"limits": {"cpu": quantity}}
    (verdict,) = server_dry_run(cluster, namespace, [manifest("quantity", spec)]).values()
    assert (verdict == "", python_verdict(spec) == []) == (accepted, accepted), verdict
