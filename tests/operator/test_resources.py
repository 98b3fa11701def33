"""Desired objects are pure functions of the spec: checked without a cluster."""

from pathlib import Path

import pytest
import yaml

from epd_dataplane.cli import build_parser as dataplane_parser
from epd_operator.render import render
from epd_operator.resources import (
    ENGINE_LIVENESS_SOURCE,
    PROXY_METRICS_PORT,
    TMP_VOLUME,
    child_name,
    desired_children,
    is_headless,
)
from epd_operator.validation import SpecError, validate

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
IMAGE = "epd-operator:test"


def children_of(example: str, **spec_changes):
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"].update(spec_changes)
    checked = validate(manifest["spec"])
    name = manifest["metadata"]["name"]
    return desired_children(checked.spec, name, render(checked, namespace="ns", name=name, uid="uid-1"), IMAGE)


def test_a_statefulset_two_services_and_a_disruption_budget_per_model_and_a_network_policy():
    kinds = [(c["kind"], c["metadata"]["name"]) for c in children_of("multi-model-overrides.yaml")]
    assert kinds == [
        ("StatefulSet", "rl-rollout-actor"),
        ("Service", "rl-rollout-actor-units"),
        ("Service", "rl-rollout-actor"),
        ("PodDisruptionBudget", "rl-rollout-actor"),
        ("StatefulSet", "rl-rollout-reward"),
        ("Service", "rl-rollout-reward-units"),
        ("Service", "rl-rollout-reward"),
        ("PodDisruptionBudget", "rl-rollout-reward"),
        ("NetworkPolicy", "rl-rollout"),
    ]


def test_max_unavailable_bounds_disruptions_and_rollouts():
    children = children_of("encoder-regular.yaml", maxUnavailable="50%")
    sts, budget = children[0], children[3]
    assert budget["spec"]["maxUnavailable"] == "50%"
    assert budget["spec"]["selector"] == sts["spec"]["selector"], "the budget covers exactly the model's units"
    assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "50%"}}
    assert children_of("encoder-regular.yaml")[3]["spec"]["maxUnavailable"] == 1  # the default


def test_encoders_are_sidecars_started_before_consumers():
    sts = children_of("encoder-regular.yaml")[0]
    pod = sts["spec"]["template"]["spec"]
    assert [(c["name"], c["restartPolicy"]) for c in pod["initContainers"]] == [("encoder-0", "Always")]
    assert [c["name"] for c in pod["containers"]] == ["regular-0", "proxy", "janitor"]
    startup = pod["initContainers"][0]["startupProbe"]
    # Default 1800 s of model loading at a 10 s period.
    assert startup["failureThreshold"] * startup["periodSeconds"] == 1800


def test_the_router_gets_the_consumers_loading_time_before_its_liveness_probe_counts():
    """vllm-router refuses connections until its workers answer: without a startupProbe the
    kubelet killed it while the consumers loaded (seen on the real node). Behind the proxy it
    has no probe at all (test below)."""
    pod = children_of("encoder-prefill-decode.yaml", proxy={"enabled": False})[0]["spec"]["template"]["spec"]
    (router,) = [c for c in pod["containers"] if c["name"] == "router"]
    (prefill,) = [c for c in pod["containers"] if c["name"] == "prefill-0"]
    assert router["startupProbe"]["httpGet"] == {"path": "/health", "port": router["ports"][0]["containerPort"]}
    window = router["startupProbe"]["failureThreshold"] * router["startupProbe"]["periodSeconds"]
    assert window == prefill["startupProbe"]["failureThreshold"] * prefill["startupProbe"]["periodSeconds"] == 1800


def test_every_engine_shares_one_memory_backed_shm_and_gets_its_gpus():
    sts = children_of("multi-model-overrides.yaml")[0]
    pod = sts["spec"]["template"]["spec"]
    assert pod["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}
    engines = [
        *pod["initContainers"],
        *[c for c in pod["containers"] if c["name"] not in ("router", "proxy", "janitor")],
    ]
    assert [c["name"] for c in engines] == ["encoder-0", "encoder-1", "regular-0", "regular-1"]
    assert [c["resources"]["limits"]["nvidia.com/gpu"] for c in engines] == [1, 1, 2, 2]
    for container in engines:
        assert container["volumeMounts"][:2] == [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "models", "mountPath": "/models", "readOnly": True},
        ]
    ports = [p["containerPort"] for c in pod["initContainers"] + pod["containers"] for p in c["ports"]]
    assert len(ports) == len(set(ports))


