"""A real local Kubernetes control plane for tests and demos.

Built from upstream Go modules (``python -m epd_dev.localcluster.build``) and run as
plain processes with kwok fake GPU nodes (``python -m epd_dev.localcluster up``).
"""

from .binaries import ETCD_VERSION, HELM_VERSION, K8S_VERSION, KWOK_VERSION
from .cluster import ClusterBusy, ClusterError, LocalCluster

__all__ = [
    "ETCD_VERSION",
    "HELM_VERSION",
    "K8S_VERSION",
    "KWOK_VERSION",
    "ClusterBusy",
    "ClusterError",
    "LocalCluster",
]
