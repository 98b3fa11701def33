"""The one real node beside the kwok GPU nodes: containerd, runc, CNI, kubelet, kube-proxy and a
NetworkPolicy engine (kube-router, firewall only) here.

A `RealNode` is started and stopped by its `LocalCluster` (cluster.py), which records the
node's processes with its own; docs/local-cluster.md ("The real node") explains the choices.

It owns host paths no second node could share (/var/lib/kubelet, /run/containerd, the kubelet's
port 10250, kube-proxy's iptables chains, the bridge), so a machine has at most one: the cluster
folder that has it is written in ``OWNER_FILE``, and another cluster asking for it while that
owner's node processes still run gets `NodeBusy` (a stale claim, its processes gone, is taken
over after cleaning what they left).

Its network lives on the bridge ``BRIDGE`` only: the node IP is the bridge's address, pods get
addresses of ``POD_SUBNET`` with no default route (only the Service range, through the
bridge), the host routes the Service range to the bridge, and a FORWARD rule drops pod traffic
addressed anywhere but the pod and Service ranges. kwok's fake pod addresses are unreachable
(a route of their own), so a ClusterIP whose endpoints kwok plays never leaves the machine.

Images are containerd's, kept in the cache (``containerd_root``) across clusters: an image
imported once (images/, `make images`) is there for every later node; the containers,
sandboxes and everything under /run, /var/lib/kubelet and /var/lib/cni go on stop.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import debian, paths
from ..progress import CommandFailed

NAME = "epd-real-0"
LABEL = ("epd.vime.dev/node", "real")
# Only pods that ask for the real node go there: every other test's pods stay on kwok's nodes
# (the real kubelet would try to pull their images).
TAINT = {"key": LABEL[0], "value": LABEL[1], "effect": "NoSchedule"}
# What a pod sets to run there.
NODE_SELECTOR = {LABEL[0]: LABEL[1]}
TOLERATIONS = [{"key": TAINT["key"], "operator": "Equal", "value": TAINT["value"], "effect": "NoSchedule"}]
GPUS = 8  # nvidia.com/gpu capacity, patched into the node status (CPU engines ignore it)

BRIDGE = "epdbr0"
NODE_IP = "10.88.0.1"
POD_SUBNET = "10.88.0.0/24"
KUBELET_PORT = 10250

OWNER_DIR = Path("/run/epd-real-node")
OWNER_FILE = OWNER_DIR / "owner.json"

# Host paths the kubelet, containerd and CNI use (their defaults; the kubelet hard-codes some).
KUBELET_ROOT = Path("/var/lib/kubelet")
CONTAINERD_STATE = Path("/run/containerd")
CONTAINERD_SOCKET = CONTAINERD_STATE / "containerd.sock"
CNI_STATE = Path("/var/lib/cni")
NETNS_DIR = Path("/run/netns")
POD_LOGS = (Path("/var/log/pods"), Path("/var/log/containers"))
CGROUP_ROOT = Path("/sys/fs/cgroup")
KUBEPODS = "kubepods"
CNI_BIN = Path("/usr/lib/cni")
RUNC = Path("/usr/sbin/runc")
CONTAINERD = Path("/usr/bin/containerd")
CTR = Path("/usr/bin/ctr")
SHIM = "containerd-shim-runc-v2"

# Debian packages of the runtime (bookworm: containerd 1.6.20, runc 1.1.5, plugins 1.1.1).
PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "conntrack", "ipset")

# Host settings the kubelet, kube-proxy and the bridge plugin change: restored on stop.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
    "net.ipv4.conf.all.route_localnet",
    "net.bridge.bridge-nf-call-iptables",
)
# Chains the kubelet makes, and the hint kube-proxy and the kubelet leave (`kube-proxy
# --cleanup` removes the rest of kube-proxy's).
KUBE_ROUTER_CHAINS = ("KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-")
KUBELET_CHAINS = {
    "filter": ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY"),
    "nat": ("KUBE-KUBELET-CANARY",),
    "mangle": ("KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"),
}


class NodeError(RuntimeError):
    pass


class NodeBusy(NodeError):
    """Another cluster's real node runs on this machine."""


