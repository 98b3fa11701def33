"""A real Kubernetes control plane on loopback, with kwok standing in for kubelets.

    python -m epd_dev.localcluster up|down|status [--dir .cluster] [--nodes 4]

Runs etcd, kube-apiserver (TLS, RBAC, service-account tokens), kube-controller-
manager, kube-scheduler and kwok as plain processes built by
``epd_dev.localcluster.build``. kwok keeps N fake GPU nodes Ready and marks the pods
the scheduler binds to them Running and Ready; nothing runs in containers for them.
With ``real_nodes=1`` the cluster also has one real node (node.py): containerd, the
kubelet and kube-proxy run here, and its pods' containers really run.

Everything about one cluster lives in its folder: credentials, kubeconfigs,
etcd data, logs and ``state.json`` (the pids), so ``down`` works from any
process and the next ``up`` kills whatever a crashed run left behind. Ports are
picked free at start, so clusters in different folders do not collide; the
process that started a cluster owns its folder (a flock) until it stops it or
exits, so a second start there fails with ClusterBusy instead of killing it.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..progress import format_seconds
from . import binaries, dns, node

# Service and kwok's fake pod address ranges. Without a real node nothing routes to them;
# with one, kube-proxy makes the Service range work (node.py) and kwok's stays unreachable.
SERVICE_CIDR = "10.96.0.0/16"
FIRST_SERVICE_IP = "10.96.0.1"
# The kube-dns Service's address: the tenth of the range, as kubeadm picks it.
CLUSTER_DNS_IP = str(ipaddress.ip_network(SERVICE_CIDR)[10])
POD_CIDR = "10.244.0.1/16"
# Without a real node the apiserver listens on loopback only, but the `kubernetes`
# Service's endpoints may not be a loopback IP. Nothing routes Service traffic then (no
# kube-proxy), so a documentation address (RFC 5737) keeps that Service valid without
# pretending it is reachable. With a real node it binds and advertises the node IP, which
# pods reach through that Service.
ADVERTISE_ADDRESS = "192.0.2.1"
LOOPBACK = "127.0.0.1"

# kwok manages exactly the nodes carrying this annotation (kwok's own convention).
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
NODE_RESOURCES = {
    "cpu": "32",
    "memory": "2Ti",  # an 8-GPU server's host memory
    "pods": "110",
    "nvidia.com/gpu": "8",
    "ephemeral-storage": "1Ti",
}

# Start order; stop goes in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "kube-router")

# kube-router's identity and what its network policy controller reads (its upstream
# DaemonSet's ClusterRole, less what routing and the service proxy need).
KUBE_ROUTER_USER = "system:kube-router"
KUBE_ROUTER_RBAC = {
    "apiVersion": "v1",
    "kind": "List",
    "items": [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "epd-dev:kube-router"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
                    "verbs": ["get", "list", "watch"],
                },
                {
                    "apiGroups": ["networking.k8s.io"],
                    "resources": ["networkpolicies"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "epd-dev:kube-router"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "epd-dev:kube-router"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KUBE_ROUTER_USER}],
        },
    ],
}

# Entries of the cluster folder this module owns (wiped on a fresh start).
_OWNED = ("state.json", "kubeconfig", "pki", "kubeconfigs", "etcd", "logs", "run", "bin", "kwok.yaml", "node")

_PR_SET_PDEATHSIG = 1

# Project-specific kwok Stages (e.g. simulating failed probes), loaded after
# kwok's standard ones.
EXTRA_STAGES_DIR = Path(__file__).parent / "stages"


class ClusterError(RuntimeError):
    pass


class ClusterBusy(ClusterError):
    """Another live process owns the cluster in this folder."""


@dataclass
class _Proc:
    name: str
    pid: int
    start_ticks: int  # /proc start time: tells our process from a recycled pid
    popen: subprocess.Popen | None = None  # set when this process started it


def _proc_start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (start time); split after the last ')' as the name may hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(proc: _Proc) -> bool:
    return node.process_alive(proc.pid, proc.start_ticks)


def alive_components(state: dict[str, Any]) -> list[str]:
    """The components of a `state.json` snapshot that still run (same pid, same start time)."""
    return [
        name for name, rec in state.get("processes", {}).items() if _alive(_Proc(name, rec["pid"], rec["start_ticks"]))
    ]


def _free_ports(n: int) -> list[int]:
    # Hold every socket until all are chosen so one call never returns duplicates.
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _http_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalCluster:
    """One local control plane rooted at ``dir``.

    ``nodes`` fake GPU nodes are created, and ``real_nodes`` (0 or 1) real ones
    (node.py); the binaries come from the build cache; ``extra_stages`` are kwok
    Stage files added to kwok's standard ones (default: this package's
    ``stages/*.yaml``). The real node's start imports the cluster's own images (the pause
    image, CoreDNS's) and runs the cluster's DNS on it (dns.py); ``on_node_runtime`` is called
    with the `RealNode` once its containerd runs, before its kubelet starts (other images are
    imported then).

    >>> with LocalCluster(".cluster", nodes=4) as c:
    ...     c.kubectl("get", "nodes")
    """

    def __init__(
        self,
        dir: str | os.PathLike = ".cluster",
        nodes: int = 4,
        *,
        die_with_parent: bool = False,
        extra_stages: list[str | os.PathLike] | None = None,
        log: Callable[[str], None] | None = None,
        real_nodes: int = 0,
        on_node_runtime: Callable[[node.RealNode], None] | None = None,
    ) -> None:
        if real_nodes not in (0, 1):
            raise ValueError(f"real_nodes must be 0 or 1 (one machine has room for one), not {real_nodes}")
        self.dir = Path(dir).resolve()
        self.nodes = nodes
        self.real_nodes = real_nodes
        self.on_node_runtime = on_node_runtime
        self.bin_dir = binaries.bin_dir()
        # For test sessions: the kernel kills the components if the launching
        # process dies (even by SIGKILL), so no orphan outlives a killed pytest.
        # SIGKILL, not SIGTERM: all would get it at once, and an apiserver whose
        # etcd vanished first does not finish a graceful shutdown.
        self.die_with_parent = die_with_parent
        self.extra_stages = (
            [Path(p) for p in extra_stages] if extra_stages is not None else sorted(EXTRA_STAGES_DIR.glob("*.yaml"))
        )
        self._log = log or (lambda msg: print(f"[cluster] {msg}", flush=True))
        self._procs: dict[str, _Proc] = {}
        self._ports: dict[str, int] = {}
        self._owner_lock: Any = None  # open file holding flock(<dir>/owner.lock)
        self._api_host: str | None = None  # set by start; else read from state.json

    # ------------------------------------------------------------------ paths

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (group system:masters)."""
        return self.dir / "kubeconfig"

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def pki(self) -> Path:
        return self.dir / "pki"

    @property
    def api_host(self) -> str:
        """The address the apiserver listens on: the node IP with a real node, else loopback."""
        return self._api_host or self._state().get("api_host", LOOPBACK)

    @property
    def server(self) -> str:
        port = self._ports.get("apiserver") or self._state()["ports"]["apiserver"]
        return f"https://{self.api_host}:{port}"

    @property
    def pids(self) -> dict[str, int]:
        """Process id of each component this process started (benchmarks read their CPU time)."""
        return {name: proc.pid for name, proc in self._procs.items()}

    @property
    def node_names(self) -> list[str]:
        """The kwok GPU nodes."""
        return [f"kwok-node-{i}" for i in range(self.nodes)]

    @property
    def real_node_names(self) -> list[str]:
        return [node.NAME] if self.real_nodes else []

    def real_node(self) -> node.RealNode:
        """The real node's handle (its files in <dir>/node; whether it runs or not)."""
        from ..images import recipes

        layout = node.NodeLayout(
            dir=self.dir / "node",
            containerd_root=node.default_containerd_root(),
            sandbox_image=recipes.PAUSE_REF,
            service_cidr=SERVICE_CIDR,
            kwok_pod_cidr=str(ipaddress.ip_network(POD_CIDR, strict=False)),
            cluster_dns_ip=CLUSTER_DNS_IP,
            cluster_domain=dns.DOMAIN,
        )
        return node.RealNode(self.dir, layout, log=self._log)

    def running_real_node(self) -> node.RealNode | None:
        """The real node of this cluster if its containerd runs (`make images` imports then)."""
        try:
            state = self._state()
        except ClusterError:
            return None
        rec = state.get("processes", {}).get("containerd")
        if not rec or not _alive(_Proc("containerd", rec["pid"], rec["start_ticks"])):
            return None
        return self.real_node()

    def env(self) -> dict[str, str]:
        """Environment for tools run against this cluster (kubectl, helm, kopf)."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PATH": f"{self.dir / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
            # Keep kubectl's discovery cache and helm's state out of $HOME.
            "KUBECACHEDIR": str(self.dir / "run" / "kube-cache"),
            "HELM_CACHE_HOME": str(self.dir / "run" / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self.dir / "run" / "helm" / "config"),
            "HELM_DATA_HOME": str(self.dir / "run" / "helm" / "data"),
        }

    # ------------------------------------------------------------- lifecycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 180) -> LocalCluster:
        """Start a fresh cluster, killing whatever an earlier run left in ``dir``. Each wait for a
        component may take `timeout` seconds of its own, whatever came before it: importing the
        node's images takes minutes the first time and is no part of any wait."""
        missing = binaries.missing_by_set(binaries.cluster_sets(self.real_nodes))
        if missing:
            raise ClusterError(
                f"binaries missing: {binaries.describe_missing(missing)}. Build them once with: make cluster"
            )
        for attempt in (1, 2):
            try:
                self._start(timeout)
                return self
            except ClusterError as err:
                # A port picked free can be taken by someone else before the
                # component binds it; that race deserves one more try.
                if attempt == 1 and "address already in use" in str(err):
                    self._log("a port was taken meanwhile; retrying with new ports")
                    continue
                raise
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        began = time.monotonic()
        self._claim_dir()
        leftovers = self._terminate_recorded()
        if leftovers:
            self._log(f"killed leftovers of an earlier run in {self.dir}: {', '.join(leftovers)}")
        real = self.real_node() if self.real_nodes else None
        if real is not None:
            node.install_packages(self._log)
            try:
                real.claim()  # NodeBusy while another cluster's node runs; cleans a dead one's leftovers
            except node.NodeError:
                self._release_dir()  # nothing of this run started: a cluster without the node may take it
                raise
        elif self.real_node_owned():
            self.real_node().release()  # an earlier run of this folder had one
        self._reset_dir()
        self._api_host = node.NODE_IP if real is not None else LOOPBACK
        names = ("etcd", "etcd-peer", "apiserver", "controller-manager", "scheduler", "kwok")
        ports = dict(zip(names, _free_ports(len(names)), strict=True))
        self._ports = ports
        self._procs = {}
        self._write_state()
        try:
            if real is not None:
                real.prepare_network()  # the node IP exists before the apiserver binds it
            self._write_credentials()
            self._link_tools()
            nodes = f"{self.nodes} kwok nodes" + (f" and the real node {node.NAME}" if real else "")
            self._log(f"starting in {self.dir} (apiserver {self.api_host}:{ports['apiserver']}, {nodes})")
            self._spawn("etcd", self._etcd_args())
            self._wait("etcd healthy", self._etcd_healthy, timeout, "etcd")
            self._spawn("kube-apiserver", self._apiserver_args())
            self._wait("kube-apiserver ready", self._apiserver_ready, timeout, "kube-apiserver")
            # Nodes exist before kwok starts so it picks them all up at once.
            self._create_nodes()
            self._spawn("kube-controller-manager", self._controller_manager_args())
            self._spawn("kube-scheduler", self._scheduler_args())
            self._spawn("kwok", self._kwok_args())
            if real is not None:
                self._start_real_node(real, timeout)
            self._wait(
                "kube-controller-manager healthy",
                lambda: self._https_ok(ports["controller-manager"]),
                timeout,
                "kube-controller-manager",
            )
            self._wait("kube-scheduler healthy", lambda: self._https_ok(ports["scheduler"]), timeout, "kube-scheduler")
            self._wait("kwok healthy", self._kwok_healthy, timeout, "kwok")
            self._wait(f"{self.nodes} nodes Ready and untainted", self._nodes_ready, timeout, "kwok")
            if real is not None:
                self._wait(f"{node.NAME} Ready", self._real_node_ready, timeout, "kubelet")
                self.kubectl(
                    "patch",
                    "node",
                    node.NAME,
                    "--subresource=status",
                    "--type=json",
                    "-p",
                    json.dumps(node.gpu_status_patch(node.GPUS)),
                )
                self._wait(f"{node.NAME} offers nvidia.com/gpu: {node.GPUS}", self._real_node_gpus, timeout, "kubelet")
                self._start_cluster_dns(timeout)
            self._wait("default ServiceAccount", self._default_sa_exists, timeout, "kube-controller-manager")
        except BaseException:
            self.stop(quiet=True)
            raise
        self._log(f"cluster ready in {format_seconds(time.monotonic() - began)}; KUBECONFIG={self.kubeconfig}")

    def _start_real_node(self, real: node.RealNode, timeout: float) -> None:
        """Start containerd, run `on_node_runtime`, start the kubelet, kube-proxy and kube-router;
        each wait has `timeout` seconds from when it begins."""
        real.write_configs(self.pki, self.dir / "kubeconfigs")
        self._spawn("containerd", real.containerd_args(), binary=node.CONTAINERD)
        self._wait("containerd ready", real.containerd_ready, timeout, "containerd")
        real.purge_containers()  # what a killed run left in the kept containerd root
        from ..images import build as images

        images.Builder(log=self._log).import_cached(real, images.CLUSTER_IMAGES)
        if self.on_node_runtime is not None:
            self.on_node_runtime(real)
        self._spawn("kubelet", real.kubelet_args(self.dir / "kubeconfigs"), binary=self._node_bin("kubelet"))
        self._spawn("kube-proxy", real.kube_proxy_args(), binary=self._node_bin("kube-proxy"))
        self.kubectl("apply", "-f", "-", input=json.dumps(KUBE_ROUTER_RBAC))
        (health_port,) = _free_ports(1)
        self._spawn(
            "kube-router",
            real.kube_router_args(self.dir / "kubeconfigs", health_port),
            binary=binaries.bin_dir(binaries.NETWORK_POLICY) / "kube-router",
        )
        self._wait("kube-router enforcing NetworkPolicies", lambda: _http_ok(health_port), timeout, "kube-router")
        real.record(
            {n: {"pid": p.pid, "start_ticks": p.start_ticks} for n, p in self._procs.items() if n in NODE_COMPONENTS}
        )

    def _start_cluster_dns(self, timeout: float) -> None:
        """CoreDNS on the real node behind kube-dns (dns.py), answering once it is Ready."""
        from ..images import recipes

        objects = dns.objects(CLUSTER_DNS_IP, recipes.COREDNS_REF)
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        self._wait(f"cluster DNS (CoreDNS at {CLUSTER_DNS_IP}) ready", self._dns_ready, timeout, "kubelet")

    def _dns_ready(self) -> bool:
        selector = ",".join(f"{k}%3D{v}" for k, v in dns.LABELS.items())
        status, body = self.api("GET", f"/api/v1/namespaces/{dns.NAMESPACE}/pods?labelSelector={selector}")
        return status == 200 and dns.ready(body)

    @staticmethod
    def _node_bin(name: str) -> Path:
        return binaries.bin_dir(binaries.NODE) / name

    def real_node_owned(self) -> bool:
        """This folder's cluster holds the machine's real node (a run of it may have died)."""
        owner = node.read_owner()
        return owner is not None and Path(owner["cluster_dir"]) == self.dir

    def stop(self, quiet: bool = False) -> None:
        """Stop every component recorded in ``state.json`` (works from any process), and clean
        what the real node leaves on the host."""
        real = self.real_node() if self.real_node_owned() else None
        stopped = real.stop_workloads(self._terminate_named) if real is not None else []
        stopped += self._terminate_recorded()
        if real is not None:
            real.release()
        self._release_dir()
        if stopped and not quiet:
            self._log(f"stopped {', '.join(stopped)}")

    def _terminate_named(self, names: tuple[str, ...]) -> list[str]:
        stopped = []
        for proc in self._recorded_procs():
            if proc.name in names and _alive(proc):
                self._terminate(proc)
                stopped.append(proc.name)
        return stopped

    def _terminate(self, proc: _Proc, grace: float = 10) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # pgid == pid: own session
            deadline = time.monotonic() + grace
            while _alive(proc) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(proc):
                self._log(f"{proc.name} ignored SIGTERM for {grace:.0f}s; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
        if proc.popen is not None:
            proc.popen.wait()

    def _terminate_recorded(self, grace: float = 10) -> list[str]:
        """Terminate what state.json lists, dependents first; return the names stopped.

        One at a time in reverse start order: the apiserver shuts down cleanly
        in about a second while etcd is still there, but hangs if etcd goes first.
        """
        running = [p for p in self._recorded_procs() if _alive(p)]
        for proc in reversed(running):
            self._terminate(proc, grace)
        for proc in self._procs.values():
            if proc.popen is not None:
                proc.popen.wait()  # reap our own children (no zombies)
        self._procs = {}
        if self.state_file.exists():
            self.state_file.unlink()
        return [p.name for p in reversed(running)]

    def restart(
        self, component: str, extra_args: tuple[str, ...] = (), *, hard: bool = False, timeout: float = 120
    ) -> float:
        """Stop ``component`` (SIGKILL if ``hard``, else SIGTERM) and start it again with its
        usual flags plus ``extra_args``; wait until it is healthy and return the seconds taken.

        kube-apiserver and kube-controller-manager, and the real node's kubelet and containerd;
        only in the process that started the cluster (it reaps the old process)."""
        real = self.real_node() if self.real_nodes else None
        checks: dict[str, tuple[Callable[[], list[str]], Callable[[], bool], Path | None]] = {
            "kube-apiserver": (self._apiserver_args, self._apiserver_ready, None),
            "kube-controller-manager": (
                self._controller_manager_args,
                lambda: self._https_ok(self._ports["controller-manager"]),
                None,
            ),
        }
        if real is not None:
            checks["kubelet"] = (
                lambda: real.kubelet_args(self.dir / "kubeconfigs"),
                self._kubelet_healthy,
                self._node_bin("kubelet"),
            )
            checks["containerd"] = (real.containerd_args, real.containerd_ready, node.CONTAINERD)
        if component not in checks:
            raise ValueError(f"cannot restart {component!r}: only {', '.join(checks)}")
        args, healthy, binary = checks[component]
        proc = self._procs.get(component)
        if proc is None or proc.popen is None:
            raise ClusterError(f"{component} was not started by this process: restart it where it was")
        began = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL if hard else signal.SIGTERM)
        proc.popen.wait(timeout=60)
        self._spawn(component, [*args(), *extra_args], binary=binary)
        self._wait(f"{component} healthy again", healthy, timeout, component)
        if real is not None and component in NODE_COMPONENTS:
            real.record(
                {
                    n: {"pid": p.pid, "start_ticks": p.start_ticks}
                    for n, p in self._procs.items()
                    if n in NODE_COMPONENTS
                }
            )
        return time.monotonic() - began

    @staticmethod
    def _kubelet_healthy() -> bool:
        with urllib.request.urlopen("http://127.0.0.1:10248/healthz", timeout=2) as resp:
            return bool(resp.status == 200)

    def _release_dir(self) -> None:
        if self._owner_lock is not None:
            self._owner_lock.close()  # releases the flock
            self._owner_lock = None

    def _claim_dir(self) -> None:
        """Refuse a folder whose cluster another live process (a test session) owns.

        The owner holds flock(<dir>/owner.lock) until stop() or its exit, even
        by SIGKILL. The CLI's `up` exits once the cluster is ready, so a cluster
        it started has no owner: another `up` may replace it, `down` stops it.
        """
        if self._owner_lock is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.dir / "owner.lock", "a")  # noqa: SIM115 - held (with its flock) until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            try:
                owner = f" (pid {self._state()['launcher_pid']})"
            except (ClusterError, ValueError, KeyError):
                owner = ""
            raise ClusterBusy(f"{self.dir} is in use by another running process{owner}") from None
        self._owner_lock = lock

    def status(self) -> dict[str, Any]:
        """What is running, per component, and whether the apiserver answers."""
        state = self._state() if self.state_file.exists() else {}
        procs = {p.name: p for p in self._recorded_procs()}
        names = COMPONENTS + (NODE_COMPONENTS if state.get("real_nodes") else ())
        components = {n: (n in procs and _alive(procs[n])) for n in names}
        ready = bool(state) and components["kube-apiserver"] and self._apiserver_ready()
        return {
            "dir": str(self.dir),
            "running": ready and all(components.values()),
            "apiserver_ready": ready,
            "components": components,
            "server": self.server if state else None,
            "kubeconfig": str(self.kubeconfig) if state else None,
        }

    # ---------------------------------------------------------------- helpers

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against this cluster; raise ClusterError on failure if ``check``."""
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        out = subprocess.run(
            cmd, check=False, input=input, capture_output=True, text=True, timeout=timeout, env=self.env()
        )
        if check and out.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
        return out

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Minimal admin REST call: (status, decoded JSON body)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, context=self._admin_tls(), timeout=10) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, raw = err.code, err.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    # --------------------------------------------------------- setup details

    def _reset_dir(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in _OWNED:
            path = self.dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        for sub in ("logs", "run", "bin", "kubeconfigs"):
            (self.dir / sub).mkdir()

    def _write_credentials(self) -> None:
        from .pki import PKI  # cryptography is only needed when starting a cluster

        pki = PKI(self.pki)
        pki.issue(
            "apiserver",
            "kube-apiserver",
            dns=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=(LOOPBACK, FIRST_SERVICE_IP, *([node.NODE_IP] if self.real_nodes else [])),
        )
        pki.service_account_keys()
        pki.issue("front-proxy-client", "front-proxy-client")
        # Each component gets its own identity so the bootstrap RBAC roles are
        # what authorizes them, as in a real cluster. kwok plays every kubelet,
        # so it gets the admin group like the cluster admin.
        identities = {
            "admin": ("kubernetes-admin", ("system:masters",)),
            "controller-manager": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
            "kwok": ("kwok-controller", ("system:masters",)),
        }
        if self.real_nodes:
            # As kubeadm: the kubelet is system:node:<name> (the Node authorizer and
            # NodeRestriction), kube-proxy system:kube-proxy (bound to system:node-proxier), and
            # the kubelet serves with a certificate of the cluster CA for the node IP.
            identities["kubelet"] = (f"system:node:{node.NAME}", ("system:nodes",))
            identities["kube-proxy"] = ("system:kube-proxy", ())
            identities["kube-router"] = (KUBE_ROUTER_USER, ())
            pki.issue("kubelet-serving", f"system:node:{node.NAME}", dns=(node.NAME,), ips=(node.NODE_IP,))
            # What the apiserver shows the kubelet for logs, exec and port-forward.
            pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client", orgs=("system:masters",))
        for name, (cn, orgs) in identities.items():
            pki.issue(name, cn, orgs=orgs)
            target = self.kubeconfig if name == "admin" else self.dir / "kubeconfigs" / f"{name}.kubeconfig"
            self._write_kubeconfig(target, name)
        stages = [self.bin_dir.parent / binaries.KWOK_STAGES, *self.extra_stages]
        (self.dir / "kwok.yaml").write_text("\n---\n".join(p.read_text().strip() for p in stages) + "\n")

    def _write_kubeconfig(self, path: Path, user: str) -> None:
        # Credentials are embedded so the file works when copied elsewhere.
        path.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: epd-local
  cluster:
    server: https://{self.api_host}:{self._ports["apiserver"]}
    certificate-authority-data: {_b64(self.pki / "ca.crt")}
users:
- name: {user}
  user:
    client-certificate-data: {_b64(self.pki / f"{user}.crt")}
    client-key-data: {_b64(self.pki / f"{user}.key")}
contexts:
- name: epd-local
  context:
    cluster: epd-local
    user: {user}
    namespace: default
current-context: epd-local
"""
        )
        path.chmod(0o600)

    def _link_tools(self) -> None:
        for tool in ("kubectl", "helm"):
            (self.dir / "bin" / tool).symlink_to(self.bin_dir / tool)

    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self._ports['etcd']}"
        peer = f"http://127.0.0.1:{self._ports['etcd-peer']}"
        return [
            "--name=local",
            f"--data-dir={self.dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}",
            # Throwaway data: skipping fsync keeps 2-core machines responsive.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def _apiserver_args(self) -> list[str]:
        pki = self.pki
        return [
            f"--etcd-servers=http://127.0.0.1:{self._ports['etcd']}",
            f"--bind-address={self.api_host}",
            f"--advertise-address={node.NODE_IP if self.real_nodes else ADVERTISE_ADDRESS}",
            f"--secure-port={self._ports['apiserver']}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--cert-dir={self.dir / 'run' / 'apiserver'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            "--authorization-mode=Node,RBAC",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            # Front-proxy (aggregation layer) settings as kubeadm sets them; the
            # controller-manager and scheduler read this CA for delegated authn.
            f"--requestheader-client-ca-file={pki / 'ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--allow-privileged=true",
            "--profiling=false",
            *(self._kubelet_client_args() if self.real_nodes else []),
        ]

    def _kubelet_client_args(self) -> list[str]:
        """The apiserver's side of the kubelet API (logs, exec, port-forward), as kubeadm."""
        pki = self.pki
        return [
            f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={pki / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            "--enable-admission-plugins=NodeRestriction",
        ]

    def _controller_manager_args(self) -> list[str]:
        kc = self.dir / "kubeconfigs" / "controller-manager.kubeconfig"
        pki = self.pki
        return [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self._ports['controller-manager']}",
            f"--cert-dir={self.dir / 'run' / 'controller-manager'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            # Default set: deployment, replicaset, garbage-collector, namespace,
            # serviceaccount(-token), nodelifecycle, job, ... (all upstream defaults).
            "--controllers=*",
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _scheduler_args(self) -> list[str]:
        kc = self.dir / "kubeconfigs" / "scheduler.kubeconfig"
        return [
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--bind-address=127.0.0.1",
            f"--secure-port={self._ports['scheduler']}",
            f"--cert-dir={self.dir / 'run' / 'scheduler'}",
            "--leader-elect=false",
            "--profiling=false",
        ]

    def _kwok_args(self) -> list[str]:
        key, value = KWOK_ANNOTATION
        return [
            f"--kubeconfig={self.dir / 'kubeconfigs' / 'kwok.kubeconfig'}",
            # Our own config only: never pick up a user's ~/.kwok/kwok.yaml.
            f"--config={self.dir / 'kwok.yaml'}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={key}={value}",
            f"--cidr={POD_CIDR}",
            # Node leases keep the node lifecycle controller from tainting nodes.
            "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{self._ports['kwok']}",
        ]

    def _create_nodes(self) -> None:
        for name in self.node_names:
            node = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1]},
                    "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        "type": "kwok",
                    },
                },
                # Unlike most objects, a Node's status is kept on create: this is
                # how a kubelet registers its capacity.
                "status": {"capacity": NODE_RESOURCES, "allocatable": NODE_RESOURCES},
            }
            status, body = self.api("POST", "/api/v1/nodes", node)
            if status != 201:
                raise ClusterError(f"creating node {name} failed: {status} {body}")

    # ------------------------------------------------------- process control

    def _spawn(self, name: str, args: list[str], binary: Path | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the process, closed below
        preexec = _die_with_parent if self.die_with_parent else None
        try:
            popen = subprocess.Popen(
                [str(binary or self.bin_dir / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir / "run",
                # Own process group: Ctrl-C in the launching shell does not reach
                # it, and stop() can signal the whole group.
                start_new_session=True,
                # Only prctl runs between fork and exec (no lock taken): safe beside threads.
                preexec_fn=preexec,  # noqa: PLW1509
            )
        finally:
            log.close()
        ticks = _proc_start_ticks(popen.pid) or 0
        self._procs[name] = _Proc(name, popen.pid, ticks, popen)
        self._write_state()

    def _write_state(self) -> None:
        state = {
            "ports": self._ports,
            "api_host": self.api_host,
            "nodes": self.nodes,
            "real_nodes": self.real_nodes,
            "bin_dir": str(self.bin_dir),
            "launcher_pid": os.getpid(),
            "processes": {p.name: {"pid": p.pid, "start_ticks": p.start_ticks} for p in self._procs.values()},
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.state_file)

    def _state(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            raise ClusterError(f"no cluster in {self.dir} (no state.json): start one with make cluster-up") from None

    def _recorded_procs(self) -> list[_Proc]:
        """Processes in state.json; our own Popen handles where this process started them."""
        try:
            state = self._state()
        except (ClusterError, ValueError):
            return []
        self._ports = state.get("ports", {})
        procs = []
        for name, rec in state.get("processes", {}).items():
            mine = self._procs.get(name)
            if mine and mine.pid == rec["pid"]:
                procs.append(mine)
            else:
                procs.append(_Proc(name, rec["pid"], rec["start_ticks"]))
        return procs

    def _wait(self, what: str, check: Callable[[], bool], timeout: float, component: str) -> None:
        began = time.monotonic()
        deadline = began + timeout
        while True:
            dead = [p.name for p in self._procs.values() if not _alive(p)]
            if dead:
                raise self._failure(f"{dead[0]} exited while waiting for {what}", dead[0])
            try:
                if check():
                    break
            except (OSError, ValueError, KeyError, TypeError):
                pass  # not up yet (URLError and SSLError are OSErrors)
            if time.monotonic() > deadline:
                raise self._failure(f"timed out waiting for {what}", component)
            time.sleep(0.2)
        self._log(f"{what} ({format_seconds(time.monotonic() - began)})")

    def _failure(self, message: str, component: str) -> ClusterError:
        log = self.logs / f"{component}.log"
        detail = f"{message}\n--- last lines of {log} ---\n{_tail(log)}"
        self._log(detail)
        return ClusterError(detail)

    # ---------------------------------------------------------- readiness

    def _admin_tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    def _etcd_healthy(self) -> bool:
        url = f"http://127.0.0.1:{self._ports['etcd']}/health"
        with urllib.request.urlopen(url, timeout=2) as resp:
            return json.loads(resp.read()).get("health") == "true"

    def _apiserver_ready(self) -> bool:
        try:
            status, _ = self.api("GET", "/readyz")
        except (OSError, urllib.error.URLError, ssl.SSLError, ClusterError):
            return False
        return status == 200

    @staticmethod
    def _https_ok(port: int) -> bool:
        # Controller-manager and scheduler serve /healthz with a self-signed
        # cert; /healthz is always allowed, so no credentials are needed.
        ctx = ssl._create_unverified_context()
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2) as resp:
            return resp.status == 200

    def _kwok_healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self._ports['kwok']}/healthz", timeout=2) as resp:
            return resp.status == 200

    def _nodes_ready(self) -> bool:
        status, body = self.api("GET", "/api/v1/nodes")
        if status != 200:
            return False
        ready = 0
        for item in body["items"]:
            conditions = {c["type"]: c["status"] for c in item.get("status", {}).get("conditions", [])}
            # The not-ready taint goes once the node lifecycle controller sees Ready.
            if conditions.get("Ready") == "True" and not item["spec"].get("taints"):
                ready += 1
        return ready >= self.nodes

    def _real_node_ready(self) -> bool:
        status, body = self.api("GET", f"/api/v1/nodes/{node.NAME}")
        if status != 200:
            return False
        conditions = {c["type"]: c["status"] for c in body.get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True"

    def _real_node_gpus(self) -> bool:
        status, body = self.api("GET", f"/api/v1/nodes/{node.NAME}")
        return status == 200 and body["status"].get("allocatable", {}).get("nvidia.com/gpu") == str(node.GPUS)

    def _default_sa_exists(self) -> bool:
        status, _ = self.api("GET", "/api/v1/namespaces/default/serviceaccounts/default")
        return status == 200


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
