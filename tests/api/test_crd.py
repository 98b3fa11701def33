"""The committed CRD is generated from the pydantic models and never drifts from them."""

from pathlib import Path

import yaml

from epd_operator.crd import CRD_FILE, build_crd, render_crd_yaml

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_the_models():
    committed = (ROOT / CRD_FILE).read_text()
    assert committed == render_crd_yaml(), "crds/ drifted from api.py: run `make crds` and commit"


def test_chart_ships_the_same_crd():
    chart_crd = ROOT / "charts/epd-operator/crds" / Path(CRD_FILE).name
    assert chart_crd.read_text() == render_crd_yaml(), "chart CRD drifted: run `make crds` and commit"


def _schema():
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node, path="$"):
    yield path, node
    for key, value in node.get("properties", {}).items():
        yield from _walk(value, f"{path}.{key}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert "$ref" not in node and "anyOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_every_spec_field_is_described():
    spec = _schema()["properties"]["spec"]
    for path, node in _walk(spec):
        # List items are described by their list field.
        assert path.endswith("[]") or node.get("description"), f"{path} has no description (kubectl explain shows it)"


def test_open_maps_are_only_where_intended():
    spec = _schema()["properties"]["spec"]
    open_paths = {p for p, n in _walk(spec) if n.get("x-kubernetes-preserve-unknown-fields")}
    assert open_paths == {
        "$.env[]",
        "$.env[].valueFrom",
        "$.ecConnector.extraConfig",
        "$.kvConnector.extraConfig",
        "$.models[].serverGroups[].overrides",
        "$.models[].serverGroups[].env[]",
        "$.models[].serverGroups[].env[].valueFrom",
        "$.tolerations[]",
        "$.affinity",
        "$.imagePullSecrets[]",
        "$.volumes[]",
        "$.volumes[].hostPath",
        "$.volumeMounts[]",
        "$.models[].ecConnector.extraConfig",
        "$.models[].encoderPool.tolerations[]",
        "$.models[].encoderPool.affinity",
        "$.gateway.tolerations[]",
        "$.podSecurityContext",  # core types: the API server checks them in the pod
        "$.securityContext",
        "$.networkPolicy.clients[]",
        "$.networkPolicy.monitoring[]",
    }


def test_nested_objects_default_so_the_api_server_fills_their_fields():
    spec = _schema()["properties"]["spec"]["properties"]
    assert spec["ecConnector"]["default"] == {}
    assert spec["ecConnector"]["properties"]["pathPrefix"]["default"] == "vime-ec-"
    assert spec["replicas"]["default"] == 1


def test_layout_and_placement_rules_are_cel_on_each_model():
    from epd_operator.validation import LAYOUT_RULES, PLACEMENT_RULES

    models = _schema()["properties"]["spec"]["properties"]["models"]
    assert models["x-kubernetes-list-map-keys"] == ["name"]
    rules = [r["rule"] for r in models["items"]["x-kubernetes-validations"]]
    assert len(rules) == len(LAYOUT_RULES) + len(PLACEMENT_RULES)
    assert rules[len(LAYOUT_RULES) :] == [r.cel for r in PLACEMENT_RULES]


def test_placement_defaults_to_unit_and_the_pools_connector_to_eccpuconnector():
    model = _schema()["properties"]["spec"]["properties"]["models"]["items"]["properties"]
    assert model["placement"]["default"] == "Unit" and model["placement"]["enum"] == ["Unit", "Pools"]
    assert model["encoderReplicas"]["default"] == 1 and model["encoderReplicas"]["minimum"] == 0
    assert "default" not in model["ecConnector"]  # absent unless set: CEL tells a Unit model's apart
    assert model["ecConnector"]["properties"]["name"]["default"] == "ECCPUConnector"


def test_yaml_round_trips():
    assert yaml.safe_load(render_crd_yaml()) == build_crd()


def test_api_docs_carry_the_current_field_reference():
    from epd_operator.crd import field_reference_markdown

    assert field_reference_markdown() in (ROOT / "docs/api.md").read_text(), "run `make crds` and commit"
