"""Checks on the committed golden renders of the chart (no helm, no cluster needed).

test_chart.py proves the golden files are what `helm template` produces today.
"""

from __future__ import annotations

import pytest

from epd_operator.cli import build_parser

from .chart import (
    CHART,
    GOLDEN_CASES,
    documents,
    find,
    golden_path,
    operator_args,
    operator_roles,
    template,
    user_roles,
)

# Every rule the operator's ServiceAccount gets in the namespaces it watches, and why.
NAMESPACED_RULES = [
    # kopf watches EPDDeployments (indexes + event handlers); the operator never edits the spec.
    {"apiGroups": ["epd.vime.dev"], "resources": ["epddeployments"], "verbs": ["list", "watch"]},
    # The operator writes status through the status subresource only.
    {"apiGroups": ["epd.vime.dev"], "resources": ["epddeployments/status"], "verbs": ["patch"]},
    # Children carry ownerReferences with blockOwnerDeletion (kopf.adopt), which the
    # OwnerReferencesPermissionEnforcement admission plugin allows only with this.
    {"apiGroups": ["epd.vime.dev"], "resources": ["epddeployments/finalizers"], "verbs": ["update"]},
    # Units and their Services: watched (indexes), created (POST), server-side applied (a PATCH),
    # read once before the first apply to a child the operator created (its managedFields),
    # deleted when a model leaves the spec.
    {
        "apiGroups": ["apps"],
        "resources": ["statefulsets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # Each model's (and encoder pool's) PodDisruptionBudget, the same way.
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # ... and its NetworkPolicy.
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # spec.gateway: each model's EPD gateway (a Deployment) and the ServiceAccount, Role and
    # RoleBinding its pods share, written as the other children.
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {
        "apiGroups": ["rbac.authorization.k8s.io"],
        "resources": ["roles", "rolebindings"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # spec.gateway.inferencePool: each model's InferencePool, once its CRD is installed.
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # spec.autoscaling: the KEDA ScaledObjects, once KEDA is installed.
    {
        "apiGroups": ["keda.sh"],
        "resources": ["scaledobjects"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    # Granted to the gateways' Role, so held (an account grants only what it holds); never read.
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    # Unit pods: read for the status.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
    # A Pools model's unit pods: the encoders-ready readiness gate's condition, nothing else.
    {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
    # kopf posts Warning events (InvalidSpec); a StatefulSet lacking pods has its FailedCreate
    # Events read (why it cannot create them).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "list"]},
]
# get only of the children (kopf lists and watches; the operator reads from kopf's indexes), no
# update, no deletecollection, no escalate/bind/impersonate.
WRITE_AND_WATCH = {"get", "list", "watch", "create", "patch", "delete"}
# kopf watches CRDs in every mode, to notice CRD changes without a restart.
CRD_RULE = {
    "apiGroups": ["apiextensions.k8s.io"],
    "resources": ["customresourcedefinitions"],
    "verbs": ["list", "watch"],
}


@pytest.fixture(scope="module", params=sorted(GOLDEN_CASES))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, documents(golden_path(request.param).read_text())


def test_operator_args_are_accepted_by_the_real_cli(rendered):
    case, docs = rendered
    args = build_parser().parse_args(operator_args(docs))
    assert args.command == "run"
    if case == "default":
        assert args.all_namespaces and not args.namespace
        assert args.standalone and args.peering is None
    else:
        assert args.namespace == GOLDEN_CASES[case]["watchNamespaces"] and not args.all_namespaces
        assert args.peering == "epd-operator" and not args.standalone
    assert args.liveness == "http://0.0.0.0:8080/healthz"
    assert args.metrics_port == 9090
    assert args.janitor_scrape_interval == 30
    assert args.janitor_scrape_rate == GOLDEN_CASES[case].get("janitorScrape.rate", 10)


def test_pod_is_locked_down(rendered):
    _, docs = rendered
    (deployment,) = find(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 65532
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_probes_hit_kopfs_liveness_endpoint(rendered):
    _, docs = rendered
    (deployment,) = find(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    liveness = build_parser().parse_args(container["args"]).liveness
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    assert liveness.endswith(f":{port}/healthz")
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_single_replica_is_recreated_never_doubled():
    (deployment,) = find(documents(golden_path("default").read_text()), "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_all_namespaces_rbac_is_one_cluster_role_with_only_the_needed_rules():
    docs = documents(golden_path("default").read_text())
    assert not find(docs, "Role") and not find(docs, "RoleBinding")
    (role,) = operator_roles(docs)
    assert role["rules"] == [CRD_RULE, *NAMESPACED_RULES]
    (binding,) = find(docs, "ClusterRoleBinding")
    (sa,) = find(docs, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": sa["metadata"]["namespace"]}
    ]


def test_namespaced_rbac_is_a_role_per_watched_namespace():
    values = GOLDEN_CASES["namespaced"]
    docs = documents(golden_path("namespaced").read_text())
    (cluster_role,) = operator_roles(docs)
    # Nothing namespaced cluster-wide; kopf follows Namespaces in this mode (without the rule it
    # retries the forbidden list for about a minute at every start).
    namespaces_rule = {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]}
    assert cluster_role["rules"] == [CRD_RULE, namespaces_rule]
    roles = find(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(values["watchNamespaces"])
    peering_rule = {"apiGroups": ["kopf.dev"], "resources": ["kopfpeerings"], "verbs": ["list", "watch", "patch"]}
    for role in roles:
        assert role["rules"] == [*NAMESPACED_RULES, peering_rule]
    bindings = find(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(values["watchNamespaces"])
    peerings = find(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == sorted(values["watchNamespaces"])


def test_no_wildcards_and_no_secrets_anywhere():
    for case in GOLDEN_CASES:
        docs = documents(golden_path(case).read_text())
        users = [r["metadata"]["name"] for r in user_roles(docs)]
        for doc in docs:
            if doc["metadata"]["name"] in users:
                continue  # the users' roles: test_user_roles_aggregate_into_the_default_ones
            for rule in doc.get("rules", []):
                assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
                assert not {"secrets", "configmaps"} & set(rule["resources"]), rule
                allowed = {"update"} if rule["resources"] == ["epddeployments/finalizers"] else WRITE_AND_WATCH
                assert set(rule["verbs"]) <= allowed, rule


def test_every_object_carries_the_standard_labels():
    for case in GOLDEN_CASES:
        for doc in documents(golden_path(case).read_text()):
            labels = doc["metadata"]["labels"]
            assert labels["app.kubernetes.io/name"] == "epd-operator"
            assert labels["app.kubernetes.io/instance"] == "epd"
            assert labels["app.kubernetes.io/managed-by"] == "Helm"
            assert labels["helm.sh/chart"].startswith("epd-operator-")


def test_chart_ships_kopfs_peering_crds():
    crds = documents((CHART / "crds" / "kopf-peerings.kopf.dev.yaml").read_text())
    by_name = {c["metadata"]["name"]: c["spec"] for c in crds}
    assert by_name["clusterkopfpeerings.kopf.dev"]["scope"] == "Cluster"
    assert by_name["kopfpeerings.kopf.dev"]["scope"] == "Namespaced"
    for spec in by_name.values():
        (version,) = spec["versions"]
        assert version["name"] == "v1" and version["served"] and version["storage"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True  # kopf's keep-alives live there


def test_user_roles_aggregate_into_the_default_ones():
    docs = documents(golden_path("default").read_text())
    edit, view = sorted(user_roles(docs), key=lambda r: r["metadata"]["name"])
    assert edit["metadata"]["name"].endswith("-edit") and view["metadata"]["name"].endswith("-view")
    labels = edit["metadata"]["labels"]
    assert (
        labels["rbac.authorization.k8s.io/aggregate-to-edit"]
        == labels["rbac.authorization.k8s.io/aggregate-to-admin"]
        == "true"
    )
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {"create", "update", "patch", "delete"} <= set(edit["rules"][0]["verbs"])
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in view["rules"])
    for role in (edit, view):  # nothing but EPDDeployments: the operator makes the pods
        assert {g for rule in role["rules"] for g in rule["apiGroups"]} == {"epd.vime.dev"}
    no_rbac = documents(template({"rbac.create": False}).stdout)
    assert not find(no_rbac, "ClusterRole")
