"""Hypothesis strategies for EPDDeployment specs: valid ones, and valid ones broken on purpose.

`specs()` draws `Case`s: a raw `.spec` plus the names of the mutations applied to it. A
mutation in MUST_FAIL makes any spec invalid; the others (odd overrides, quantities, env names)
may or may not: for those only "no crash, and a clear message if refused" is checked.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from epd_operator.api import EPDDeploymentSpec
from epd_operator.engine_args import SUPPORTED_MINORS, known_engine_args
from epd_operator.validation import (
    GENERATION_ONLY,
    OWNED_ARGS,
    OWNED_WIRING,
    REFUSED_ARGS,
    ROUTER_KV_CONNECTORS,
    ROUTER_OWNED_FLAGS,
    ROUTER_SECRET_FLAGS,
    SECRET_ARGS,
    SUPPORTED_VLLM_VERSIONS,
)

VALID_LAYOUTS = (("encoder", "regular"), ("encoder", "prefill", "decode"), ("regular",), ("prefill", "decode"))
INVALID_LAYOUTS = (
    ("encoder",),
    ("encoder", "prefill"),
    ("encoder", "decode"),
    ("prefill",),
    ("decode",),
    ("regular", "prefill", "decode"),
    ("regular", "decode"),
    ("encoder", "regular", "prefill"),
)
# The minor after the newest supported one: no templates yet, so refused.
UNSUPPORTED_MINOR = f"0.{int(SUPPORTED_MINORS[-1].split('.')[1]) + 1}"
SUPPORTED_TAGS = ("v0.32.0", "v0.33.0", "v0.34.0", "0.32.1", "v0.33.1-cu129", "0.33.0+cpu", "0.34.2-cu130")
PD = {"prefill", "decode"}

# The API's own bound (it rose from 1,000 to 10,000 with the status moving units to EndpointSlices).
MAX_REPLICAS = next(m.le for m in EPDDeploymentSpec.model_fields["replicas"].metadata if hasattr(m, "le"))

MUST_FAIL = frozenset(
    {
        "unknown_field",
        "out_of_range",
        "bad_version",
        "broken_layout",
        "duplicate_model",
        "gpu_multiple",
        "host_path",
        "owned_override",
        "pooling_override",
        "kv_connector",
        "bad_model_name",
        "empty_string",
        "bad_shm_size",
        "port_clash",
        "headless_balancer",
    }
)


@dataclass(frozen=True)
class Case:
    spec: dict[str, Any]
    mutations: tuple[str, ...]

    @property
    def must_fail(self) -> bool:
        return bool(MUST_FAIL & set(self.mutations))


dns_labels = st.from_regex(r"[a-z]([-a-z0-9]{0,14}[a-z0-9])?", fullmatch=True)
# Engine arguments every supported version accepts: validation refuses any other name.
arg_keys = st.sampled_from(
    sorted(
        frozenset.intersection(*map(known_engine_args, SUPPORTED_VLLM_VERSIONS))
        - OWNED_ARGS.keys()
        - OWNED_WIRING.keys()
        - SECRET_ARGS.keys()
        - REFUSED_ARGS.keys()
        - GENERATION_ONLY.keys()  # valid with some values only (pooling_override)
        - {"fail_on_environ_validation"}  # true refuses the VLLM_* names vLLM does not read
    )
)
# A text that cannot reach a command line looking like a flag (validation refuses those).
plain_text = st.text(max_size=12).filter(lambda text: not re.match(r"^--?[A-Za-z]", text))
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**31), 2**31)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | plain_text
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(min_size=1, max_size=8), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def server_group(draw: st.DrawFn, worker_type: str) -> dict[str, Any]:
    per_engine = draw(st.integers(1, 4))
    group: dict[str, Any] = {"workerType": worker_type, "numGpus": per_engine * draw(st.integers(1, 3))}
    if per_engine > 1 or draw(st.booleans()):
        group["numGpusPerEngine"] = per_engine
    if draw(st.booleans()):
        group["overrides"] = draw(st.dictionaries(arg_keys, json_values, max_size=4))
    if draw(st.booleans()):
        group["env"] = [
            {"name": draw(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True)), "value": draw(st.text(max_size=10))}
        ]
    return group


@st.composite
def model(draw: st.DrawFn, name: str) -> dict[str, Any]:
    layout = draw(st.sampled_from(VALID_LAYOUTS))
    types = [*layout, *draw(st.lists(st.sampled_from(layout), max_size=2))]  # repeated types are fine
    entry: dict[str, Any] = {
        "name": name,
        "model": draw(st.sampled_from(["Qwen/Qwen2.5-VL-7B-Instruct", "m", "/models/x"])),
        "serverGroups": [draw(server_group(t)) for t in types],
    }
    if draw(st.booleans()):
        entry["servedModelName"] = draw(st.text(min_size=1, max_size=20))
    return entry


@st.composite
def valid_specs(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(dns_labels, min_size=1, max_size=3, unique=True))
    spec: dict[str, Any] = {
        "image": f"vllm/vllm-openai:{draw(st.sampled_from(SUPPORTED_TAGS))}",
        "models": [draw(model(n)) for n in names],
    }
    optional = {
        "replicas": st.integers(0, 1000),
        "vllmVersion": st.sampled_from(["0.32", "0.33", "0.34", "v0.33.1", "0.32.0-rc1", "v0.34.1"]),
        # Disjoint ranges, clear of the janitor's 9400: overlapping ports are an invalid spec.
        "ports": st.fixed_dictionaries(
            {},
            optional={
                "router": st.integers(1, 999),
                "engineBase": st.integers(10000, 20000),
                "nixlSideChannelBase": st.integers(30000, 40000),
            },
        ),
        "probes": st.fixed_dictionaries(
            {},
            optional={
                "periodSeconds": st.integers(1, 60),
                "startupTimeoutSeconds": st.integers(10, 7200),
                "failureThreshold": st.integers(1, 10),
            },
        ),
        "router": st.fixed_dictionaries(
            {},
            optional={
                "policy": st.sampled_from(["round_robin", "random", "cache_aware", "power_of_two", "consistent_hash"]),
                "requestTimeoutSeconds": st.integers(1, 86400),
                "extraArgs": st.lists(
                    st.text(max_size=10).filter(
                        lambda arg: arg.split("=", 1)[0] not in ROUTER_OWNED_FLAGS | ROUTER_SECRET_FLAGS
                    ),
                    max_size=3,
                ),
            },
        ),
        "shm": st.fixed_dictionaries({"sizeLimit": st.sampled_from(["16Gi", "512M", "1", "2.5Gi", "1e9"])}),
        "ecConnector": st.fixed_dictionaries(
            {},
            optional={
                "storageRoot": st.sampled_from(["/dev/shm", "/", "/x/y/"]),
                "pathPrefix": st.from_regex(r"[A-Za-z0-9._-]{1,12}", fullmatch=True),
                "extraConfig": st.dictionaries(arg_keys, json_values, max_size=2),
            },
        ),
        "kvConnector": st.fixed_dictionaries({"name": st.sampled_from(sorted(ROUTER_KV_CONNECTORS))}),
        "ecStorage": st.fixed_dictionaries(
            {}, optional={"maxBytes": st.integers(1, 2**40), "ttlSeconds": st.integers(1, 10**6)}
        ),
        "nodeSelector": st.dictionaries(dns_labels, dns_labels, max_size=2),
        "service": st.one_of(
            st.fixed_dictionaries({}, optional={"type": st.just("ClusterIP"), "headless": st.booleans()}),
            st.fixed_dictionaries(
                {"type": st.sampled_from(["NodePort", "LoadBalancer"])},
                optional={
                    "headless": st.just(False),
                    "annotations": st.dictionaries(dns_labels, st.text(max_size=10), max_size=2),
                },
            ),
        ),
        "env": st.lists(
            st.fixed_dictionaries(
                {"name": st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True), "value": st.text(max_size=10)}
            ),
            max_size=2,
        ),
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            spec[key] = draw(strategy)
    return spec


# ------------------------------------------------------------------------------ mutations


def _groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [g for m in spec["models"] for g in m["serverGroups"]]


@st.composite
def _unknown_field(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    targets = [spec, *spec["models"], *_groups(spec)]
    target = draw(st.sampled_from(targets))
    key = draw(st.sampled_from(["numGPUs", "replica", "worker_type", "servergroups", "extra", "Image", "x"]))
    if key not in target:
        target[key] = draw(json_leaves)
    else:
        target["unknownField"] = 1


@st.composite
def _out_of_range(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    group = draw(st.sampled_from(_groups(spec)))
    choice = draw(st.sampled_from(["numGpus", "numGpusPerEngine", "replicas", "router", "engineBase", "timeout"]))
    if choice == "numGpus":
        group["numGpus"] = draw(st.sampled_from([0, -1, 1025]))
    elif choice == "numGpusPerEngine":
        group["numGpusPerEngine"] = draw(st.sampled_from([0, 65]))
    elif choice == "replicas":
        spec["replicas"] = draw(st.sampled_from([-1, MAX_REPLICAS + 1]))
    elif choice == "router":
        spec.setdefault("ports", {})["router"] = draw(st.sampled_from([0, 65536]))
    elif choice == "engineBase":
        spec.setdefault("ports", {})["engineBase"] = draw(st.sampled_from([0, 65001]))
    else:
        spec.setdefault("probes", {})["startupTimeoutSeconds"] = draw(st.sampled_from([0, 9]))


@st.composite
def _bad_version(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    if draw(st.booleans()):
        spec["vllmVersion"] = draw(st.sampled_from(["0.31", "1.0", f"{UNSUPPORTED_MINOR}.0", "v1.33", "0.9"]))
    else:
        spec.pop("vllmVersion", None)
        spec["image"] = draw(
            st.sampled_from(
                [
                    "vllm/vllm-openai:latest",
                    "vllm/vllm-openai",
                    "vllm:v0.31.0",
                    "vllm/vllm-openai@sha256:abc",
                    f"vllm:{UNSUPPORTED_MINOR}",
                    "host:5000/vllm",
                ]
            )
        )


@st.composite
def _broken_layout(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    target = draw(st.sampled_from(spec["models"]))
    target["serverGroups"] = [{"workerType": t, "numGpus": 1} for t in draw(st.sampled_from(INVALID_LAYOUTS))]


@st.composite
def _duplicate_model(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    spec["models"].append(copy.deepcopy(draw(st.sampled_from(spec["models"]))))


@st.composite
def _gpu_multiple(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    group = draw(st.sampled_from(_groups(spec)))
    per = draw(st.integers(2, 4))
    group.update(numGpusPerEngine=per, numGpus=per * draw(st.integers(1, 3)) + draw(st.integers(1, per - 1)))


@st.composite
def _host_path(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    spec["volumes"] = [{"name": draw(dns_labels), "hostPath": {"path": "/data"}}]


@st.composite
def _owned_override(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    key = draw(st.sampled_from(sorted(OWNED_ARGS)))
    if draw(st.booleans()):
        key = key.replace("_", "-")  # vLLM takes both spellings, so must the check
    draw(st.sampled_from(_groups(spec))).setdefault("overrides", {})[key] = draw(json_leaves)


@st.composite
def _pooling_override(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    key, value = draw(
        st.sampled_from([("runner", "pooling"), ("runner", "draft"), ("convert", "embed"), ("convert", "classify")])
    )
    draw(st.sampled_from(_groups(spec))).setdefault("overrides", {})[key] = value


@st.composite
def _odd_override(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    key = draw(st.sampled_from(["", " ", "a b", "--x", "x=y", "ünïcode", "UPPER", "a-b_c", "ec_transfer_config"]))
    value = draw(json_values | st.sampled_from([2**70, -(2**63), "", [], {}, [[]], {"": None}]))
    draw(st.sampled_from(_groups(spec))).setdefault("overrides", {})[key] = value


@st.composite
def _port_clash(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    target = draw(st.sampled_from(spec["models"]))
    target["serverGroups"] = [{"workerType": t, "numGpus": 1} for t in ("encoder", "prefill", "decode")]
    base = draw(st.integers(10000, 60000))
    other = "nixlSideChannelBase" if draw(st.booleans()) else "router"  # E+P+D has a router
    spec["ports"] = {"engineBase": base, other: base + draw(st.integers(0, 2))}


@st.composite
def _kv_connector(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    target = draw(st.sampled_from(spec["models"]))
    target["serverGroups"] = [{"workerType": "prefill", "numGpus": 1}, {"workerType": "decode", "numGpus": 1}]
    spec["kvConnector"] = {"name": draw(st.sampled_from(["LMCacheConnectorV1", "P2pNcclConnector", "x"]))}


@st.composite
def _bad_model_name(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    draw(st.sampled_from(spec["models"]))["name"] = draw(st.sampled_from(["Actor", "a_b", "-a", "a-", "a" * 41, ""]))


@st.composite
def _empty_string(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    if draw(st.booleans()):
        spec["image"] = ""
    else:
        draw(st.sampled_from(spec["models"]))["model"] = ""


@st.composite
def _bad_shm_size(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    spec["shm"] = {"sizeLimit": draw(st.sampled_from(["lots", "16 Gi", "", "Gi", "100m"]))}


@st.composite
def _headless_balancer(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    spec["service"] = {"type": draw(st.sampled_from(["NodePort", "LoadBalancer"])), "headless": True}


@st.composite
def _odd_resources(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    quantity = draw(st.sampled_from(["two", "1.5", "-1", "0", "1e3", 4, "8Gi"]))
    draw(st.sampled_from(_groups(spec)))["resources"] = {"limits": {"cpu": quantity}}


@st.composite
def _odd_env(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    name = draw(st.sampled_from(["A=B", "1X", "with space", "ok_NAME", "ünï"]))
    spec["env"] = [{"name": name, "value": "v"}]


@st.composite
def _wrong_type(draw: st.DrawFn, spec: dict[str, Any]) -> None:
    group = draw(st.sampled_from(_groups(spec)))
    group["numGpus"] = draw(st.sampled_from([str(group["numGpus"]), float(group["numGpus"]), [1], {"n": 1}]))


MUTATIONS = {
    "unknown_field": _unknown_field,
    "out_of_range": _out_of_range,
    "bad_version": _bad_version,
    "broken_layout": _broken_layout,
    "duplicate_model": _duplicate_model,
    "gpu_multiple": _gpu_multiple,
    "host_path": _host_path,
    "owned_override": _owned_override,
    "pooling_override": _pooling_override,
    "odd_override": _odd_override,
    "port_clash": _port_clash,
    "kv_connector": _kv_connector,
    "bad_model_name": _bad_model_name,
    "empty_string": _empty_string,
    "bad_shm_size": _bad_shm_size,
    "headless_balancer": _headless_balancer,
    "odd_resources": _odd_resources,
    "odd_env": _odd_env,
    "wrong_type": _wrong_type,
}


@st.composite
def specs(draw: st.DrawFn, *, valid_share: float = 0.3) -> Case:
    """A valid spec, or (mostly) one with one to three mutations."""
    spec = draw(valid_specs())
    if draw(st.floats(0, 1)) < valid_share:
        return Case(spec, ())
    names = draw(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3, unique=True))
    for name in names:
        draw(MUTATIONS[name](spec))
    return Case(spec, tuple(names))