# --------------------------------------------------------------------------- pure configuration


@dataclass(frozen=True)
class NodeLayout:
    """Where one real node keeps its files and which addresses it uses."""

    dir: Path  # <cluster>/node: configs, credentials, logs
    containerd_root: Path  # images and snapshots, kept across clusters (the cache)
    sandbox_image: str
    service_cidr: str
    kwok_pod_cidr: str
    cluster_dns_ip: str  # the kube-dns Service's address, which pods resolve through
    cluster_domain: str

    @property
    def containerd_config(self) -> Path:
        return self.dir / "containerd.toml"

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "cni"

    @property
    def registry_hosts(self) -> Path:
        return self.dir / "registry-hosts"

    @property
    def kubelet_config(self) -> Path:
        return self.dir / "kubelet.yaml"

    @property
    def kube_proxy_config(self) -> Path:
        return self.dir / "kube-proxy.yaml"


def containerd_toml(layout: NodeLayout) -> str:
    """containerd 1.6 (config version 2) for the kubelet's CRI: cgroupfs, the local pause image,
    and no registry: every pull goes to a closed local port (see registry_hosts_toml)."""
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{CONTAINERD_STATE}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs"]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{layout.sandbox_image}"
  # This VM has no CAP_SYS_RESOURCE: runc cannot write a negative oom_score_adj, and every
  # sandbox would die with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "{RUNC}"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{layout.cni_conf_dir}"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{layout.registry_hosts}"
"""


# Registries a pod's image could name by default; each is sent to a port nothing listens on,
# so a missing image fails at once (ErrImagePull) instead of leaving the machine.
REGISTRIES = ("docker.io", "registry.k8s.io", "ghcr.io", "quay.io", "localhost")


def registry_hosts_toml(registry: str) -> str:
    return f'server = "http://127.0.0.1:9"\n\n[host."http://127.0.0.1:9"]\n  capabilities = ["pull", "resolve"]\n# {registry}\n'


def cni_conflist(service_cidr: str) -> dict[str, Any]:
    """bridge (gateway on the bridge, no default route: only the Service range goes through
    it), host-local addresses, portmap; containerd adds the loopback itself."""
    return {
        "cniVersion": "0.4.0",
        "name": "epd-real-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                    "routes": [{"dst": service_cidr}],
                    "dataDir": str(CNI_STATE / "networks"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}, "snat": False},
        ],
    }


def kubelet_configuration(layout: NodeLayout, pki: Path) -> dict[str, Any]:
    """The kubelet as kubeadm sets it up (x509 + webhook authentication, webhook authorization,
    a serving certificate from the cluster CA), plus what this VM needs (docs/local-cluster.md)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # cgroup v1 here; 1.35+ refuses it unless told.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "failSwapOn": False,
        "address": NODE_IP,
        "port": KUBELET_PORT,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "registerWithTaints": [TAINT],
        # The cluster's DNS (dns.py), and no host resolver: pods resolve the cluster's names only.
        "clusterDNS": [layout.cluster_dns_ip],
        "clusterDomain": layout.cluster_domain,
        "resolvConf": "",
        # A shared disk and multi-GB images: neither evicted nor garbage-collected.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
        "protectKernelDefaults": False,
    }


def kube_proxy_configuration(layout: NodeLayout, kubeconfig: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": NAME,
        "mode": "iptables",
        "clusterCIDR": POD_SUBNET,
        "bindAddress": NODE_IP,
        "nodePortAddresses": [f"{NODE_IP}/32"],
        "metricsBindAddress": "127.0.0.1:10249",
        "healthzBindAddress": "127.0.0.1:10256",
        # Leave the host's conntrack settings alone.
        "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
    }


def forward_rule() -> list[str]:
    """Pod traffic to anything but pods and Services is dropped (iptables -A/-D arguments;
    Service addresses are rewritten to pods' before FORWARD)."""
    return [
        "FORWARD",
        "-s",
        POD_SUBNET,
        "!",
        "-d",
        POD_SUBNET,
        "-m",
        "comment",
        "--comment",
        "epd-real-node",
        "-j",
        "DROP",
    ]


