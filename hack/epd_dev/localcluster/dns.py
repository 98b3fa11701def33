"""The local cluster's DNS: CoreDNS as kind and kubeadm run it, on the real node.

A Deployment `coredns` in kube-system behind the Service `kube-dns` at the cluster's DNS address
(the tenth of the Service range, kubeadm's choice), with kubeadm's ServiceAccount and ClusterRole
and its Corefile less `forward`: it answers `cluster.local` (and reverse lookups of pod and
Service addresses) from the API server, and "no such name" to anything else, so no query leaves
the machine. The kubelet hands pods that address and domain (node.kubelet_configuration).

Two things differ from kubeadm's manifest: one replica (one real node), and port 53 is bound by
CoreDNS's nonroot user through the pod's `net.ipv4.ip_unprivileged_port_start` sysctl (one of
the kubelet's safe sysctls) instead of a NET_BIND_SERVICE capability, so the pod passes Pod
Security `restricted` and the image needs no file capability.
"""

from __future__ import annotations

from typing import Any

from . import node

DOMAIN = "cluster.local"
NAMESPACE = "kube-system"
NAME = "coredns"
SERVICE = "kube-dns"
LABELS = {"k8s-app": "kube-dns"}
READY_PORT = 8181  # the ready plugin: 200 once every plugin that reports is ready
HEALTH_PORT = 8080
METRICS_PORT = 9153

# kubeadm's Corefile without `forward`: its block serves the cluster's zones (no `fallthrough`,
# so the kubernetes plugin itself answers NXDOMAIN for an unknown name there), and every other
# name gets NXDOMAIN from a block of its own, as a real cluster's upstream would answer a name
# that does not exist. (No answer at all, SERVFAIL, would end a resolver's search of a short
# name that does not exist with "try again" instead of "no such name".)
COREFILE = f"""\
{DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    errors
    health {{
       lameduck 5s
    }}
    ready
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
       pods insecure
       ttl 30
    }}
    prometheus :{METRICS_PORT}
    cache 30
    loop
    reload
    loadbalance
}}
.:53 {{
    errors
    template ANY ANY {{
       rcode NXDOMAIN
    }}
}}
"""


def objects(cluster_ip: str, image: str) -> list[dict[str, Any]]:
    """Everything the cluster's DNS is made of, to apply in one go."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME, "namespace": NAMESPACE}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["endpoints", "services", "pods", "namespaces"],
                    "verbs": ["list", "watch"],
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:coredns"},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": NAME, "namespace": NAMESPACE},
            "data": {"Corefile": COREFILE},
        },
        _deployment(image),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": SERVICE,
                "namespace": NAMESPACE,
                "labels": {**LABELS, "kubernetes.io/cluster-service": "true", "kubernetes.io/name": "CoreDNS"},
            },
            "spec": {
                "selector": LABELS,
                "clusterIP": cluster_ip,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                    {"name": "metrics", "port": METRICS_PORT, "protocol": "TCP", "targetPort": METRICS_PORT},
                ],
            },
        },
    ]


def _deployment(image: str) -> dict[str, Any]:
    container = {
        "name": NAME,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "resources": {"limits": {"memory": "170Mi"}, "requests": {"cpu": "100m", "memory": "70Mi"}},
        "volumeMounts": [{"name": "config-volume", "mountPath": "/etc/coredns", "readOnly": True}],
        "ports": [
            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": HEALTH_PORT, "scheme": "HTTP"},
            "initialDelaySeconds": 60,
            "timeoutSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/ready", "port": READY_PORT, "scheme": "HTTP"},
            "periodSeconds": 1,
            "timeoutSeconds": 1,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "namespace": NAMESPACE, "labels": LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "priorityClassName": "system-cluster-critical",
                    "serviceAccountName": NAME,
                    "nodeSelector": {**node.NODE_SELECTOR, "kubernetes.io/os": "linux"},
                    "tolerations": [*node.TOLERATIONS, {"key": "CriticalAddonsOnly", "operator": "Exists"}],
                    "securityContext": {
                        "runAsNonRoot": True,
                        "seccompProfile": {"type": "RuntimeDefault"},
                        "sysctls": [{"name": "net.ipv4.ip_unprivileged_port_start", "value": "53"}],
                    },
                    "containers": [container],
                    "dnsPolicy": "Default",
                    "volumes": [
                        {
                            "name": "config-volume",
                            "configMap": {"name": NAME, "items": [{"key": "Corefile", "path": "Corefile"}]},
                        }
                    ],
                },
            },
        },
    }


def ready(pods: dict[str, Any]) -> bool:
    """Whether a `kubectl get pods -l k8s-app=kube-dns -o json` answer has a Ready CoreDNS pod."""
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for pod in pods.get("items", [])
        if not pod["metadata"].get("deletionTimestamp")
        for c in pod.get("status", {}).get("conditions", [])
    )