def test_router_only_with_several_consumers_and_front_service_targets_it():
    actor, _, actor_front, _, reward, _, reward_front, _, _policy = children_of("multi-model-overrides.yaml")
    actor_names = [c["name"] for c in actor["spec"]["template"]["spec"]["containers"]]
    assert actor_names == ["regular-0", "regular-1", "router", "proxy", "janitor"]
    router, proxy = actor["spec"]["template"]["spec"]["containers"][2:4]
    # The EPD proxy holds the front port's name; the router serves the proxy on the loopback.
    assert router["ports"] == [{"name": "router", "containerPort": 8001}]
    assert {"name": "http", "containerPort": 8000} in proxy["ports"]
    # Text-only: no encoder, so nothing for a proxy to prime on, no EC store, no janitor.
    assert [c["name"] for c in reward["spec"]["template"]["spec"]["containers"]] == ["regular-0"]
    assert (
        "initContainers" not in reward["spec"]["template"]["spec"]
        or not reward["spec"]["template"]["spec"]["initContainers"]
    )
    for front in (actor_front, reward_front):
        assert [p["targetPort"] for p in front["spec"]["ports"]] == ["http"]


def test_the_front_service_takes_its_type_annotations_and_headlessness_from_the_spec():
    _, units, front, _, _policy = children_of("encoder-regular.yaml")
    assert front["spec"]["type"] == "ClusterIP" and "clusterIP" not in front["spec"], "the API server allocates one"
    assert "annotations" not in front["metadata"]
    _, _, front, _, _policy = children_of(
        "encoder-regular.yaml", service={"type": "LoadBalancer", "annotations": {"lb.example/internal": "true"}}
    )
    assert front["spec"]["type"] == "LoadBalancer"
    assert front["metadata"]["annotations"] == {"lb.example/internal": "true"}
    _, headless_units, front, _, _policy = children_of("encoder-regular.yaml", service={"headless": True})
    assert front["spec"]["clusterIP"] == "None" and is_headless(front)
    assert headless_units == units, "the units' Service is headless either way, and nothing else changes"


