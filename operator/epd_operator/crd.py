"""Generate the EPDDeployment CustomResourceDefinition from the pydantic models.

The structural OpenAPI schema comes from the models' JSON schema; the CEL rules come from the
layout table in `validation.py`. `make crds` writes the result to `crds/`; a test fails when the
committed file drifts.
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import yaml

from . import api
from .validation import (
    DRAIN_WITHIN_GRACE,
    HEADLESS_NEEDS_CLUSTER_IP,
    LAYOUT_RULES,
    MAX_ENGINES,
    MAX_NAME_LENGTH,
    MAX_UNAVAILABLE_PERCENT,
    NAME_PATTERN,
    PLACEMENT_RULES,
    PRIME_ATTEMPT_WITHIN_PRIME,
    SUPPORTED_VLLM_VERSIONS,
)

CRD_FILE = "crds/epddeployments.epd.vime.dev.yaml"


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve $refs and turn JSON-schema idioms into the structural subset Kubernetes accepts."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _inline(copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]]), defs)
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**target, **extra}, defs)
    node = {k: _inline(v, defs) for k, v in node.items() if k not in ("title", "$defs")}
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        options = [o for o in any_of if o.get("type") != "null"]
        nullable = len(options) < len(any_of)
        if len(options) == 1:
            node = {**options[0], **node}
        elif {o.get("type") for o in options} == {"integer", "string"}:
            # A string's own rules stay (an apiserver applies them to strings only), as
            # controller-gen keeps a resource.Quantity's pattern: "two" is no quantity.
            text = next(o for o in options if o.get("type") == "string")
            rules = {k: v for k, v in text.items() if k in ("pattern", "maxLength", "minLength")}
            node = {"x-kubernetes-int-or-string": True, **rules, **node}
        else:
            raise ValueError(f"cannot express anyOf {any_of} structurally")
        if nullable:
            node["nullable"] = True
    if node.get("type") == "object":
        extra = node.get("additionalProperties")
        if extra is True or (extra is None and "properties" not in node):
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        elif extra is False:
            node.pop("additionalProperties")
        elif "properties" in node and extra is not None:
            # An object with declared fields that also keeps unknown ones (e.g. EnvVar).
            node.pop("additionalProperties")
            node["x-kubernetes-preserve-unknown-fields"] = True
    for bound in ("exclusiveMinimum", "exclusiveMaximum"):
        # JSON Schema's number; OpenAPI v3 (Kubernetes) takes the bound and a boolean.
        if isinstance(node.get(bound), int | float) and not isinstance(node[bound], bool):
            node["minimum" if bound == "exclusiveMinimum" else "maximum"] = node[bound]
            node[bound] = True
    if node.get("default") is None:
        node.pop("default", None)
    if node.get("type") == "string" and "enum" in node:
        # CEL cost estimates need bounded strings; an enum is as long as its longest value.
        node["maxLength"] = max(len(v) for v in node["enum"])
    return node


def _object_defaults(model: type[api.Schema], schema: dict[str, Any]) -> None:
    """Default nested objects to {} so the API server fills in their own field defaults."""
    for name, field in model.model_fields.items():
        prop = schema["properties"][field.alias or name]
        annotation = field.annotation
        item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else None
        if isinstance(annotation, type) and issubclass(annotation, api.Schema):
            if field.default_factory is not None:
                prop["default"] = {}
            _object_defaults(annotation, prop)
        elif isinstance(item, type) and issubclass(item, api.Schema):
            _object_defaults(item, prop["items"])


def _has(worker_type: str) -> str:
    return f"self.serverGroups.exists(g, g.workerType == '{worker_type}')"


def _layout_cel_rules() -> list[dict[str, str]]:
    rules = []
    for rule in LAYOUT_RULES:
        terms = [_has(t) for t in sorted(rule.present)]
        if rule.any_of:
            terms.append("(" + " || ".join(_has(t) for t in sorted(rule.any_of)) + ")")
        terms += [f"!{_has(t)}" for t in sorted(rule.absent)]
        rules.append(
            {
                "rule": "!(" + " && ".join(terms) + ")",
                "messageExpression": f'"model \'" + self.name + "\': {rule.message}"',
                "reason": "FieldValueInvalid",
            }
        )
    return rules


def _placement_cel_rules() -> list[dict[str, str]]:
    return [
        {
            "rule": rule.cel,
            "messageExpression": f'"model \'" + self.name + "\': {rule.message}"',
            "reason": "FieldValueInvalid",
        }
        for rule in PLACEMENT_RULES
    ]


def _add_cel_rules(spec: dict[str, Any]) -> None:
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    # Majors are all 0 today; the alternation lists the supported minors, e.g. (32|33).
    minors = "|".join(v.split(".", 1)[1] for v in SUPPORTED_VLLM_VERSIONS)
    spec["x-kubernetes-validations"] = [
        {
            "rule": f"has(self.vllmVersion) ? self.vllmVersion.matches('^v?0\\\\.({minors})([.+-].*)?$') "
            f": self.image.matches(':v?0\\\\.({minors})([.+-][^/:@]*)?(@.*)?$')",
            "message": f"unsupported or unknown vLLM version: set spec.vllmVersion to one of {supported}, "
            "or use an image tagged with one of them",
        },
        {
            "rule": "self.models.map(m, m.serverGroups.map(g, g.numGpus / "
            "(has(g.numGpusPerEngine) ? g.numGpusPerEngine : 1)).sum()).sum() <= " + str(MAX_ENGINES),
            "message": f"more than {MAX_ENGINES} engines in all: lower numGpus, raise numGpusPerEngine, or split the "
            "models over several EPDDeployments",
            "fieldPath": ".models",
        },
        {
            "rule": "!has(self.maxUnavailable) || (type(self.maxUnavailable) == int ? self.maxUnavailable >= 1 "
            f": string(self.maxUnavailable).matches('{MAX_UNAVAILABLE_PERCENT}'))",
            "message": "spec.maxUnavailable must be a unit count of 1 or more, or a percentage from 1% to 100%",
            "fieldPath": ".maxUnavailable",
        },
    ]
    spec["properties"]["service"]["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.headless) || !self.headless || !has(self.type) || self.type == 'ClusterIP'",
            "message": HEADLESS_NEEDS_CLUSTER_IP,
            "fieldPath": ".headless",
        }
    ]
    spec["properties"]["termination"]["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.drainSeconds) || !has(self.gracePeriodSeconds) || "
            "self.drainSeconds < self.gracePeriodSeconds",
            "message": DRAIN_WITHIN_GRACE,
            "fieldPath": ".drainSeconds",
        }
    ]
    spec["properties"]["proxy"]["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.primeAttemptTimeoutSeconds) || !has(self.primeTimeoutSeconds) || "
            "self.primeAttemptTimeoutSeconds <= self.primeTimeoutSeconds",
            "message": PRIME_ATTEMPT_WITHIN_PRIME,
            "fieldPath": ".primeAttemptTimeoutSeconds",
        }
    ]
    models = spec["properties"]["models"]
    models["x-kubernetes-list-type"] = "map"
    models["x-kubernetes-list-map-keys"] = ["name"]
    models["items"]["x-kubernetes-validations"] = _layout_cel_rules() + _placement_cel_rules()
    groups = models["items"]["properties"]["serverGroups"]["items"]
    groups["x-kubernetes-validations"] = [
        {
            "rule": "self.numGpus % self.numGpusPerEngine == 0",
            "message": "numGpus must be a multiple of numGpusPerEngine",
        }
    ]
    volume = spec["properties"]["volumes"]["items"]
    # Declared so that CEL can refer to it; the rest of a volume stays schemaless.
    volume["properties"] = {
        "hostPath": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "description": "Not allowed: the EC store and model caches must not touch the host.",
        }
    }
    volume["x-kubernetes-validations"] = [
        {"rule": "!has(self.hostPath)", "message": "hostPath volumes are not allowed: use a PVC or emptyDir"}
    ]


def _schema(model: type[api.Schema]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    _object_defaults(model, schema)
    return schema


def build_crd() -> dict[str, Any]:
    spec = _schema(api.EPDDeploymentSpec)
    _add_cel_rules(spec)
    status = _schema(api.EPDDeploymentStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": api.SHORT_NAMES,
                "categories": ["all", "vllm"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        # kubectl scale, HorizontalPodAutoscaler and KEDA scale the units per model.
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
                        {"name": "Updated", "type": "string", "jsonPath": ".status.updated", "priority": 1},
                        {
                            "name": "Fallback-Encodes",
                            "type": "integer",
                            "jsonPath": ".status.fallbackEncodes",
                            "priority": 1,
                        },
                        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                        {"name": "Models", "type": "integer", "jsonPath": ".status.modelCount"},
                        {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            # Every child's name and labels carry the object's name.
                            "x-kubernetes-validations": [
                                {
                                    "rule": f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && "
                                    f"self.metadata.name.matches('{NAME_PATTERN}')",
                                    "message": f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} "
                                    "characters (lowercase letters, digits and '-', starting with a letter): it names "
                                    "the Services and labels the pods",
                                }
                            ],
                            "description": "EPDDeployment serves multimodal models with vLLM "
                            "encoder-prefill disaggregation: encoder engines write image "
                            "embeddings to a node-local store that the language engines read.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd_yaml() -> str:
    header = "# Generated by `make crds` from operator/epd_operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def field_reference_markdown() -> str:
    """A table of every spec field (path, type, default, description) for docs/api.md."""
    rows = ["| field | type | default | description |", "| --- | --- | --- | --- |"]

    def walk(node: dict[str, Any], path: str) -> None:
        for key, prop in node.get("properties", {}).items():
            kind = prop.get("type", "int-or-string" if prop.get("x-kubernetes-int-or-string") else "")
            if kind == "array":
                kind = f"[]{prop['items'].get('type', '')}"
            if "enum" in prop:
                kind = " \\| ".join(prop["enum"])
            default = prop.get("default")
            default_text = "" if default is None or default == {} else f"`{json.dumps(default)}`"
            description = prop.get("description", "").replace("|", "\\|").replace("\n", " ")
            rows.append(f"| `{path}{key}` | {kind} | {default_text} | {description} |")
            target = prop["items"] if prop.get("type") == "array" else prop
            suffix = "[]." if prop.get("type") == "array" else "."
            if "properties" in target and key != "volumes":
                walk(target, f"{path}{key}{suffix}")

    walk(build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec.")
    return "\n".join(rows) + "\n"


REFERENCE_MARKER = "<!-- generated field reference: make crds -->"


def write_api_reference(path: str) -> None:
    """Replace everything after the marker in docs/api.md with the current field reference."""
    with open(path) as fh:
        head = fh.read().split(REFERENCE_MARKER, 1)[0]
    with open(path, "w") as fh:
        fh.write(f"{head}{REFERENCE_MARKER}\n\n{field_reference_markdown()}")