def gpu_status_patch(gpus: int) -> list[dict[str, Any]]:
    """The JSON patch advertising an extended resource, as the Kubernetes docs do for testing."""
    return [
        {"op": "add", "path": f"/status/{part}/nvidia.com~1gpu", "value": str(gpus)}
        for part in ("capacity", "allocatable")
    ]


def mounts_under(mountinfo: str, prefixes: tuple[Path, ...]) -> list[str]:
    """Mount points below any of `prefixes`, deepest first (the order to unmount them in)."""
    found = []
    for line in mountinfo.splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(p) or point.startswith(f"{p}/") for p in prefixes):
            found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


# --------------------------------------------------------------------------- the shell


def _run(*cmd: str | os.PathLike[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, check=False)
    if check and out.returncode != 0:
        raise NodeError(f"{' '.join(map(str, cmd))} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def install_packages(log: Callable[[str], None]) -> None:
    """apt-get the runtime's Debian packages if any is missing (as root)."""
    try:
        debian.install_packages(PACKAGES, log, needed_by="the real node")
    except CommandFailed as error:
        raise NodeError(str(error)) from None


def check_host() -> None:
    """Raise NodeError saying what is missing for a real node here."""
    if os.geteuid() != 0:
        raise NodeError(
            "the real node needs root (it owns /var/lib/kubelet, /run/containerd, a bridge, iptables): run as "
            "root, or without it (CLUSTER_REAL_NODES=0 make cluster-up; make demo DEMO_KUBECONFIG=<a cluster>)"
        )


def process_alive(pid: int, start_ticks: int) -> bool:
    """Running (not a zombie) and still the process recorded, not a recycled pid."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[19]) == start_ticks


@contextlib.contextmanager
def _host_lock() -> Iterator[None]:
    """Serialises claims and clean-ups of the node between processes."""
    OWNER_DIR.mkdir(parents=True, exist_ok=True)
    with open(OWNER_DIR / "lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def read_owner() -> dict[str, Any] | None:
    try:
        owner: dict[str, Any] = json.loads(OWNER_FILE.read_text())
    except (OSError, ValueError):
        return None
    return owner


def owner_alive(owner: dict[str, Any]) -> bool:
    """Any of the owner's recorded node processes still runs."""
    return any(process_alive(p["pid"], p["start_ticks"]) for p in owner.get("processes", {}).values())


@dataclass
class RealNode:
    """The real node of the cluster in `cluster_dir`; `layout` says where its files go."""

    cluster_dir: Path
    layout: NodeLayout
    log: Callable[[str], None] = print
    saved_sysctls: dict[str, str] = field(default_factory=dict)

    # ---------------------------------------------------------------- ownership

    def claim(self) -> None:
        """Take the machine's node for this cluster, cleaning a dead owner's leftovers; raise
        NodeBusy while another cluster's node runs."""
        check_host()
        with _host_lock():
            owner = read_owner()
            if owner and Path(owner["cluster_dir"]) != self.cluster_dir and owner_alive(owner):
                raise NodeBusy(
                    f"the real node {NAME} belongs to the cluster in {owner['cluster_dir']} (its kubelet or "
                    f"containerd still runs): stop that cluster first (make cluster-down there, or "
                    f"`python -m epd_dev.localcluster down --dir {owner['cluster_dir']}`), or start this one "
                    "without it (CLUSTER_REAL_NODES=0)"
                )
            if owner:
                self.log(f"cleaning what the real node of {owner['cluster_dir']} left")
                self._clean_host(owner.get("sysctls", {}))
            self.saved_sysctls = _read_sysctls()
            self._write_owner({})

    def record(self, processes: dict[str, dict[str, int]]) -> None:
        """Note the node's processes in the claim (how another cluster tells a live owner)."""
        self._write_owner(processes)

    def _write_owner(self, processes: dict[str, dict[str, int]]) -> None:
        OWNER_DIR.mkdir(parents=True, exist_ok=True)
        tmp = OWNER_FILE.with_suffix(".tmp")
        record = {"cluster_dir": str(self.cluster_dir), "sysctls": self.saved_sysctls, "processes": processes}
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, OWNER_FILE)

    def owned(self) -> bool:
        owner = read_owner()
        return owner is not None and Path(owner["cluster_dir"]) == self.cluster_dir

    # ---------------------------------------------------------------- start

    def prepare_network(self) -> None:
        """The bridge with the node IP (the API server binds it), routes, the FORWARD rule."""
        prefix = ipaddress.ip_network(POD_SUBNET).prefixlen
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_IP}/{prefix}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        # Replies of the host to ClusterIP traffic leave from the node IP, through the bridge.
        _run("ip", "route", "add", self.layout.service_cidr, "dev", BRIDGE, "src", NODE_IP)
        _run("ip", "route", "add", "unreachable", self.layout.kwok_pod_cidr)
        _run("iptables", "-I", *forward_rule())

    def write_configs(self, pki: Path, kubeconfigs: Path) -> None:
        import yaml

        layout = self.layout
        layout.dir.mkdir(parents=True, exist_ok=True)
        layout.containerd_root.mkdir(parents=True, exist_ok=True)
        layout.containerd_config.write_text(containerd_toml(layout))
        layout.cni_conf_dir.mkdir(exist_ok=True)
        (layout.cni_conf_dir / "10-epd-real-node.conflist").write_text(
            json.dumps(cni_conflist(layout.service_cidr), indent=2) + "\n"
        )
        for registry in REGISTRIES:
            (layout.registry_hosts / registry).mkdir(parents=True, exist_ok=True)
            (layout.registry_hosts / registry / "hosts.toml").write_text(registry_hosts_toml(registry))
        layout.kubelet_config.write_text(yaml.safe_dump(kubelet_configuration(layout, pki)))
        layout.kube_proxy_config.write_text(
            yaml.safe_dump(kube_proxy_configuration(layout, kubeconfigs / "kube-proxy.kubeconfig"))
        )

    def containerd_args(self) -> list[str]:
        return ["--config", str(self.layout.containerd_config), "--log-level", "warn"]

    def kubelet_args(self, kubeconfigs: Path) -> list[str]:
        return [
            f"--config={self.layout.kubelet_config}",
            f"--kubeconfig={kubeconfigs / 'kubelet.kubeconfig'}",
            f"--hostname-override={NAME}",
            f"--node-ip={NODE_IP}",
            f"--node-labels={LABEL[0]}={LABEL[1]}",
            "--v=1",
        ]

    def kube_proxy_args(self) -> list[str]:
        return [f"--config={self.layout.kube_proxy_config}", "--v=1"]

    def kube_router_args(self, kubeconfigs: Path, health_port: int) -> list[str]:
        """kube-router as the NetworkPolicy engine only: the bridge plugin wires pods and
        kube-proxy serves Services, so its routing and service proxy stay off."""
        return [
            "--run-firewall=true",
            "--run-router=false",
            "--run-service-proxy=false",
            f"--kubeconfig={kubeconfigs / 'kube-router.kubeconfig'}",
            f"--hostname-override={NAME}",
            f"--service-cluster-ip-range={self.layout.service_cidr}",
            "--enable-ipv6=false",
            f"--health-port={health_port}",
            "--metrics-port=0",
            "--v=1",
        ]

    def containerd_ready(self) -> bool:
        return _run(CTR, "--address", CONTAINERD_SOCKET, "version", check=False, timeout=10).returncode == 0

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _run(CTR, "--address", CONTAINERD_SOCKET, "--namespace", "k8s.io", *args, timeout=timeout)

    def image_refs(self) -> set[str]:
        return set(self.ctr("images", "list", "--quiet").stdout.split())

    # ---------------------------------------------------------------- stop

    def stop_workloads(self, terminate: Callable[[tuple[str, ...]], list[str]]) -> list[str]:
        """Stop the kubelet (so nothing restarts), then every container while containerd still
        runs, so their shims exit by themselves. Returns the names `terminate` stopped."""
        stopped = terminate(("kube-router", "kube-proxy", "kubelet"))
        if CONTAINERD_SOCKET.exists() and self.containerd_ready():
            self.purge_containers()
        return stopped

    def purge_containers(self) -> None:
        """Kill and delete every container of the kubelet's namespace (at start: what a killed
        run left in the kept containerd root; at stop: all the pods)."""
        for task in self._ctr_list("tasks"):
            self._ctr_quiet("tasks", "kill", "--signal", "SIGKILL", task)
        deadline = time.monotonic() + 30
        while (tasks := self._ctr_list("tasks")) and time.monotonic() < deadline:
            for task in tasks:
                self._ctr_quiet("tasks", "delete", task)
            time.sleep(0.5)
        for container in self._ctr_list("containers"):
            self._ctr_quiet("containers", "delete", container)

    def _ctr_list(self, kind: str) -> list[str]:
        out = self._ctr_quiet(kind, "list", "--quiet")
        return out.stdout.split() if out.returncode == 0 else []

    def _ctr_quiet(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _run(CTR, "--address", CONTAINERD_SOCKET, "--namespace", "k8s.io", *args, check=False, timeout=60)

    def release(self) -> None:
        """Once every node process is gone: clean the host and give the node up."""
        with _host_lock():
            if not self.owned():
                return
            owner = read_owner() or {}
            self._clean_host(owner.get("sysctls", {}))
            OWNER_FILE.unlink(missing_ok=True)
            (OWNER_DIR / "lock").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            OWNER_DIR.rmdir()

    def _clean_host(self, sysctls: dict[str, str]) -> None:
        """Everything a node leaves, whether it stopped cleanly or was killed: container
        processes, shims, iptables rules, mounts, network namespaces, state folders, cgroups,
        the bridge and routes, and the host settings it changed."""
        _kill_pids(_kubepods_pids(), self.log)
        _kill_pids(_shim_pids(), self.log)
        _iptables_cleanup(self.layout)
        mountinfo = Path("/proc/self/mountinfo").read_text()
        for point in mounts_under(mountinfo, (KUBELET_ROOT, CONTAINERD_STATE, NETNS_DIR)):
            if subprocess.run(["umount", point], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        if NETNS_DIR.is_dir():
            for netns in NETNS_DIR.glob("cni-*"):
                netns.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                NETNS_DIR.rmdir()  # only when empty: other netns are not the node's
        for folder in (KUBELET_ROOT, CONTAINERD_STATE, CNI_STATE, *POD_LOGS):
            shutil.rmtree(folder, ignore_errors=True)
        _remove_kubepods_cgroups()
        bridge = Path(f"/sys/class/net/{BRIDGE}")
        if bridge.exists():
            # A pod's veth goes with its network namespace, which the kernel frees in the
            # background, after the umounts above: deleted here, none outlives the node.
            for port in sorted((bridge / "brif").glob("*")):
                _run("ip", "link", "delete", port.name, check=False)
            _run("ip", "link", "delete", BRIDGE, check=False)
        _run("ip", "route", "del", "unreachable", self.layout.kwok_pod_cidr, check=False)
        _write_sysctls(sysctls)


def host_footprint() -> set[str]:
    """What a real node puts on the host, as it is now: mounts, links, routes, iptables rules and
    chains, processes, folders, cgroups, the claim. Empty on a host without a node (what a test
    compares after `down`)."""
    found: set[str] = set()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    found |= {f"mount {p}" for p in mounts_under(mountinfo, (KUBELET_ROOT, CONTAINERD_STATE, NETNS_DIR))}
    links = _run("ip", "-o", "link", "show", check=False).stdout
    found |= {
        f"link {line.split(':')[1].strip().split('@')[0]}"
        for line in links.splitlines()
        if BRIDGE in line or "veth" in line
    }
    routes = _run("ip", "route", "show", check=False).stdout
    found |= {f"route {line}" for line in routes.splitlines() if BRIDGE in line or line.startswith("unreachable")}
    for table in ("filter", "nat", "mangle"):
        rules = _run("iptables", "-t", table, "-S", check=False).stdout
        found |= {f"iptables -t {table} {r}" for r in rules.splitlines() if "KUBE" in r or "epd-real-node" in r}
    found |= {f"ipset {name}" for name in _kube_router_ipsets()}
    found |= {f"process {pid}" for pid in _shim_pids() + _kubepods_pids()}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and Path(os.readlink(entry / "exe")).name in (
                "kubelet",
                "kube-proxy",
                "kube-router",
                "containerd",
            ):
                found.add(f"process {entry.name} {os.readlink(entry / 'exe')}")
    for folder in (KUBELET_ROOT, CONTAINERD_STATE, CNI_STATE, *POD_LOGS, OWNER_DIR):
        if folder.exists():
            found.add(f"path {folder}")
    found |= {f"path {p}" for p in NETNS_DIR.glob("cni-*")}
    found |= {f"cgroup {p}" for p in CGROUP_ROOT.glob(f"*/{KUBEPODS}")}
    return found


def _read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        path = Path("/proc/sys") / name.replace(".", "/")
        with contextlib.suppress(OSError):
            values[name] = path.read_text().strip()
    return values


def _write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / name.replace(".", "/")).write_text(value + "\n")


def _kubepods_pids() -> list[int]:
    """Every process in the kubelet's pod cgroups (containers, whoever started them)."""
    pids: set[int] = set()
    for procs in CGROUP_ROOT.glob(f"*/{KUBEPODS}/**/cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in procs.read_text().split())
    return sorted(pids)


def _shim_pids() -> list[int]:
    """containerd shims serving this node's containerd (their command line names its socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(SHIM.encode()) and str(CONTAINERD_SOCKET).encode() in argv:
            pids.append(int(entry.name))
    return pids


def _kill_pids(pids: list[int], log: Callable[[str], None]) -> None:
    if not pids:
        return
    log(f"killing {len(pids)} leftover node process(es)")
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)


def _remove_kubepods_cgroups() -> None:
    for controller in CGROUP_ROOT.iterdir():
        top = controller / KUBEPODS
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                folder.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def _iptables_cleanup(layout: NodeLayout) -> None:
    while _run("iptables", "-D", *forward_rule(), check=False).returncode == 0:
        pass
    from . import binaries

    proxy = binaries.bin_dir(binaries.NODE) / "kube-proxy"
    if os.access(proxy, os.X_OK):
        _run(proxy, "--cleanup", check=False, timeout=60)
    # kube-router's own --cleanup-config leaves its top chains (2.1.0) and then panics in its
    # service proxy's cleanup: its chains go here, then its ipsets (only unused ones can).
    _remove_chains("filter", _kube_router_chains())
    for name in _kube_router_ipsets():
        _run("ipset", "destroy", name, check=False)
    for table, chains in KUBELET_CHAINS.items():
        _remove_chains(table, chains)


def _remove_chains(table: str, chains: Sequence[str]) -> None:
    """Delete `chains` and every rule jumping to them; all are flushed before any is deleted, as
    they may jump to each other (kube-router's do)."""
    for chain in chains:
        for rule in _referring_rules(table, chain):
            _run("iptables", "-t", table, *rule, check=False)
    for flag in ("-F", "-X"):
        for chain in chains:
            _run("iptables", "-t", table, flag, chain, check=False)


def _kube_router_chains() -> list[str]:
    """kube-router's network policy chains in the filter table."""
    out = _run("iptables", "-t", "filter", "-S", check=False)
    return [
        words[1]
        for words in (line.split() for line in out.stdout.splitlines())
        if words[:1] == ["-N"] and words[1].startswith(KUBE_ROUTER_CHAINS)
    ]


def _kube_router_ipsets() -> list[str]:
    """The ipsets kube-router keeps for pods and policies (it names them all KUBE-*)."""
    if shutil.which("ipset") is None:
        return []
    out = _run("ipset", "list", "-n", check=False)
    return [name for name in out.stdout.split() if name.startswith("KUBE-")]


def _referring_rules(table: str, chain: str) -> list[list[str]]:
    """`-D ...` arguments deleting every rule that jumps to `chain`."""
    out = _run("iptables", "-t", table, "-S", check=False)
    rules = []
    for line in out.stdout.splitlines():
        words = shlex.split(line)  # comments are quoted
        if words[:1] == ["-A"] and words[-2:] == ["-j", chain] and words[1] != chain:
            rules.append(["-D", *words[1:]])
    return rules


def default_containerd_root() -> Path:
    """containerd's images and snapshots, in the cache: kept across clusters and checkouts."""
    return paths.cache_root() / "node" / "containerd"
