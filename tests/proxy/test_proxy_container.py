"""resources.proxy_container: the container the operator adds to a unit to run the proxy."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from epd_dataplane.cli import build_parser, proxy_limits
from epd_operator.proxy_limits import SPELLINGS, Limits
from epd_operator.render import render
from epd_operator.resources import pool_name, proxy_container
from epd_operator.validation import SpecError, validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
IMAGE = "epd-operator:test"


def plan_of(example: str, **spec_changes):
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"].update(spec_changes)
    checked = validate(manifest["spec"])
    name = manifest["metadata"]["name"]
    (plan, *_) = render(checked, namespace="ns", name=name, uid="uid-1")
    return checked.spec, name, plan


def flags(container: dict):
    """The container's args as the real `epd-dataplane proxy` parses them."""
    assert container["command"] == ["epd-dataplane", "proxy"]
    return build_parser().parse_args(["proxy", *container["args"]])


def test_a_unit_proxy_primes_on_its_own_encoders_takes_the_front_port_and_forwards_to_the_router():
    spec, name, plan = plan_of("encoder-prefill-decode.yaml")
    container = proxy_container(spec, name, plan, IMAGE)
    args = flags(container)
    assert args.encoder == [f"http://127.0.0.1:{e.port}" for e in plan.unit_encoders] and args.encoder
    router = f"http://127.0.0.1:{plan.router.port}"
    assert (args.upstream, args.port, args.placement) == (router, spec.ports.router, "Unit")
    assert plan.router.port == spec.ports.router_loopback
    assert args.request_timeout_seconds == spec.router.request_timeout_seconds
    assert args.prime_timeout_seconds == spec.proxy.prime_timeout_seconds
    # The front Service's targetPort is the name `http`: the proxy holds it.
    assert {"name": "http", "containerPort": spec.ports.router} in container["ports"]
    assert container["image"] == IMAGE
    # Ready once a request goes all the way (through it to the router); alive is its own /health.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": args.port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": args.metrics_port}
    assert {"name": "proxy-metrics", "containerPort": args.metrics_port} in container["ports"]
    assert container["securityContext"]["readOnlyRootFilesystem"]
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "96Mi"}


def test_a_unit_without_router_fronts_its_only_consumer():
    spec, name, plan = plan_of("encoder-regular.yaml")
    assert plan.router is None
    (consumer,) = plan.consumers
    args = flags(proxy_container(spec, name, plan, IMAGE))
    assert (args.port, args.upstream) == (spec.ports.router, f"http://127.0.0.1:{consumer.port}")


def test_a_pools_proxy_finds_the_pool_by_dns_and_carries_transfer_params():
    spec, name, plan = plan_of("encoder-pools.yaml")
    args = flags(proxy_container(spec, name, plan, IMAGE))
    ports = ",".join(str(e.port) for e in plan.encoders)
    # The pod's resolver completes the name with its namespace (its search path).
    assert args.encoders_dns == f"{pool_name(name, plan.name)}:{ports}"
    assert (args.encoder, args.placement) == ([], "Pools")


def test_the_proxy_timeouts_and_resources_come_from_spec_proxy():
    spec, name, plan = plan_of(
        "encoder-regular.yaml",
        proxy={"requestTimeoutSeconds": 90, "primeTimeoutSeconds": 30, "resources": {"requests": {"cpu": "1"}}},
    )
    container = proxy_container(spec, name, plan, IMAGE)
    args = flags(container)
    assert (args.request_timeout_seconds, args.prime_timeout_seconds) == (90, 30)
    assert args.prime_attempt_timeout_seconds is None  # unset: the proxy's own default
    assert (args.eject_after_failures, args.ejection_base_seconds, args.ejection_max_seconds) == (None, None, None)
    tuned = {"primeAttemptTimeoutSeconds": 20, "outlierDetection": {"consecutiveFailures": 0, "maxEjectionSeconds": 90}}
    spec, name, plan = plan_of("encoder-regular.yaml", proxy=tuned)
    args = flags(proxy_container(spec, name, plan, IMAGE))
    assert (args.prime_attempt_timeout_seconds, args.eject_after_failures, args.ejection_max_seconds) == (20, 0, 90)
    assert args.ejection_base_seconds is None  # unset: the proxy's default
    assert container["resources"]["requests"]["cpu"] == "1"


def test_a_model_without_encoders_has_no_proxy_and_its_router_keeps_the_front_port():
    """Nothing to prime on: its consumers encode by design (an aggregated deployment), and a
    proxy with no encoder would not start (`--encoder` or `--encoders-dns` is required)."""
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    model = manifest["spec"]["models"][0]
    model["serverGroups"] = [g for g in model["serverGroups"] if g["workerType"] != "encoder"]
    checked = validate(manifest["spec"])
    (plan,) = render(checked, namespace="ns", name="pd", uid="uid-1")
    assert plan.proxy is None and plan.router is not None
    assert plan.router.port == checked.spec.ports.router == plan.front_port
    assert plan.router.args[plan.router.args.index("--host") + 1] == "0.0.0.0"


def test_the_proxy_bounds_come_from_spec_proxy_and_unset_ones_are_the_proxys_defaults():
    spec, name, plan = plan_of("encoder-regular.yaml")
    args = flags(proxy_container(spec, name, plan, IMAGE))
    assert proxy_limits(args) == Limits()  # nothing rendered: the proxy's own defaults
    bounds = {
        "maxRequestBytes": 8 << 20,
        "maxBufferedBytes": 256 << 20,
        "maxMediaParts": 4,
        "maxJsonDepth": 20,
        "maxHeaderBytes": 4096,
        "maxHeaders": 50,
        "keepaliveTimeoutSeconds": 30,
        "bodyTimeoutSeconds": 10,
        "primeConcurrencyPerRequest": 2,
    }
    spec, name, plan = plan_of("encoder-regular.yaml", proxy=bounds)
    limits = proxy_limits(flags(proxy_container(spec, name, plan, IMAGE)))
    assert limits == Limits(8 << 20, 256 << 20, 4, 20, 4096, 50, 30, 10, 2)
    assert set(bounds) == {field for field, _ in SPELLINGS.values()}  # every bound is a spec.proxy field


@pytest.mark.parametrize(
    ("limit", "parts"),
    [({"image": 3, "video": {"count": 2, "num_frames": 8}}, 5), ('{"image": 6}', 6), ({"image": 0}, 32)],
    ids=["dict", "json text", "no media: the default"],
)
def test_media_parts_default_to_the_consumers_limit_mm_per_prompt(limit, parts):
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    for group in manifest["spec"]["models"][0]["serverGroups"]:
        if group["workerType"] == "regular":
            group["overrides"] = {"limit_mm_per_prompt": limit}
    checked = validate(manifest["spec"])
    (plan, *_) = render(checked, namespace="ns", name="x", uid="uid-1")
    assert proxy_limits(flags(proxy_container(checked.spec, "x", plan, IMAGE))).max_media_parts == parts


def test_a_memory_budget_that_cannot_hold_one_largest_body_is_refused():
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["proxy"] = {"maxRequestBytes": 64 << 20, "maxBufferedBytes": 128 << 20}
    with pytest.raises(
        SpecError, match=r"spec.proxy .*maxBufferedBytes .* must hold what one body of maxRequestBytes reserves"
    ):
        validate(manifest["spec"])
