"""The control plane and real node binaries: versions, cache location, and the one-time build.

    python -m epd_dev.localcluster.build [--real-nodes 0|1] [--promtool] [--autoscaling] [--force] [--print-bin-dir]

Every binary is compiled from published Go modules pinned by the go.mod/go.sum
files under hack/go (no Docker, no release downloads). Four sets, each with a cache
of its own: the control plane (``CONTROL_PLANE``: hack/go/{kubernetes,etcd,kwok,helm})
in ``<cache root>/controlplane/<key>/bin``, with promtool (``MONITORING``: hack/go/prometheus,
which checks the chart's alerting rules) in ``<cache root>/monitoring/<key>/bin``; the real
node's kubelet and kube-proxy (``NODE``: hack/go/node) in ``<cache root>/node/<key>/bin``
(``epd_dev.paths.cache_root``), and its NetworkPolicy engine, kube-router
(``NETWORK_POLICY``: hack/go/kube-router), in ``<cache root>/network-policy/<key>/bin``, and the
cluster's DNS, CoreDNS (``CLUSTER_DNS``: hack/go/coredns), in ``<cache root>/cluster-dns/<key>/bin``.
The autoscaling stack (``AUTOSCALING``: KEDA from hack/go/keda, the Prometheus server from
hack/go/prometheus) is built on demand only (``--autoscaling``), in ``<cache root>/autoscaling/<key>``.
``cluster_sets`` is the one list of what a local cluster starts with: its start checks it, and
``make cluster`` and ``make demo`` build it.
A set's key names its versions plus a hash of its own Go module files only, so changing a
pin builds a fresh cache entry of that set and never mixes versions; the node's module
can change without rebuilding the control plane (the Go build cache makes the node quick
once the control plane is built: they share most packages).

Binaries go to ``<key>.partial`` first and the folder is renamed to ``<key>``
only when all of them pass their version check: an interrupted build leaves no
half cache behind, and the next run keeps the binaries it already finished.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..locking import file_lock
from ..progress import CommandFailed, format_seconds, run_with_progress

K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"
KUBE_ROUTER_VERSION = "v2.1.0"
COREDNS_VERSION = "v1.15.0"
# Prometheus' Go module versions v0.3MM.P are its releases 3.MM.P.
PROMETHEUS_MODULE_VERSION = "v0.316.0"
PROMETHEUS_VERSION = "3.16.0"
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator"
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
# v2.21.1's go.mod requires Go 1.27.4; v2.21.0 builds with this machine's Go 1.26.
KEDA_VERSION = "v2.21.0"
KEDA = "github.com/kedacore/keda/v2"

# Bump when the build recipe changes in a way the Go files do not show.
RECIPE = "1"
NODE_RECIPE = "1"
NETWORK_POLICY_RECIPE = "1"
CLUSTER_DNS_RECIPE = "1"
MONITORING_RECIPE = "2"
AUTOSCALING_RECIPE = "1"

# Upstream's own release flags; without the -X values the binaries say v0.0.0.
# The warm-up build used exactly these, so the Go build cache is shared.
_K8S_MAJOR, _K8S_MINOR = K8S_VERSION.lstrip("v").split(".")[:2]
K8S_LDFLAGS = " ".join(
    [
        "-s -w",
        f"-X k8s.io/component-base/version.gitVersion={K8S_VERSION}",
        f"-X k8s.io/component-base/version.gitMajor={_K8S_MAJOR}",
        f"-X k8s.io/component-base/version.gitMinor={_K8S_MINOR}",
        "-X k8s.io/component-base/version.gitTreeState=clean",
    ]
)


@dataclass(frozen=True)
class Binary:
    name: str
    module: str  # wrapper module folder under hack/go
    package: str
    version_args: tuple[str, ...]
    expect: str  # must appear in the version output
    tags: tuple[str, ...] = ()  # Go build tags
    # No version flag (KEDA's programs): the version output is the binary's Go build info
    # (`go version -m`), which names the module versions compiled in and the -ldflags.
    build_info: bool = False


BINARIES: tuple[Binary, ...] = (
    # Biggest first: it compiles most of the shared packages.
    Binary(
        "kube-apiserver",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-apiserver",
        ("--version",),
        f"Kubernetes {K8S_VERSION}",
    ),
    Binary(
        "kube-controller-manager",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        ("--version",),
        f"Kubernetes {K8S_VERSION}",
    ),
    Binary(
        "kube-scheduler",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        ("--version",),
        f"Kubernetes {K8S_VERSION}",
    ),
    Binary(
        "kubectl",
        "kubernetes",
        "k8s.io/kubernetes/cmd/kubectl",
        ("version", "--client"),
        f"Client Version: {K8S_VERSION}",
    ),
    Binary("etcd", "etcd", ".", ("--version",), f"etcd Version: {ETCD_VERSION.lstrip('v')}"),
    Binary("kwok", "kwok", "sigs.k8s.io/kwok/cmd/kwok", ("--version",), KWOK_VERSION),
    Binary("helm", "helm", "helm.sh/helm/v3/cmd/helm", ("version", "--short"), HELM_VERSION),
)
NAMES = tuple(b.name for b in BINARIES)

NODE_BINARIES: tuple[Binary, ...] = (
    Binary("kubelet", "node", "k8s.io/kubernetes/cmd/kubelet", ("--version",), f"Kubernetes {K8S_VERSION}"),
    Binary("kube-proxy", "node", "k8s.io/kubernetes/cmd/kube-proxy", ("--version",), f"Kubernetes {K8S_VERSION}"),
)
KUBE_ROUTER = Binary(
    "kube-router",
    "kube-router",
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router",
    ("--version",),
    f"version {KUBE_ROUTER_VERSION},",
)
# The cluster's DNS on the real node: CoreDNS with the plugins of its Corefile (hack/go/coredns).
COREDNS = Binary("coredns", "coredns", ".", ("-version",), f"CoreDNS-{COREDNS_VERSION.lstrip('v')}")

PROMTOOL = Binary(
    "promtool",
    "prometheus",
    "github.com/prometheus/prometheus/cmd/promtool",
    ("--version",),
    f"promtool, version {PROMETHEUS_VERSION} ",
    # Without the service discovery plugins (Prometheus' own build tag): the rule checks need
    # none, and the build takes half the time (1 min 47 s cold on 2 cores).
    ("remove_all_sd",),
)

# The autoscaling stack, as KEDA's Makefile names its programs (the images' entrypoints).
KEDA_BINARIES = tuple(
    Binary(name, "keda", f"{KEDA}/cmd/{command}", (), f"{KEDA}\t{KEDA_VERSION}\t", build_info=True)
    for name, command in (("keda", "operator"), ("keda-adapter", "adapter"), ("keda-admission-webhooks", "webhooks"))
)
PROMETHEUS = Binary(
    "prometheus",
    "prometheus",
    "github.com/prometheus/prometheus/cmd/prometheus",
    ("--version",),
    f"prometheus, version {PROMETHEUS_VERSION} ",
    # Kubernetes service discovery only (Prometheus' own build tags, plugins/*.go), and no web UI
    # assets (no `builtinassets`): its API is what KEDA's scaler queries.
    ("remove_all_sd", "enable_kubernetes_sd"),
)


@dataclass(frozen=True)
class BinarySet:
    """Binaries built and cached together: ``pins`` are (wrapper module, required module,
    version), what the cache key trusts; the key hashes exactly those modules' Go files."""

    name: str  # the cache folder under the cache root
    binaries: tuple[Binary, ...]
    pins: tuple[tuple[str, str, str], ...]
    recipe: str
    versions: str  # the cache key's readable part

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.binaries)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(module for module, _, _ in self.pins)


