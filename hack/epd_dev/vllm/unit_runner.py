"""Run one EPD unit's engines as local processes, the way the kubelet runs the unit's pod.

The input is the pod the operator made: read from the control plane (`UnitRunner(pod, log_dir)`),
or built without a cluster from `render` output by `resources.pod_template`, the function the
operator itself uses (`UnitRunner.from_manifest`; an encoder pool's pod, placement Pools, by
`resources.pool_pod_template`: `UnitRunner.encoder_pool_from_manifest`). Each container's command, args and env are
run as they are, except for what only a container runtime provides:

- the image: `vllm serve <model> ...` becomes `<serving python> -m
  vllm.entrypoints.openai.api_server --model <model> ...` (the `vllm` console script of the
  CPU build cannot start: docs/testing.md), and `vllm-router ...` becomes the venv's real binary;
- the env gets CPU_ENV (VLLM_TARGET_DEVICE=cpu, a 1 GiB KV cache, offline hub);
- /dev/shm is the host's, not a per-pod emptyDir: the unit's EC store
  (`/dev/shm/vime-ec-<name>-<model>-<hash of the object's uid>`) must not exist before the
  start, and is removed on stop;
- the pod IP (status URLs, the downward API's `status.podIP`) is 127.0.0.1.

Given a `Node` (nodes.py), the pod runs on it instead, as on a node of its own: the pod IP is
the node's loopback alias, where its engines listen (`--host 0.0.0.0`, the pod's every
address, and the pod-local `http://127.0.0.1:` of the router's worker URLs become that
address), and every container runs in the node's namespaces with the pod's own /dev/shm
folder, made on start and removed on stop like an emptyDir.

Only the EC-store janitor container is not run (see JANITOR).

Ports are the pod's: a test picks free ones through the manifest's `spec.ports` (see
`free_port_range`), never by rewriting args.

Order, as the kubelet: the sidecars (encoders) one by one, each waited for on its
startupProbe; then the consumers, waited for on theirs; then the router, waited for on its
readinessProbe. Stop is the reverse order (the kubelet stops sidecars after the main
containers).
"""

from __future__ import annotations

import copy
import random
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit, urlunsplit

from epd_operator.render import render
from epd_operator.resources import pod_template, pool_name, pool_pod_template
from epd_operator.validation import validate

from . import engines, envs
from .engines import Engine
from .nodes import Node

EC_STORAGE_ANNOTATION = "epd.vime.dev/ec-storage-path"
LOCALHOST = "127.0.0.1"
# Not run: it only trims the EC store to a budget (16 GiB by default, far above what a test
# writes), tests/janitor tests it, and its fixed metrics port would collide between runs.
JANITOR = ["epd-operator", "janitor"]