def test_user_env_replaces_rendered_env_of_the_same_name():
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    manifest["spec"]["env"] = [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ]
    checked = validate(manifest["spec"])
    sts = desired_children(checked.spec, "pd", render(checked, namespace="ns", name="pd", uid="u"), IMAGE)[0]
    prefill = sts["spec"]["template"]["spec"]["containers"][0]
    hosts = [e for e in prefill["env"] if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert hosts == [{"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "0.0.0.0"}]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in prefill["env"]


def test_pod_level_knobs_pass_through():
    sts = children_of(
        "encoder-regular.yaml",
        nodeSelector={"gpu": "h100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        priorityClassName="rollout",
        serviceAccountName="vllm",
        imagePullSecrets=[{"name": "regcred"}],
    )[0]
    pod = sts["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("rollout", "vllm")
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_long_names_are_shortened_stably_within_limits():
    name = child_name("a" * 60, "actor")
    assert len(name) <= 52 and name == child_name("a" * 60, "actor") and name != child_name("a" * 60, "critic")
    assert child_name("short", "actor") == "short-actor"


# --------------------------------------------------------------------------- placement Pools


def pools_children(**model_changes):
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["models"][0].update(model_changes)
    checked = validate(manifest["spec"])
    name = manifest["metadata"]["name"]
    children = desired_children(checked.spec, name, render(checked, namespace="ns", name=name, uid="uid-1"), IMAGE)
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_pools_model_gets_an_encoder_pool_of_its_own():
    children = pools_children()
    assert list(children) == [
        ("StatefulSet", "qwen-vl-pools-default"),
        ("Service", "qwen-vl-pools-default-units"),
        ("Service", "qwen-vl-pools-default"),
        ("PodDisruptionBudget", "qwen-vl-pools-default"),
        ("StatefulSet", "qwen-vl-pools-default-encoders"),
        ("Service", "qwen-vl-pools-default-encoders"),
        ("PodDisruptionBudget", "qwen-vl-pools-default-encoders"),
        ("NetworkPolicy", "qwen-vl-pools"),
    ]
    budget = children[("PodDisruptionBudget", "qwen-vl-pools-default-encoders")]
    assert budget["spec"]["selector"] == children[("StatefulSet", "qwen-vl-pools-default-encoders")]["spec"]["selector"]
    units, pool = (
        children[("StatefulSet", "qwen-vl-pools-default")],
        children[("StatefulSet", "qwen-vl-pools-default-encoders")],
    )
    assert units["spec"]["replicas"] == 3 and pool["spec"]["replicas"] == 2
    assert pool["spec"]["serviceName"] == "qwen-vl-pools-default-encoders"
    unit_pod, pool_pod = units["spec"]["template"], pool["spec"]["template"]
    # The unit: today's pod minus the encoders and the janitor (with its proxy, priming on the
    # pool), behind the readiness gate.
    assert not unit_pod["spec"]["initContainers"] and [c["name"] for c in unit_pod["spec"]["containers"]] == [
        "regular-0",
        "proxy",
    ]
    assert unit_pod["spec"]["readinessGates"] == [{"conditionType": "epd.vime.dev/encoders-ready"}]
    assert "epd.vime.dev/ec-storage-path" not in unit_pod["metadata"]["annotations"]
    # The pool pod: the encoders as plain containers (nothing in it waits for them), no gate, its own shm.
    (encoder,) = pool_pod["spec"]["containers"]
    assert (
        encoder["name"] == "encoder-0" and "restartPolicy" not in encoder and "initContainers" not in pool_pod["spec"]
    )
    assert "readinessGates" not in pool_pod["spec"]
    assert pool_pod["spec"]["volumes"][0] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    assert pool_pod["spec"]["affinity"]["podAntiAffinity"]  # encoderPool.affinity, not spec.affinity
    assert encoder["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8100}


def test_no_service_of_the_units_selects_a_pool_pod_and_the_pool_service_only_pool_pods():
    children = pools_children()
    unit_labels = children[("StatefulSet", "qwen-vl-pools-default")]["spec"]["template"]["metadata"]["labels"]
    pool_labels = children[("StatefulSet", "qwen-vl-pools-default-encoders")]["spec"]["template"]["metadata"]["labels"]
    for name in ("qwen-vl-pools-default", "qwen-vl-pools-default-units"):
        selector = children[("Service", name)]["spec"]["selector"]
        assert _selects(selector, unit_labels) and not _selects(selector, pool_labels), name
    units_sts = children[("StatefulSet", "qwen-vl-pools-default")]["spec"]["selector"]["matchLabels"]
    assert not _selects(units_sts, pool_labels)
    pool_service = children[("Service", "qwen-vl-pools-default-encoders")]
    assert _selects(pool_service["spec"]["selector"], pool_labels)
    assert not _selects(pool_service["spec"]["selector"], unit_labels)
    assert pool_service["spec"]["clusterIP"] == "None" and "publishNotReadyAddresses" not in pool_service["spec"]
    assert pool_service["spec"]["ports"] == [{"name": "encoder-0", "port": 8100, "targetPort": 8100, "protocol": "TCP"}]


def test_pool_encoders_announce_their_pod_ip_and_a_declared_side_channel_port():
    pool = pools_children(
        serverGroups=[{"workerType": "encoder", "numGpus": 2}, {"workerType": "regular", "numGpus": 1}]
    )
    containers = pool[("StatefulSet", "qwen-vl-pools-default-encoders")]["spec"]["template"]["spec"]["containers"]
    sides = []
    for container in containers:
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_EC_SIDE_CHANNEL_HOST"] == {
            "name": "VLLM_EC_SIDE_CHANNEL_HOST",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
        assert "VLLM_USE_V2_MODEL_RUNNER" not in env  # the example's vLLM 0.34 has only the V2 model runner
        side = next(p for p in container["ports"] if p["name"].startswith("ec-side-"))
        assert env["VLLM_EC_SIDE_CHANNEL_PORT"]["value"] == str(side["containerPort"])
        sides.append(side["containerPort"])
    assert sides == [5700, 5701]


def test_pool_engines_before_034_choose_the_v2_model_runner():
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["vllmVersion"] = "0.33"
    checked = validate(manifest["spec"])
    children = desired_children(checked.spec, "p", render(checked, namespace="ns", name="p", uid="u"), IMAGE)
    engines = [
        container
        for child in children
        if child["kind"] == "StatefulSet"
        for container in child["spec"]["template"]["spec"]["containers"]
        if container["name"].startswith(("encoder-", "regular-"))
    ]
    assert {c["name"] for c in engines} == {"encoder-0", "regular-0"}
    for container in engines:
        assert {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"} in container["env"], container["name"]


def test_user_env_still_wins_over_the_side_channel_host():
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    manifest["spec"]["models"][0]["serverGroups"][0]["env"] = [
        {"name": "VLLM_EC_SIDE_CHANNEL_HOST", "value": "enc.example"}
    ]
    checked = validate(manifest["spec"])
    children = desired_children(checked.spec, "p", render(checked, namespace="ns", name="p", uid="u"), IMAGE)
    (encoder,) = next(
        c for c in children if c["metadata"]["name"] == "p-default-encoders" and c["kind"] == "StatefulSet"
    )["spec"]["template"]["spec"]["containers"]
    assert [e for e in encoder["env"] if e["name"] == "VLLM_EC_SIDE_CHANNEL_HOST"] == [
        {"name": "VLLM_EC_SIDE_CHANNEL_HOST", "value": "enc.example"}
    ]


def test_encoder_pool_scheduling_falls_back_to_the_spec():
    manifest = yaml.safe_load((EXAMPLES / "encoder-pools.yaml").read_text())
    del manifest["spec"]["models"][0]["encoderPool"]
    manifest["spec"].update(nodeSelector={"gpu": "h100"}, tolerations=[{"key": "gpu", "operator": "Exists"}])
    checked = validate(manifest["spec"])
    children = desired_children(checked.spec, "p", render(checked, namespace="ns", name="p", uid="u"), IMAGE)
    pool = next(c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "p-default-encoders")
    pod = pool["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert "affinity" not in pod and pod["volumes"][0]["emptyDir"]["sizeLimit"] == "16Gi"


def _pod_specs(example: str) -> list[dict]:
    """The pod template of every StatefulSet (units, and encoder pools) of an example."""
    return [c["spec"]["template"]["spec"] for c in children_of(example) if c["kind"] == "StatefulSet"]


def test_engines_get_a_writable_home():
    # A uid with no passwd entry gets HOME=/, which it cannot write; vLLM keeps its caches there.
    for example in ("encoder-regular.yaml", "encoder-pools.yaml"):
        for pod in _pod_specs(example):
            volumes = {v["name"]: v for v in pod["volumes"]}
            engines = [c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["command"][0] == "vllm"]
            assert engines
            for container in engines:
                home = next(e["value"] for e in container["env"] if e["name"] == "HOME")
                (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == home]
                assert volumes[mount["name"]] == {"name": mount["name"], "emptyDir": {}}, container["name"]


# --------------------------------------------------------------------------- probes, shutdown, requests, security


def unit_pod(example: str = "encoder-prefill-decode.yaml", **spec_changes) -> dict:
    return next(c for c in children_of(example, **spec_changes) if c["kind"] == "StatefulSet")["spec"]["template"][
        "spec"
    ]


def containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def test_liveness_is_laxer_than_readiness_on_every_probed_container():
    for container in containers(unit_pod()):
        if "readinessProbe" not in container:
            continue  # the janitor, the router on the loopback
        ready, live = container["readinessProbe"], container["livenessProbe"]
        if "exec" in live:  # an engine's: /health and its progress, on the same port (below)
            assert str(ready["httpGet"]["port"]) in live["exec"]["command"]
        elif container["name"] != "proxy":  # its readiness goes through the front port (below)
            assert ready["httpGet"] == live["httpGet"] and ready["httpGet"] is not live["httpGet"]
        patience = live["failureThreshold"] * live["periodSeconds"] + live["timeoutSeconds"]
        assert patience > ready["failureThreshold"] * ready["periodSeconds"] + ready["timeoutSeconds"]
        assert live["timeoutSeconds"] > ready["timeoutSeconds"], container["name"]


def test_every_engine_runs_the_stall_check_as_its_liveness_probe_with_a_record_of_its_own():
    pod = unit_pod()
    engines = [c for c in containers(pod) if c["name"] in {"encoder-0", "prefill-0", "decode-0"}]
    records = set()
    for engine in engines:
        python, flag, source, port, stall, record = engine["livenessProbe"]["exec"]["command"]
        assert (python, flag, source) == ("python3", "-c", ENGINE_LIVENESS_SOURCE)
        assert port == str(engine["readinessProbe"]["httpGet"]["port"]) and stall == "120"
        # Killed soon after: the pod's grace period is for draining, and a hung engine drains nothing.
        assert engine["livenessProbe"]["terminationGracePeriodSeconds"] < pod["terminationGracePeriodSeconds"]
        assert record.startswith("/tmp/") and {"name": TMP_VOLUME, "mountPath": "/tmp"} in engine["volumeMounts"]
        records.add(record)
        assert "--enable-server-load-tracking" in engine["args"]  # what /load counts
    assert len(records) == len(engines) == 3  # /tmp is the pod's: one file per container
    # The source carries no docstrings or comments (the pod spec carries it), and runs as is.
    assert '"""' not in ENGINE_LIVENESS_SOURCE and "#" not in ENGINE_LIVENESS_SOURCE
    compile(ENGINE_LIVENESS_SOURCE, "<probe>", "exec")
    for engine in containers(unit_pod(probes={"stallSeconds": 0})):
        if engine["name"] in {"encoder-0", "prefill-0", "decode-0"}:
            assert engine["livenessProbe"]["httpGet"]["path"] == "/health"


def test_behind_the_proxy_the_router_has_no_probe_and_the_proxys_readiness_goes_through_it():
    pod = unit_pod()
    router = next(c for c in pod["containers"] if c["name"] == "router")
    proxy = next(c for c in pod["containers"] if c["name"] == "proxy")
    # The router listens on 127.0.0.1: a kubelet probe (sent to the pod IP) would never pass.
    assert "--host" in router["args"] and router["args"][router["args"].index("--host") + 1] == "127.0.0.1"
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & router.keys()
    front = next(p["containerPort"] for p in proxy["ports"] if p["name"] == "http")
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/health", "port": front}
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/health", "port": PROXY_METRICS_PORT}
    # Without the proxy the router is the front, probed with a startup window.
    router = next(c for c in unit_pod(proxy={"enabled": False})["containers"] if c["name"] == "router")
    assert router["args"][router["args"].index("--host") + 1] == "0.0.0.0"
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= router.keys()


def test_every_container_drains_before_sigterm_within_the_grace_period():
    pod = unit_pod(termination={"gracePeriodSeconds": 300, "drainSeconds": 20})
    assert pod["terminationGracePeriodSeconds"] == 300
    served = [c for c in containers(pod) if c["name"] != "janitor"]
    assert {c["name"] for c in served} == {"encoder-0", "prefill-0", "decode-0", "router", "proxy"}
    assert all(c["lifecycle"] == {"preStop": {"sleep": {"seconds": 20}}} for c in served)
    assert all("lifecycle" not in c for c in containers(unit_pod(termination={"drainSeconds": 0})))


def test_every_container_requests_cpu_and_memory_and_the_first_carries_the_shm():
    pod = unit_pod(shm={"sizeLimit": "8Gi"})
    for container in containers(pod):
        assert {"cpu", "memory"} <= container["resources"]["requests"].keys(), container["name"]
    first, *rest = containers(pod)
    assert first["name"] == "encoder-0" and first["resources"]["requests"]["memory"] == "12Gi"  # 4Gi + 8Gi
    assert {c["resources"]["requests"]["memory"] for c in rest if c["name"].startswith(("prefill", "decode"))} == {
        "4Gi"
    }
    # A memory request the user set is theirs.
    manifest = yaml.safe_load((EXAMPLES / "encoder-prefill-decode.yaml").read_text())
    manifest["spec"]["models"][0]["serverGroups"][0]["resources"] = {"requests": {"memory": "30Gi"}}
    checked = validate(manifest["spec"])
    plans = render(checked, namespace="ns", name="n", uid="u")
    (sts,) = [c for c in desired_children(checked.spec, "n", plans, IMAGE) if c["kind"] == "StatefulSet"]
    assert sts["spec"]["template"]["spec"]["initContainers"][0]["resources"]["requests"]["memory"] == "30Gi"


def test_the_users_security_contexts_go_over_the_restricted_defaults():
    pod = unit_pod(
        podSecurityContext={"runAsUser": 2000, "fsGroup": 2000}, securityContext={"readOnlyRootFilesystem": True}
    )
    assert pod["securityContext"]["runAsUser"] == 2000 and pod["securityContext"]["fsGroup"] == 2000
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in containers(pod):
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["capabilities"] == {"drop": ["ALL"]}
    contexts = [c["securityContext"] for c in containers(pod)]
    assert len({id(c) for c in contexts}) == len(contexts)  # no dict shared between containers


# --------------------------------------------------------------------------- network policy and API key


def policy_of(example: str = "encoder-prefill-decode.yaml", **spec_changes) -> dict:
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"].update(spec_changes)
    checked = validate(manifest["spec"])
    name = manifest["metadata"]["name"]
    plans = render(checked, namespace="ns", name=name, uid="uid-1")
    children = desired_children(checked.spec, name, plans, IMAGE, operator_namespace="epd-system")
    return next(c for c in children if c["kind"] == "NetworkPolicy")


def test_the_network_policy_admits_own_pods_everywhere_clients_to_serving_ports_and_the_operator_to_janitors():
    policy = policy_of()
    name = policy["metadata"]["name"]
    own = {
        "podSelector": {
            "matchLabels": {"epd.vime.dev/deployment": name, "app.kubernetes.io/managed-by": "epd-operator"}
        }
    }
    assert policy["spec"]["podSelector"] == own["podSelector"] and policy["spec"]["policyTypes"] == ["Ingress"]
    own_rule, clients, operator = policy["spec"]["ingress"]
    assert own_rule == {"from": [own]}  # every port: units and pools reach each other's side channels
    assert clients["from"] == [{"podSelector": {}}]  # the namespace, by default
    # Engines' HTTP ports and the router: not the NIXL side channels (5600...) nor the janitor (9400).
    assert clients["ports"] == [
        {"protocol": "TCP", "port": 8100, "endPort": 8102},
        {"protocol": "TCP", "port": 8000},
    ]
    assert operator == {
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "epd-system"}}}],
        "ports": [{"protocol": "TCP", "port": 9400}],
    }


def test_client_and_monitoring_peers_are_the_users_and_the_policy_can_be_off():
    peers = [{"namespaceSelector": {"matchLabels": {"team": "rl"}}}]
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    policy = policy_of(networkPolicy={"clients": peers, "monitoring": monitoring})
    _, clients, scrapes, _ = policy["spec"]["ingress"]
    assert clients["from"] == peers and scrapes["from"] == monitoring
    assert {"protocol": "TCP", "port": 9400} in scrapes["ports"] and {"protocol": "TCP", "port": 9400} not in clients[
        "ports"
    ]
    assert len(policy_of(networkPolicy={"clients": []})["spec"]["ingress"]) == 2  # own pods and the operator only
    kinds = {c["kind"] for c in children_of("encoder-regular.yaml", networkPolicy={"enabled": False})}
    assert "NetworkPolicy" not in kinds


def test_the_api_key_reaches_every_engine_from_its_secret_never_as_an_argument():
    ref = {"name": "vllm-key", "key": "token"}
    pod = unit_pod(apiKey={"secretKeyRef": ref})
    engines = [c for c in containers(pod) if c["name"] not in ("router", "proxy", "janitor")]
    assert len(engines) == 3
    for engine in engines:
        assert {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": ref}} in engine["env"]
        assert not any("api-key" in arg or "token" in arg for arg in engine["args"])
    assert all("VLLM_API_KEY" not in str(c.get("env")) for c in containers(pod) if c["name"] in ("router", "janitor"))


def _by_ref(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def test_the_gateway_fronts_each_proxied_model_and_reads_only_what_it_watches():
    children = _by_ref(children_of("multi-model-overrides.yaml", gateway={"enabled": True, "replicas": 2}))
    gateways = {name: c for (kind, name), c in children.items() if kind == "Deployment"}
    proxied = {
        name.removeprefix("rl-rollout-")
        for (kind, name), c in children.items()
        if kind == "StatefulSet" and any(x["name"] == "proxy" for x in c["spec"]["template"]["spec"]["containers"])
    }
    assert set(gateways) == {f"rl-rollout-{m}-gateway" for m in proxied} and proxied
    for name, gateway in gateways.items():
        model = name.removeprefix("rl-rollout-").removesuffix("-gateway")
        pod = gateway["spec"]["template"]
        assert gateway["spec"]["replicas"] == 2
        # The front Service is the gateway's; the units' Services never select a gateway pod.
        front = children[("Service", f"rl-rollout-{model}")]
        units = children[("Service", f"rl-rollout-{model}-units")]
        assert front["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert not units["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["epd-dataplane", "gateway"] and container["image"] == IMAGE
        assert front["spec"]["ports"][0]["targetPort"] == "http"
        assert "http" in {p["name"] for p in container["ports"]}
        args = container["args"]
        assert args[args.index("--units-service") + 1] == f"rl-rollout-{model}-units"
        assert args[args.index("--namespace") + 1] == "$(POD_NAMESPACE)"
        assert args[args.index("--max-load-percent") + 1] == "125"
        assert pod["spec"]["serviceAccountName"] == "rl-rollout-gateway"
        assert pod["spec"]["automountServiceAccountToken"] is True
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": PROXY_METRICS_PORT}
    role = children[("Role", "rl-rollout-gateway")]
    assert role["rules"] == [
        {
            "apiGroups": ["epd.vime.dev"],
            "resources": ["epddeployments"],
            "resourceNames": ["rl-rollout"],
            "verbs": ["list", "watch"],
        },
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
    ]
    binding = children[("RoleBinding", "rl-rollout-gateway")]
    assert binding["roleRef"]["name"] == "rl-rollout-gateway"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rl-rollout-gateway"}]
    assert children[("ServiceAccount", "rl-rollout-gateway")]["automountServiceAccountToken"] is False
    tuned = children_of(
        "encoder-regular.yaml",
        gateway={"enabled": True, "maxLoadPercent": 200},
        proxy={"media": {"allowPrivateNetworks": True}},
    )
    (gateway,) = [c for c in tuned if c["kind"] == "Deployment"]
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-load-percent") + 1] == "200"
    assert "--media-allow-private-networks" in args  # the units' media URL policy, a hop earlier
    # Off by default: none of it, and the front Service selects the units.
    plain = _by_ref(children_of("multi-model-overrides.yaml"))
    assert not any(kind in ("Deployment", "Role", "RoleBinding", "ServiceAccount") for kind, _ in plain)


def test_a_new_weights_version_changes_no_child_and_a_versioned_models_proxies_require_one():
    def with_version(version):
        manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
        manifest["spec"]["gateway"] = {"enabled": True}
        if version is not None:
            manifest["spec"]["models"][0]["weightsVersion"] = version
        checked = validate(manifest["spec"])
        name = manifest["metadata"]["name"]
        return desired_children(checked.spec, name, render(checked, namespace="ns", name=name, uid="u"), IMAGE)

    step_1, step_2, unversioned = with_version("step-1"), with_version("step-2"), with_version(None)
    assert step_1 == step_2  # a bump rolls nothing: no pod template, no flag carries the value
    assert "step-1" not in yaml.safe_dump(step_1)
    proxy_args = [
        c["args"]
        for child in step_1
        if child["kind"] == "StatefulSet"
        for c in child["spec"]["template"]["spec"]["containers"]
        if c["name"] == "proxy"
    ]
    assert proxy_args and all("--require-weights-version" in a for a in proxy_args)
    assert all(
        "--require-weights-version" not in c["args"]
        for child in unversioned
        if child["kind"] == "StatefulSet"
        for c in child["spec"]["template"]["spec"]["containers"]
        if c["name"] == "proxy"
    )


def test_a_units_proxy_looks_in_its_ec_store_which_it_mounts_and_a_pools_proxy_has_none():
    (sts,) = [c for c in children_of("encoder-regular.yaml") if c["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]
    (proxy,) = [c for c in pod["spec"]["containers"] if c["name"] == "proxy"]
    store = proxy["args"][proxy["args"].index("--ec-store") + 1]
    assert store == pod["metadata"]["annotations"]["epd.vime.dev/ec-storage-path"] and store.startswith("/dev/shm/")
    assert proxy["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    pools = [c for c in children_of("encoder-pools.yaml") if c["kind"] == "StatefulSet"]
    for child in pools:
        for container in child["spec"]["template"]["spec"]["containers"]:
            assert "--ec-store" not in container.get("args", [])


def test_the_media_url_policy_reaches_every_engine_and_the_proxy():
    default = unit_pod()
    listed = unit_pod(proxy={"media": {"allowedDomains": ["images.example.com", "10.0.0.5"], "allowRedirects": True}})
    private = unit_pod(proxy={"media": {"allowPrivateNetworks": True}})

    def engines(pod: dict) -> list[dict]:
        return [c for c in containers(pod) if c["name"] not in ("router", "proxy", "janitor")]

    def proxy_args(pod: dict) -> list[str]:
        return next(c for c in pod["containers"] if c["name"] == "proxy")["args"]

    for engine in engines(default):
        assert {"name": "VLLM_MEDIA_URL_ALLOW_REDIRECTS", "value": "0"} in engine["env"]  # no redirect is followed
        assert not any(a.startswith(("--allowed-media-domains", "--allowed-local-media-path")) for a in engine["args"])
    for engine in engines(listed):
        at = engine["args"].index("--allowed-media-domains")
        assert engine["args"][at + 1 : at + 3] == ["images.example.com", "10.0.0.5"]
        assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in str(engine["env"])
    assert not any(a.startswith("--allowed-media") or "private" in a for a in proxy_args(default))
    at = proxy_args(listed).index("--allowed-media-domains")
    assert proxy_args(listed)[at + 1 : at + 3] == ["images.example.com", "10.0.0.5"]
    assert "--media-allow-private-networks" in proxy_args(private)
    # The proxy reads what it is given: its own parser takes the rendered arguments.
    args = dataplane_parser().parse_args(["proxy", *proxy_args(listed)])
    assert (args.allowed_media_domains, args.media_allow_private_networks) == (
        ["images.example.com", "10.0.0.5"],
        False,
    )


def test_an_inference_pool_per_gateway_fronted_model_selects_its_units_and_names_the_gateways_picker():
    pool = {"enabled": True, "failureMode": "FailOpen", "fallbacks": 2}
    children = _by_ref(children_of("encoder-regular.yaml", gateway={"enabled": True, "inferencePool": pool}))
    name = "qwen-vl-regular"
    inference_pool = children[("InferencePool", f"{name}-default")]
    assert inference_pool["apiVersion"] == "inference.networking.k8s.io/v1"
    unit_pods = children[("StatefulSet", f"{name}-default")]["spec"]["template"]["metadata"]["labels"]
    gateway = children[("Deployment", f"{name}-default-gateway")]
    gateway_pods = gateway["spec"]["template"]["metadata"]["labels"]
    selector = inference_pool["spec"]["selector"]["matchLabels"]
    # Exactly the model's units: not its gateway's pods.
    assert selector.items() <= unit_pods.items() and not selector.items() <= gateway_pods.items()
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    proxy_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert inference_pool["spec"]["targetPorts"] == [{"number": proxy_port}]
    assert inference_pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": f"{name}-default-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    picker = children[("Service", f"{name}-default-epp")]
    assert picker["spec"]["selector"].items() <= gateway_pods.items()
    (port,) = picker["spec"]["ports"]
    assert (port["port"], port["targetPort"], port["appProtocol"]) == (9002, "grpc-epp", "http2")
    # The gateway serves the picker, as its real parser reads the flags.
    args = dataplane_parser().parse_args([*container["command"][1:], *container["args"]])
    assert (args.epp_port, args.epp_health_port, args.epp_secure_serving, args.epp_fallbacks) == (9002, 9003, True, 2)
    assert args.epp_name == [f"{name}-default-epp", f"{name}-default-epp.$(POD_NAMESPACE).svc"]
    assert {"grpc-epp", "grpc-epp-health"} <= {p["name"] for p in container["ports"]}
    # The gateways of an HTTPRoute reach the picker through the deployment's NetworkPolicy.
    policy = children[("NetworkPolicy", name)]
    clients = policy["spec"]["ingress"][1]
    assert {"protocol": "TCP", "port": 9002} in clients["ports"]
    # Plaintext when asked; none of it without the pool.
    plain = _by_ref(
        children_of(
            "encoder-regular.yaml",
            gateway={"enabled": True, "inferencePool": {"enabled": True, "secureServing": False}},
        )
    )
    (container,) = plain[("Deployment", f"{name}-default-gateway")]["spec"]["template"]["spec"]["containers"]
    assert not dataplane_parser().parse_args([*container["command"][1:], *container["args"]]).epp_secure_serving
    assert plain[("Service", f"{name}-default-epp")]["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"
    without = _by_ref(children_of("encoder-regular.yaml", gateway={"enabled": True}))
    assert (
        not any(kind == "InferencePool" for kind, _ in without) and (("Service", f"{name}-default-epp")) not in without
    )
    (container,) = without[("Deployment", f"{name}-default-gateway")]["spec"]["template"]["spec"]["containers"]
    assert dataplane_parser().parse_args([*container["command"][1:], *container["args"]]).epp_port is None


def test_an_inference_pool_needs_the_gateway():
    manifest = yaml.safe_load((EXAMPLES / "encoder-regular.yaml").read_text())
    manifest["spec"]["gateway"] = {"inferencePool": {"enabled": True}}
    with pytest.raises(SpecError) as refused:
        validate(manifest["spec"])
    assert any("spec.gateway.inferencePool.enabled" in e and "spec.gateway.enabled" in e for e in refused.value.errors)
