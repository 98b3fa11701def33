"""The control plane binaries: versions, cache location, and the one-time build.

    python -m epd_dev.localcluster.build [--force] [--print-bin-dir]   (see build.py)

Every binary is compiled from published Go modules pinned by the go.mod/go.sum
files under hack/go (no Docker, no release downloads). The result
lands in ``<cache root>/controlplane/<key>/bin`` (``epd_dev.paths.cache_root``);
the key names every version plus a hash of the Go module files, so changing a
pin builds a fresh cache entry and never mixes versions.

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
from dataclasses import dataclass
from pathlib import Path

from .. import paths
from ..locking import file_lock

K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.22.0"

# Bump when the build recipe changes in a way the Go files do not show.
RECIPE = "1"

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

# (wrapper module, required module, version): the cache key trusts these.
_PINS = (
    ("kubernetes", "k8s.io/kubernetes", K8S_VERSION),
    ("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION),
    ("kwok", "sigs.k8s.io/kwok", KWOK_VERSION),
    ("helm", "helm.sh/helm/v3", HELM_VERSION),
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


def log(msg: str) -> None:
    print(f"[controlplane] {msg}", flush=True)


def _go_dir() -> Path:
    return paths.GO_MODULES


def _check_pins() -> None:
    """Refuse to build if a go.mod disagrees with the versions named in the key."""
    for module, path, version in _PINS:
        gomod = (_go_dir() / module / "go.mod").read_text()
        if not re.search(rf"^\s*(require\s+)?{re.escape(path)} {re.escape(version)}\b", gomod, re.MULTILINE):
            raise SystemExit(
                f"{_go_dir() / module / 'go.mod'} does not require {path} {version}; "
                "update the version constants in hack/epd_dev/localcluster/binaries.py with it"
            )


def cache_key() -> str:
    digest = hashlib.sha256(RECIPE.encode())
    for path in sorted(_go_dir().glob("*/*")):
        if path.suffix in (".go", ".mod", ".sum"):
            digest.update(str(path.relative_to(_go_dir())).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return f"k8s-{K8S_VERSION}_etcd-{ETCD_VERSION}_kwok-{KWOK_VERSION}_helm-{HELM_VERSION}_{digest.hexdigest()[:12]}"


def cache_root() -> Path:
    return paths.cache_root() / "controlplane"


def cache_dir() -> Path:
    return cache_root() / cache_key()


def bin_dir() -> Path:
    """Where the binaries are once built (they may not exist yet)."""
    return cache_dir() / "bin"


def missing_binaries() -> list[str]:
    """Names not yet built into the cache (empty when the cache is complete)."""
    if not (cache_dir() / MANIFEST).is_file():
        return list(NAMES)
    return [n for n in NAMES if not os.access(bin_dir() / n, os.X_OK)]


def version_of(path: Path, binary: Binary) -> str | None:
    """The binary's version output if it contains the expected version."""
    try:
        out = subprocess.run([str(path), *binary.version_args], check=False, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (out.stdout + out.stderr).strip()
    return text if out.returncode == 0 and binary.expect in text else None


def _go(module: str, *args: str) -> str:
    return subprocess.run(
        ["go", *args], cwd=_go_dir() / module, check=True, capture_output=True, text=True
    ).stdout.strip()


def _ldflags(binary: Binary) -> str:
    if binary.module == "kubernetes":
        return K8S_LDFLAGS
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
    return "-s -w"  # etcd and kwok carry their versions as constants


def _fmt(seconds: float) -> str:
    return f"{int(seconds // 60)}m{seconds % 60:04.1f}s" if seconds >= 60 else f"{seconds:.1f}s"


def _go_build(binary: Binary, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    cmd = [
        "go",
        "build",
        "-buildvcs=false",
        "-trimpath",
        "-ldflags",
        _ldflags(binary),
        "-o",
        str(tmp),
        binary.package,
    ]
    # Static binaries like upstream's releases; same env as the warm-up build.
    env = {**os.environ, "CGO_ENABLED": "0"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=_go_dir() / binary.module, env=env)
    while True:
        try:
            rc = proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            log(f"  ... still building {binary.name} ({_fmt(time.monotonic() - started)})")
        except BaseException:
            proc.terminate()
            proc.wait()
            tmp.unlink(missing_ok=True)
            raise
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"go build of {binary.name} failed (exit {rc}): {' '.join(cmd)}")
    os.replace(tmp, out)


def _write_kwok_stages(dest: Path) -> None:
    kwok_src = Path(_go("kwok", "list", "-m", "-f", "{{.Dir}}", "sigs.k8s.io/kwok"))
    docs = [
        f"# From sigs.k8s.io/kwok@{KWOK_VERSION} {name} (Apache-2.0)\n" + (kwok_src / name).read_text().strip()
        for name in KWOK_STAGE_FILES
    ]
    dest.write_text("\n---\n".join(docs) + "\n")


def _verify_all(bindir: Path) -> list[str]:
    return [b.name for b in BINARIES if version_of(bindir / b.name, b) is None]


def build(force: bool = False) -> Path:
    """Build whatever is missing and return the bin folder of the complete cache."""
    if shutil.which("go") is None:
        raise SystemExit("the Go toolchain is required (go 1.26+ on PATH)")
    _check_pins()
    key = cache_key()
    final = cache_root() / key
    with file_lock(cache_root() / ".build.lock", log):
        if final.exists() and not force:
            bad = _verify_all(final / "bin") if not missing_binaries() else list(NAMES)
            if not bad:
                log(f"all binaries cached in {final / 'bin'}")
                return final / "bin"
            log(f"cache {final} is broken ({', '.join(bad)}); rebuilding")
            force = True
        staging = cache_root() / f"{key}.partial"
        if force:
            shutil.rmtree(staging, ignore_errors=True)
        (staging / "bin").mkdir(parents=True, exist_ok=True)

        go_version = subprocess.run(["go", "version"], check=True, capture_output=True, text=True).stdout.strip()
        log(f"building into {final} ({go_version})")
        timings: dict[str, float] = {}
        total = time.monotonic()
        for i, binary in enumerate(BINARIES, 1):
            out = staging / "bin" / binary.name
            step = f"[{i}/{len(BINARIES)}] {binary.name}"
            if out.exists() and version_of(out, binary):
                log(f"{step}: already built, skipping")
                continue
            log(f"{step}: go build {binary.package} (in hack/go/{binary.module})")
            started = time.monotonic()
            _go_build(binary, out)
            timings[binary.name] = round(time.monotonic() - started, 1)
            version = version_of(out, binary)
            if version is None:
                raise SystemExit(f"{out} does not report {binary.expect!r}")
            log(f"{step}: done in {_fmt(timings[binary.name])} -> {version.splitlines()[0]}")

        _write_kwok_stages(staging / KWOK_STAGES)
        manifest = {
            "kubernetes": K8S_VERSION,
            "etcd": ETCD_VERSION,
            "kwok": KWOK_VERSION,
            "helm": HELM_VERSION,
            "key": key,
            "build_seconds": timings,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)  # atomic: the cache entry appears complete or not at all
        log(f"done in {_fmt(time.monotonic() - total)}; binaries in {final / 'bin'}")
        return final / "bin"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_dev.localcluster.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument(
        "--print-bin-dir", action="store_true", help="print the cache's bin folder and exit (builds nothing)"
    )
    args = parser.parse_args(argv)
    if args.print_bin_dir:
        print(bin_dir())
        return 0
    build(force=args.force)
    return 0