class UnitRunner:
    """One EPD unit as local processes: `pod` as read from the control plane
    (`kubectl get pod -o json`), or from `from_manifest`. Use as a context manager.

    `ready_timeout` bounds each engine's start: ~40 s on an idle 2-core machine, ~150 s on a
    busy one. `node`: the pod's node (module docstring); none runs it on this host as is.
    `on_start` is called with each engine right after its process started (`make demo` records
    the pids); `die_with_parent=False` lets the engines outlive this process.
    """

    def __init__(
        self,
        pod: dict[str, Any],
        log_dir: Path,
        *,
        ready_timeout: float = 600.0,
        node: Node | None = None,
        die_with_parent: bool = True,
        on_start: Callable[[engines.Engine], None] | None = None,
    ) -> None:
        self.pod = pod
        self.die_with_parent = die_with_parent
        self.on_start = on_start
        self.name = pod["metadata"].get("name", "unit")
        self.pod_ip = pod.get("status", {}).get("podIP")
        self.node = node
        # The pod IP as reachable here.
        self.address = node.address if node else LOCALHOST
        self.ec_storage_path = pod["metadata"].get("annotations", {}).get(EC_STORAGE_ANNOTATION)
        self.log_dir = Path(log_dir)
        self.ready_timeout = ready_timeout
        spec = pod["spec"]
        init = spec.get("initContainers", [])
        if any(c.get("restartPolicy") != "Always" for c in init):
            raise ValueError(f"{self.name}: only native sidecars are expected among initContainers")
        self.sidecars = [self._engine(c) for c in init]
        main = [self._engine(c) for c in spec["containers"] if c.get("command") != JANITOR]
        self.router = next((e for e in main if e.name == "router"), None)
        # An encoder pool's pod (placement Pools) runs its encoders as plain containers.
        self.pool_encoders = [e for e in main if e.name.startswith("encoder-")]
        self.consumers = [e for e in main if e is not self.router and e not in self.pool_encoders]
        self.ready_after_s: dict[str, float] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_manifest(
        cls, manifest: dict[str, Any], log_dir: Path, *, uid: str, model: str = "default", **options: Any
    ) -> UnitRunner:
        """The unit pod the operator would create for `model` of an EPDDeployment manifest,
        without a cluster: `uid` stands for the object's uid (it names the EC store). `options`
        are the constructor's."""
        name, spec, plan = _plan(manifest, uid, model)
        # The janitor container is not run here (see JANITOR), so its image does not matter.
        template = pod_template(spec, name, plan, operator_image="epd-operator:local")
        return cls(_pod(template, f"{name}-{model}-0"), log_dir, **options)

    @classmethod
    def encoder_pool_from_manifest(
        cls, manifest: dict[str, Any], log_dir: Path, *, uid: str, model: str = "default", **options: Any
    ) -> UnitRunner:
        """The first pod of the encoder pool the operator would create for `model` (placement
        Pools), without a cluster."""
        name, spec, plan = _plan(manifest, uid, model)
        template = pool_pod_template(spec, name, plan)
        return cls(_pod(template, f"{pool_name(name, model)}-0"), log_dir, **options)

    def _engine(self, container: dict[str, Any]) -> engines.Engine:
        command = [*container.get("command", []), *container.get("args", [])]
        if self.node:
            command = self._on_node(command)
        env = {}
        for var in container.get("env", []):
            env[var["name"]] = self._env_value(container["name"], var)
        if command[:2] == ["vllm", "serve"]:
            argv = [str(envs.serving_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", *command[2:]]
            env = {**env, **engines.CPU_ENV}
        elif command[:1] == ["vllm-router"]:
            argv = [str(envs.router_binary()), *command[1:]]
        else:
            raise ValueError(f"{container['name']}: no local stand-in for the image of {command[:2]}")
        # What the kubelet waits for: the startupProbe, else (the router) the readinessProbe.
        probe = (container.get("startupProbe") or container["readinessProbe"])["httpGet"]
        if self.node:
            argv = self.node.wrap(argv)
        return engines.Engine(
            container["name"],
            argv,
            port=probe["port"],
            log_dir=self.log_dir,
            env=env,
            health_path=probe["path"],
            host=self.address,
            die_with_parent=self.die_with_parent,
        )

    def _env_value(self, container: str, var: dict[str, Any]) -> str:
        if "value" in var:
            return var["value"]
        # The downward API: of the pod's fields only its IP is needed (ECCPUConnector's side
        # channel host), and only it has a meaning here.
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "status.podIP":
            return self.address
        raise ValueError(f"{container}: env {var['name']} has no value this runner can give")

    def _on_node(self, command: list[str]) -> list[str]:
        """The pod's addresses (all of them, and its own localhost) as its node's address."""
        assert self.node is not None, "only a unit run on a node has the node's address"
        address, out = self.node.address, []
        for i, arg in enumerate(command):
            if i and command[i - 1] == "--host" and arg == "0.0.0.0":
                arg = address
            elif arg.startswith(f"http://{LOCALHOST}:"):
                arg = arg.replace(LOCALHOST, address, 1)
            out.append(arg)
        return out

    # ------------------------------------------------------------------ lifecycle

    @property
    def engines(self) -> list[Engine]:
        """In start order: sidecars, the main containers (a pool's encoders, consumers), router."""
        return [*self.sidecars, *self.pool_encoders, *self.consumers, *([self.router] if self.router else [])]

    def start(self) -> Self:
        if self.node:
            self.node.prepare()  # an EC store is inside the node's fresh /dev/shm
        elif self.ec_storage_path and Path(self.ec_storage_path).exists():
            raise RuntimeError(f"EC store {self.ec_storage_path} exists already: not this unit's")
        try:
            for sidecar in self.sidecars:  # one at a time, as the kubelet starts init containers
                self._start_and_wait([sidecar])
            self._start_and_wait([*self.pool_encoders, *self.consumers])
            if self.router:
                # The kubelet starts it with the consumers; vllm-router would then wait for them
                # itself. After them, its start-up is not raced against two loading engines.
                self._start_and_wait([self.router])
        except BaseException:
            self.stop()
            raise
        return self

    def _start_and_wait(self, group: list[Engine]) -> None:
        for engine in group:
            engine.start()
            if self.on_start:
                self.on_start(engine)
        for engine in group:
            self.ready_after_s[engine.name] = engine.wait_healthy(self.ready_timeout)

    def stop(self) -> None:
        for engine in reversed(self.engines):
            engine.stop()
        if self.node:
            self.node.clean()
        elif self.ec_storage_path:
            shutil.rmtree(self.ec_storage_path, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ addressing

    def local_url(self, url: str) -> str:
        """A URL of the operator's status (pod IP, container port) as reachable here."""
        parts = urlsplit(url)
        if parts.hostname != self.pod_ip:
            raise ValueError(f"{url} is not an address of pod {self.name} ({self.pod_ip})")
        return urlunsplit(parts._replace(netloc=f"{self.address}:{parts.port}"))


def _plan(manifest: dict[str, Any], uid: str, model: str):
    """The deployment's name, its checked spec and `model`'s plan, as the operator renders them."""
    meta = manifest["metadata"]
    checked = validate(manifest["spec"])
    plans = render(checked, namespace=meta.get("namespace", "default"), name=meta["name"], uid=uid)
    return meta["name"], checked.spec, next(p for p in plans if p.name == model)


def _pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    return {"metadata": {**copy.deepcopy(template["metadata"]), "name": name}, "spec": template["spec"]}


def free_port_range(count: int, start: int = 20000, stop: int = 32000) -> int:
    """The first of `count` consecutive ports nothing listens on, for a manifest's `spec.ports`.

    Below Linux's ephemeral range (32768+), so no outgoing connection takes one meanwhile; a
    random pick, so concurrent runs on one machine rarely race for the same range between this
    check and the engines' bind. Engines listen on 0.0.0.0 (the rendered `--host`), so that is
    what is checked.
    """
    for _ in range(200):
        base = random.randrange(start, stop - count)
        if all(_bindable(port) for port in range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} free consecutive ports in {start}-{stop}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True