CONTROL_PLANE = BinarySet(
    "controlplane",
    BINARIES,
    (
        ("kubernetes", "k8s.io/kubernetes", K8S_VERSION),
        ("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION),
        ("kwok", "sigs.k8s.io/kwok", KWOK_VERSION),
        ("helm", "helm.sh/helm/v3", HELM_VERSION),
    ),
    RECIPE,
    f"k8s-{K8S_VERSION}_etcd-{ETCD_VERSION}_kwok-{KWOK_VERSION}_helm-{HELM_VERSION}",
)
NODE = BinarySet(
    "node", NODE_BINARIES, (("node", "k8s.io/kubernetes", K8S_VERSION),), NODE_RECIPE, f"k8s-{K8S_VERSION}"
)
NETWORK_POLICY = BinarySet(
    "network-policy",
    (KUBE_ROUTER,),
    (("kube-router", "github.com/cloudnativelabs/kube-router/v2", KUBE_ROUTER_VERSION),),
    NETWORK_POLICY_RECIPE,
    f"kube-router-{KUBE_ROUTER_VERSION}",
)
CLUSTER_DNS = BinarySet(
    "cluster-dns",
    (COREDNS,),
    (("coredns", "github.com/coredns/coredns", COREDNS_VERSION),),
    CLUSTER_DNS_RECIPE,
    f"coredns-{COREDNS_VERSION}",
)
# promtool checks and unit-tests the chart's alerting rules (tests/helm).
MONITORING = BinarySet(
    "monitoring",
    (PROMTOOL,),
    (
        ("prometheus", "github.com/prometheus/prometheus", PROMETHEUS_MODULE_VERSION),
        ("prometheus", PROMETHEUS_OPERATOR, PROMETHEUS_OPERATOR_VERSION),
    ),
    MONITORING_RECIPE,
    f"prometheus-{PROMETHEUS_VERSION}_prometheus-operator-{PROMETHEUS_OPERATOR_VERSION}",
)

# KEDA and the Prometheus it queries, installed on a running cluster by
# `python -m epd_dev.localcluster.autoscaling up` (make autoscaling-up). KEDA's manifests (its
# module's config/ kustomize tree) are copied into the cache with its binaries.
AUTOSCALING = BinarySet(
    "autoscaling",
    (*KEDA_BINARIES, PROMETHEUS),
    (
        ("keda", KEDA, KEDA_VERSION),
        ("prometheus", "github.com/prometheus/prometheus", PROMETHEUS_MODULE_VERSION),
    ),
    AUTOSCALING_RECIPE,
    f"keda-{KEDA_VERSION}_prometheus-{PROMETHEUS_VERSION}",
)


def cluster_sets(real_nodes: int) -> tuple[BinarySet, ...]:
    """The binary sets a local cluster starts with: the control plane, and with the real node its
    kubelet and kube-proxy, its NetworkPolicy engine and the cluster's DNS, which runs on it."""
    return (CONTROL_PLANE, NODE, NETWORK_POLICY, CLUSTER_DNS) if real_nodes else (CONTROL_PLANE,)


# The Prometheus Operator's CRDs of the chart's monitoring objects, copied from its module into
# the monitoring cache: the tests validate the rendered objects against them on the API server.
MONITORING_CRDS_DIR = "crds"
MONITORING_CRDS = (
    "monitoring.coreos.com_podmonitors.yaml",
    "monitoring.coreos.com_servicemonitors.yaml",
    "monitoring.coreos.com_prometheusrules.yaml",
)

# kwok ships no default stages in its binary (kwokctl injects them), so the
# launcher feeds it these files from the same kwok module: nodes become Ready
# and keep a lease; pods bound to them become Running and Ready; deleted pods go.
KWOK_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
KWOK_STAGES = "kwok-stages.yaml"
MANIFEST = "manifest.json"
KEDA_CONFIG_DIR = "keda-config"


def log(msg: str, bset_name: str = "controlplane") -> None:
    print(f"[{bset_name}] {msg}", flush=True)


def _go_dir() -> Path:
    return paths.GO_MODULES


def _check_pins(bset: BinarySet) -> None:
    """Refuse to build if a go.mod disagrees with the versions named in the key."""
    for module, path, version in bset.pins:
        gomod = (_go_dir() / module / "go.mod").read_text()
        if not re.search(rf"^\s*(require\s+)?{re.escape(path)} {re.escape(version)}\b", gomod, re.MULTILINE):
            raise SystemExit(
                f"{_go_dir() / module / 'go.mod'} does not require {path} {version}; "
                "update the version constants in hack/epd_dev/localcluster/binaries.py with it"
            )


def cache_key(bset: BinarySet = CONTROL_PLANE) -> str:
    digest = hashlib.sha256(bset.recipe.encode())
    for path in sorted(_go_dir().glob("*/*")):
        if path.parent.name in bset.modules and path.suffix in (".go", ".mod", ".sum"):
            digest.update(str(path.relative_to(_go_dir())).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return f"{bset.versions}_{digest.hexdigest()[:12]}"


def cache_root(bset: BinarySet = CONTROL_PLANE) -> Path:
    return paths.cache_root() / bset.name


def cache_dir(bset: BinarySet = CONTROL_PLANE) -> Path:
    return cache_root(bset) / cache_key(bset)


def bin_dir(bset: BinarySet = CONTROL_PLANE) -> Path:
    """Where the binaries are once built (they may not exist yet)."""
    return cache_dir(bset) / "bin"


def missing_binaries(bset: BinarySet = CONTROL_PLANE) -> list[str]:
    """Names not yet built into the cache (empty when the cache is complete)."""
    if not (cache_dir(bset) / MANIFEST).is_file():
        return list(bset.names)
    return [n for n in bset.names if not os.access(bin_dir(bset) / n, os.X_OK)]


def missing_by_set(sets: tuple[BinarySet, ...]) -> dict[BinarySet, list[str]]:
    """Each set of `sets` that lacks binaries, with their names (empty when all are built)."""
    missing = {bset: missing_binaries(bset) for bset in sets}
    return {bset: names for bset, names in missing.items() if names}


def describe_missing(missing: dict[BinarySet, list[str]]) -> str:
    """What is missing and where it belongs, for an error that ends with the command to build it."""
    return "; ".join(f"{', '.join(names)} (in {bin_dir(bset)})" for bset, names in missing.items())


def version_of(path: Path, binary: Binary) -> str | None:
    """The binary's version output if it contains the expected version (for a `build_info`
    binary, the line of its build info that does)."""
    cmd = ["go", "version", "-m", str(path)] if binary.build_info else [str(path), *binary.version_args]
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).strip()
    if out.returncode != 0 or binary.expect not in text:
        return None
    return next(line.strip() for line in text.splitlines() if binary.expect in line) if binary.build_info else text


def _go(module: str, *args: str) -> str:
    return subprocess.run(
        ["go", *args], cwd=_go_dir() / module, check=True, capture_output=True, text=True
    ).stdout.strip()


def _ldflags(binary: Binary) -> str:
    if binary.module in ("kubernetes", "node"):
        return K8S_LDFLAGS
    if binary is KUBE_ROUTER:
        # kube-router's Makefile sets these; without them it says "version , built on ".
        v = "github.com/cloudnativelabs/kube-router/v2/pkg/version"
        return f"-s -w -X {v}.Version={KUBE_ROUTER_VERSION} -X {v}.BuildDate=epd-dev"
    if binary.name == "helm":
        # Mirrors helm's Makefile: its version, plus the Kubernetes version it
        # reports to charts, derived from the client-go it was built with.
        client_go = _go("helm", "list", "-m", "-f", "{{.Version}}", "k8s.io/client-go")
        major, minor = client_go.lstrip("v").split(".")[:2]
        v = "helm.sh/helm/v3"
        return " ".join(
            [
                "-s -w",
                f"-X {v}/internal/version.version={HELM_VERSION}",
                f"-X {v}/internal/version.gitTreeState=clean",
                f"-X {v}/pkg/lint/rules.k8sVersionMajor={int(major) + 1}",
                f"-X {v}/pkg/lint/rules.k8sVersionMinor={minor}",
                f"-X {v}/pkg/chartutil.k8sVersionMajor={int(major) + 1}",
                f"-X {v}/pkg/chartutil.k8sVersionMinor={minor}",
            ]
        )
    if binary in (PROMTOOL, PROMETHEUS):
        v = "github.com/prometheus/common/version"
        return f"-s -w -X {v}.Version={PROMETHEUS_VERSION} -X {v}.Branch=release -X {v}.Revision=epd-dev"
    if binary in KEDA_BINARIES:
        # KEDA's Makefile sets these (the release's Version has no "v"); without them it says "main".
        v = f"{KEDA}/version"
        return f"-s -w -X={v}.Version={KEDA_VERSION.lstrip('v')} -X={v}.GitCommit=epd-dev"
    return "-s -w"  # etcd and kwok carry their versions as constants


def _go_build(binary: Binary, out: Path, say: Callable[[str], None] = log) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [
        "go",
        "build",
        "-buildvcs=false",
        "-trimpath",
        *(("-tags", ",".join(binary.tags)) if binary.tags else ()),
        "-ldflags",
        _ldflags(binary),
        "-o",
        str(tmp),
        binary.package,
    ]
    # Static binaries like upstream's releases; same env as the warm-up build.
    env = {**os.environ, "CGO_ENABLED": "0"}
    try:
        run_with_progress(cmd, f"building {binary.name}", say, env=env, cwd=_go_dir() / binary.module)
        os.replace(tmp, out)
    except CommandFailed as error:
        raise SystemExit(f"go build of {binary.name}: {error}") from None
    finally:
        tmp.unlink(missing_ok=True)  # only a failed or interrupted build leaves it


def _write_kwok_stages(dest: Path) -> None:
    kwok_src = Path(_go("kwok", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"))
    docs = [
        f"# From sigs.k8s.io/kwok@{KWOK_VERSION} {name} (Apache-2.0)\n" + (kwok_src / name).read_text().strip()
        for name in KWOK_STAGE_FILES
    ]
    dest.write_text("\n---\n".join(docs) + "\n")


def _write_monitoring_crds(dest: Path) -> None:
    _go("prometheus", "mod", "download", PROMETHEUS_OPERATOR)
    module = Path(_go("prometheus", "list", "-m", "-f", "{{.Dir}}", PROMETHEUS_OPERATOR))
    dest.mkdir(parents=True, exist_ok=True)
    for name in MONITORING_CRDS:
        shutil.copyfile(module / "example" / "prometheus-operator-crd" / name, dest / name)


def _write_keda_config(dest: Path) -> None:
    """KEDA's own kustomize tree (CRDs, RBAC, its three Deployments, Services, APIService,
    webhooks), which the install renders as KEDA's release does (config/default)."""
    source = Path(_go("keda", "list", "-m", "-f", "{{.Dir}}", KEDA)) / "config"
    for path in sorted(source.rglob("*")):
        if path.is_file():
            # Written anew: the module cache's files and folders are read-only.
            (dest / path.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
            (dest / path.relative_to(source)).write_bytes(path.read_bytes())


def keda_config() -> Path:
    """KEDA's config/ tree in the autoscaling cache (built by `make autoscaling`)."""
    return cache_dir(AUTOSCALING) / KEDA_CONFIG_DIR


def monitoring_crds() -> list[Path]:
    """The Prometheus Operator's CRD files in the monitoring cache (built by `make cluster`)."""
    return [cache_dir(MONITORING) / MONITORING_CRDS_DIR / name for name in MONITORING_CRDS]


def _verify_all(bset: BinarySet, bindir: Path) -> list[str]:
    return [b.name for b in bset.binaries if version_of(bindir / b.name, b) is None]


def build(force: bool = False, bset: BinarySet = CONTROL_PLANE) -> Path:
    """Build whatever is missing and return the bin folder of the complete cache."""
    if shutil.which("go") is None:
        raise SystemExit(
            "the control plane is built from Go modules: install Go 1.26 or newer and put it on PATH "
            "(https://go.dev/doc/install), then run this again"
        )
    _check_pins(bset)

    def say(msg: str) -> None:
        log(msg, bset.name)

    key = cache_key(bset)
    final = cache_root(bset) / key
    with file_lock(cache_root(bset) / ".build.lock", say):
        if final.exists() and not force:
            bad = _verify_all(bset, final / "bin") if not missing_binaries(bset) else list(bset.names)
            if not bad:
                say(f"all binaries cached in {final / 'bin'}")
                return final / "bin"
            say(f"cache {final} is broken ({', '.join(bad)}); rebuilding")
            force = True
        staging = cache_root(bset) / f"{key}.partial"
        if force:
            shutil.rmtree(staging, ignore_errors=True)
        (staging / "bin").mkdir(parents=True, exist_ok=True)

        go_version = subprocess.run(["go", "version"], check=True, capture_output=True, text=True).stdout.strip()
        say(f"building into {final} ({go_version})")
        timings: dict[str, float] = {}
        total = time.monotonic()
        for i, binary in enumerate(bset.binaries, 1):
            out = staging / "bin" / binary.name
            step = f"[{i}/{len(bset.binaries)}] {binary.name}"
            if out.exists() and version_of(out, binary):
                say(f"{step}: already built, skipping")
                continue
            say(f"{step}: go build {binary.package} (in hack/go/{binary.module})")
            started = time.monotonic()
            _go_build(binary, out, say)
            timings[binary.name] = round(time.monotonic() - started, 1)
            version = version_of(out, binary)
            if version is None:
                raise SystemExit(f"{out} does not report {binary.expect!r}")
            say(f"{step}: done in {format_seconds(timings[binary.name])} -> {version.splitlines()[0]}")

        manifest: dict[str, object] = {"kubernetes": K8S_VERSION}
        if bset is CONTROL_PLANE:
            _write_kwok_stages(staging / KWOK_STAGES)
            manifest.update(etcd=ETCD_VERSION, kwok=KWOK_VERSION, helm=HELM_VERSION)
        if bset is MONITORING:
            _write_monitoring_crds(staging / MONITORING_CRDS_DIR)
            manifest.update(prometheus=PROMETHEUS_VERSION, prometheus_operator=PROMETHEUS_OPERATOR_VERSION)
        if bset is AUTOSCALING:
            _write_keda_config(staging / KEDA_CONFIG_DIR)
            manifest.update(keda=KEDA_VERSION, prometheus=PROMETHEUS_VERSION)
        manifest.update(
            {
                "key": key,
                "build_seconds": timings,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)  # atomic: the cache entry appears complete or not at all
        say(f"done in {format_seconds(time.monotonic() - total)}; binaries in {final / 'bin'}")
        return final / "bin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_dev.localcluster.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--real-nodes",
        type=int,
        choices=(0, 1),
        default=1,
        help="1 (default): also what the real node runs (its kubelet, kube-proxy, kube-router and CoreDNS)",
    )
    parser.add_argument(
        "--print-bin-dir",
        action="store_true",
        help="print the control plane's bin folder (kubectl, helm) and exit (builds nothing)",
    )
    parser.add_argument(
        "--promtool", action="store_true", help="also promtool, with which the tests check the chart's alerting rules"
    )
    parser.add_argument(
        "--autoscaling",
        action="store_true",
        help="also the autoscaling stack: KEDA's operator, metrics API server and webhooks, and Prometheus",
    )
    args = parser.parse_args(argv)
    if args.print_bin_dir:
        print(bin_dir(CONTROL_PLANE))
        return 0
    extra = (*((MONITORING,) if args.promtool else ()), *((AUTOSCALING,) if args.autoscaling else ()))
    for bset in (*cluster_sets(args.real_nodes), *extra):
        build(force=args.force, bset=bset)
    return 0
