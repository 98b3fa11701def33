"""The REAL part of `make demo`: the operator's pod for the tiny model on the real node
epd-real-0 (the kubelet runs its containers in containerd), one request with two images through
epd_client, and what happened, printed as a person would want to read it.

`apply` and `serve` are also what tests/node/test_demo.py runs, headless, with the test
session's cluster, Helm-installed operator and model claim.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
import json
import math
import re
import shlex
import socket
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import openai
import yaml

from epd_client import Endpoints, EPDClient, media_items, media_key

from .envoy import config as envoy_config
from .images import recipes as image_recipes
from .localcluster import node
from .operator_process import get_json, wait_for
from .vllm import payloads, real_node, serving, tiny_model

NAME = "tiny-llava-pd"
REFERENCE = "tiny-aggregated"
# Prefill's KV cache for decode (ExampleConnector): a folder of the pod's own /dev/shm.
KV_STORE = "/dev/shm/epd-demo-kv"
# The Helm release's Deployment (release "epd" of the chart epd-operator).
OPERATOR_DEPLOYMENT = "epd-epd-operator"
MAX_TOKENS = 12
PRIME_TIMEOUT_SECONDS = 30
FAILURE_HEADING = "The same request with the encoder stopped"
# Long enough (with the two images' 32 placeholder tokens) for the prompt to fill two 32-token
# KV blocks, so the KV cache prefill hands to decode covers both images (serving.prefill_decode_groups).
QUESTION = (
    "Compare the two pictures: describe the colours, the shapes, and where they are, "
    "then say what is different between the first and the second one."
)
# What the rendered engines answer on; the rest are the stages the client drives.
STAGES = {
    "/v1/chat/completions": "prime",
    "/v1/chat/completions/render": "render",
    "/inference/v1/generate": "generate",
}


_BEGAN = time.monotonic()


def say(message: str) -> None:
    """One progress line, with the seconds since the demo started."""
    print(f"[demo {time.monotonic() - _BEGAN:4.0f}s] {message}", flush=True)


class Progress:
    """While the kubelet starts the pods' containers (a minute or two each): says when each one
    starts and becomes ready, as the kubelet reports it (containerStatuses), and every `every`
    seconds which ones are still loading."""

    def __init__(self, cluster: Any, namespace: str, deployments: tuple[str, ...], every: float = 20.0) -> None:
        self.cluster, self.namespace, self.every = cluster, namespace, every
        self.selector = f"epd.vime.dev/deployment in ({','.join(deployments)})"
        # pod/container -> running, passed its startup probe, ready, restarts
        self.seen: dict[str, tuple[bool, bool, bool, int]] = {}
        self.began = time.monotonic()
        self.last = self.began
        self.done = threading.Event()

    def check(self) -> None:
        out = self.cluster.kubectl("get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json", check=False)
        if out.returncode != 0:
            return
        loading = []
        for pod in json.loads(out.stdout)["items"]:
            spec = pod["spec"]
            probed = {
                c["name"] for c in [*spec.get("initContainers", []), *spec["containers"]] if c.get("startupProbe")
            }
            for status in containers(pod):
                key = f"{pod['metadata']['name']}/{status['name']}"
                now = (
                    "running" in status.get("state", {}),
                    bool(status.get("started")),
                    bool(status.get("ready")),
                    status.get("restartCount", 0),
                )
                before = self.seen.get(key, (False, False, False, 0))
                self.seen[key] = now
                since = f"{time.monotonic() - self.began:.0f}s after the apply"
                if now[0] and not before[0]:
                    say(f"REAL  kubelet: {key} running ({short_id(status.get('containerID', ''))})")
                if now[1] and not before[1] and status["name"] in probed:
                    say(f"REAL  kubelet: {key} passed its startup probe, {since}")
                if now[2] and not before[2]:
                    say(f"REAL  kubelet: {key} ready, {since}")
                if now[3] > before[3]:
                    say(f"REAL  kubelet: {key} restarted ({now[3]} restarts)")
                if now[0] and not now[2]:
                    loading.append(key)
        if loading and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            say(f"REAL  still loading: {', '.join(loading)}")

    def __enter__(self) -> Self:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done.wait(2.0):
            self.check()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        if exc_type is None:
            self.check()  # the last ones ready, before whatever the caller says next


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The kubelet's status of every container of `pod`, sidecars (init containers) first."""
    status = pod.get("status", {})
    return [*status.get("initContainerStatuses", []), *status.get("containerStatuses", [])]


def short_id(container_id: str) -> str:
    """containerd://<64 hex> as containerd://<first 12>."""
    runtime, _, digest = container_id.partition("://")
    return f"{runtime}://{digest[:12]}" if digest else container_id or "-"


@dataclasses.dataclass(frozen=True)
class Picture:
    title: str
    width: int
    height: int
    pixel: Callable[[int, int], tuple[int, int, int]]

    @property
    def png(self) -> bytes:
        return payloads.png(self.width, self.height, self.pixel)

    @property
    def part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": payloads.data_url(self.png)}}

    def describe(self) -> str:
        digest = hashlib.sha256(self.png).hexdigest()[:12]
        return f"PNG {self.width}x{self.height}, {len(self.png)} bytes, sha256 {digest}  ({self.title})"


RED, WHITE, BLUE, YELLOW, GREEN = (220, 30, 30), (250, 250, 250), (30, 60, 200), (240, 210, 40), (40, 170, 60)
PICTURES = (
    Picture("a red disc on white", 64, 48, lambda x, y: RED if (x - 32) ** 2 + (y - 24) ** 2 < 18**2 else WHITE),
    Picture("blue and yellow stripes", 56, 56, lambda x, y: BLUE if (x // 8) % 2 else YELLOW),
)
# The second request printed for the reader: small enough to paste.
SECOND = Picture("a green square", 56, 56, lambda x, y: GREEN)
# Sent REPEATS times through the front door, as a GRPO group sends one prompt, then once more
# under a new weights version.
REPEATED = Picture("a yellow triangle on white", 56, 56, lambda x, y: YELLOW if y > x else WHITE)
REPEATS = 8
NEW_VERSION = "step-2"
# Two different pictures sent through the front door under one uuid of the client's own (a
# reused or colliding id): vLLM names a part by its uuid alone, the front door by its content.
# Sent REPEATS times through a standalone Envoy asking the model's InferencePool's endpoint picker.
ENVOY_PICTURE = Picture("a red cross on white", 56, 56, lambda x, y: RED if 24 <= x < 32 or 24 <= y < 32 else WHITE)
ENVOY = "envoy"
ENVOY_PORT = 8081
SHARED_UUID = "my-picture"
SHARED_UUID_PICTURES = (
    REPEATED,
    Picture("a blue square on white", 56, 56, lambda x, y: BLUE if 14 <= x < 42 and 14 <= y < 42 else WHITE),
)


def demo_request() -> dict[str, Any]:
    """Greedy and of fixed length, so EPD and the aggregated engine can be compared token by
    token; limited to whole words so that the answer reads as words."""
    msgs = [{"role": "user", "content": [*(p.part for p in PICTURES), {"type": "text", "text": QUESTION}]}]
    return {**payloads.greedy(msgs, max_tokens=MAX_TOKENS), "allowed_token_ids": word_token_ids()}


def word_token_ids() -> list[int]:
    """The tiny model's tokens that are whole words of the text its tokenizer learnt (' red',
    ' encoder', ...). With random weights any other byte sequence is as likely, and most of them
    print as noise."""
    vocab = json.loads((tiny_model.tiny_model_path() / "tokenizer.json").read_text())["model"]["vocab"]
    words = {w for line in tiny_model.CORPUS for w in re.findall(r"[a-z]+", line.lower())}
    return sorted(vocab[f"\u0120{w}"] for w in words if f"\u0120{w}" in vocab)  # \u0120: byte-level BPE's space


@dataclasses.dataclass
class Answer:
    engine_urls: dict[str, str]  # container name -> URL at the pod IP (the EPD proxy, the unit's entry, included)
    front_url: str  # the unit's front Service (its ClusterIP): where any OpenAI client goes
    reference_url: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    reference_token_ids: list[int]
    reference_logprobs: list[float]
    seconds: float  # EPDClient.generate, end to end
    served: dict[str, dict[str, tuple[int, float]]]  # engine -> path -> (requests, seconds)
    image_hashes: list[str]  # each picture's key (content-only: no weights version), its folder in the EC store
    ec_store: str  # in the pod's /dev/shm
    ec_files: dict[str, list[tuple[str, int]]]  # folder (a picture's key) -> (file, bytes), written by the prime
    kv_files: list[tuple[str, int]]  # what prefill wrote for decode
    pod: dict[str, Any]  # the unit's pod, as the API server has it after the request
    repeats: Repeats | None = None  # the same picture through the front door, again and again
    shared_uuid: SharedUuid | None = None  # two pictures under one client uuid through the front door
    envoy: ThroughEnvoy | None = None  # ENVOY_PICTURE through Envoy and the model's InferencePool

    @property
    def max_logprob_difference(self) -> float:
        return max((abs(a - b) for a, b in zip(self.logprobs, self.reference_logprobs)), default=math.inf)

    @property
    def identical(self) -> bool:
        return self.token_ids == self.reference_token_ids and self.max_logprob_difference <= 1e-3


@dataclasses.dataclass(frozen=True)
class Repeats:
    """REPEATED sent REPEATS times through the front door with the openai SDK, then once with a
    new X-EPD-Weights-Version: the encoder's requests (vLLM's own /metrics) after each."""

    primes: int  # encoder requests for the REPEATS sends
    primes_new_version: int  # encoder requests for the one send under NEW_VERSION
    seconds: list[float]  # each send, end to end
    answers: list[list[int]]  # token ids of each send, the new version's last


@dataclasses.dataclass(frozen=True)
class SharedUuid:
    """SHARED_UUID_PICTURES sent one after the other through the front door, each part with the
    uuid SHARED_UUID, and each picture without a uuid on the aggregated engine."""

    answers: list[list[int]]  # token ids through the front door, per picture
    reference_answers: list[list[int]]  # the aggregated engine's, per picture

    @property
    def each_its_own(self) -> bool:
        return self.answers == self.reference_answers and len({tuple(a) for a in self.answers}) == len(self.answers)


@dataclasses.dataclass(frozen=True)
class ThroughEnvoy:
    """ENVOY_PICTURE sent REPEATS times through a standalone Envoy (GAIE's shape) whose ext_proc
    filter asks the model's InferencePool's endpoint picker (the EPD gateway), and once on the
    aggregated engine."""

    url: str  # Envoy's Service
    pool: dict[str, Any]  # the InferencePool the operator made
    primes: int  # encoder requests for the REPEATS sends
    answers: list[list[int]]
    reference: list[int]


def manifests(claim: str) -> list[dict[str, Any]]:
    """The tiny model's two EPDDeployments for the real node: the unit (encoder + prefill + decode
    behind vllm-router; prefill hands its KV cache to decode through KV_STORE, a folder of the
    pod's /dev/shm) and the aggregated reference (one engine, no EC config)."""
    # A picture its encoder cannot prime is refused within PRIME_TIMEOUT_SECONDS (the default,
    # 600 s, waits as long as epd_client's deadline): the demo's failure recipe shows it.
    # The EPD gateway is the front door: it sends each request to the unit that holds its media.
    unit = real_node.node_manifest(
        NAME,
        claim,
        serving.prefill_decode_groups(Path(KV_STORE)),
        proxy={"primeTimeoutSeconds": PRIME_TIMEOUT_SECONDS},
        # The gateway is also the endpoint picker of the model's InferencePool, for Gateway API gateways.
        gateway={"enabled": True, "inferencePool": {"enabled": True}},
    )
    reference = real_node.node_manifest(REFERENCE, claim, [{"workerType": "regular", "numGpus": 1}])
    return [unit, reference]


def apply(cluster: Any, root: Path, namespace: str, claim: str, names: tuple[str, ...] = (NAME, REFERENCE)) -> None:
    """Write and apply the EPDDeployments `names` (both by default); the kubelet starts loading
    them at once."""
    for manifest in manifests(claim):
        if manifest["metadata"]["name"] not in names:
            continue
        manifest["metadata"]["namespace"] = namespace
        path = root / f"{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest, sort_keys=False))
        say(f"REAL  kubectl apply -f {path}")
        cluster.kubectl("apply", "-f", str(path))


def serve(cluster: Any, namespace: str, *, timeout: float = 1500) -> Answer:
    """Wait (the kubelet's word, through the EPDDeployments' Ready condition) for what `apply`
    applied, send the request, print it all; the pods keep running."""
    print(cluster.kubectl("get", "epd", NAME, REFERENCE, "-n", namespace).stdout.rstrip())
    began = time.monotonic()
    with Progress(cluster, namespace, (NAME, REFERENCE)) as progress:
        pod = wait_for(lambda: _unit_pod(cluster, namespace), 180, f"the pod of epd/{NAME} on a node, with an IP")
        unit = pod["metadata"]["name"]
        say(
            f"REAL  the operator made pod {unit}; the scheduler bound it to {pod['spec']['nodeName']} "
            f"(pod IP {pod['status'].get('podIP')}). Its kubelet starts the containers in containerd: the encoder "
            "sidecar first, on its startup probe; then prefill and decode; then the router and the EPD proxy."
        )
        say(f"REAL  kubectl wait --for=condition=Ready epd/{NAME} epd/{REFERENCE} -n {namespace}")
        out = cluster.kubectl(
            "wait",
            "--for=condition=Ready",
            f"epd/{NAME}",
            f"epd/{REFERENCE}",
            "-n",
            namespace,
            f"--timeout={timeout:.0f}s",
            check=False,
            timeout=timeout + 30,
        )
        if out.returncode != 0:
            progress.check()
            raise AssertionError(f"not Ready within {timeout:.0f}s: {out.stderr.strip()}")
    say(f"REAL  both Ready, {time.monotonic() - began:.0f}s after the apply")
    print(cluster.kubectl("get", "epd", NAME, REFERENCE, "-n", namespace).stdout.rstrip())
    status = get_json(cluster, "epd", NAME, "-n", namespace)["status"]
    found = {name: serving.discover_ready(cluster.kubeconfig, name, namespace) for name in (NAME, REFERENCE)}
    answer = asyncio.run(_ask(cluster, namespace, status["models"][0]["ecStoragePath"], found[NAME], found[REFERENCE]))
    wait_for(lambda: _gateway_ready(cluster, namespace), 300, f"the gateway of epd/{NAME} Ready")
    wait_for(lambda: _accepts(answer.front_url), 60, "the front Service taking connections")
    answer.repeats = repeat(answer.front_url, answer.engine_urls["encoder-0"])
    answer.shared_uuid = shared_uuid(answer.front_url, answer.reference_url)
    answer.envoy = through_envoy(cluster, namespace, answer.engine_urls["encoder-0"], answer.reference_url)
    print_answer(answer)
    return answer


def _gateway_ready(cluster: Any, namespace: str) -> bool:
    deployment = get_json(cluster, "deployment", f"{NAME}-{serving.MODEL}-gateway", "-n", namespace) or {}
    return bool(deployment.get("status", {}).get("readyReplicas"))


def _accepts(url: str) -> bool:
    """A Service's ClusterIP takes connections once kube-proxy has its ready endpoints, a moment
    after the rollout: until then its rules refuse them."""
    address = urllib.parse.urlsplit(url)
    try:
        socket.create_connection((address.hostname, address.port), timeout=2).close()
    except OSError:
        return False
    return True


def _short_answer(base_url: str, part: dict[str, Any], headers: dict[str, str] | None = None) -> list[int]:
    """Eight greedy tokens about one picture, through the openai SDK."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=300)
    content: list[Any] = [part, {"type": "text", "text": "what is this?"}]
    answer = client.chat.completions.create(
        model=tiny_model.SERVED_NAME,
        messages=[{"role": "user", "content": content}],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        extra_headers=headers,
    )
    return list(getattr(answer.choices[0], "token_ids", None) or [])


def shared_uuid(front_url: str, reference_url: str) -> SharedUuid:
    """SHARED_UUID_PICTURES through the front door under one client uuid, and on the aggregated
    engine without one."""
    return SharedUuid(
        [_short_answer(front_url, {**p.part, "uuid": SHARED_UUID}) for p in SHARED_UUID_PICTURES],
        [_short_answer(reference_url, p.part) for p in SHARED_UUID_PICTURES],
    )


def envoy_objects(namespace: str) -> list[dict[str, Any]]:
    """A standalone Envoy as GAIE's charts run one (epd_dev.envoy: ext_proc to the picker over TLS,
    an ORIGINAL_DST cluster on the picker's header), its picker the model's InferencePool's: the
    Service `endpointPickerRef` names, found through the cluster's DNS. Restricted like the units."""
    picker = f"{NAME}-{serving.MODEL}-epp.{namespace}.svc.cluster.local"
    bootstrap = envoy_config(
        listen=("0.0.0.0", ENVOY_PORT), picker=(picker, 9002), picker_dns=True, admin=("127.0.0.1", 19000)
    )
    labels = {"app.kubernetes.io/name": ENVOY}
    container = {
        "name": ENVOY,
        "image": image_recipes.ENVOY_REF,
        "imagePullPolicy": "IfNotPresent",
        "args": ["-c", "/etc/envoy/envoy.yaml", "--disable-hot-restart", "--log-level", "warn"],
        "ports": [{"name": "http", "containerPort": ENVOY_PORT}],
        "readinessProbe": {"tcpSocket": {"port": ENVOY_PORT}, "periodSeconds": 2},
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "volumeMounts": [{"name": "config", "mountPath": "/etc/envoy"}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": ENVOY, "labels": labels},
            "data": {"envoy.yaml": yaml.safe_dump(bootstrap, sort_keys=False)},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": ENVOY, "labels": labels},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [container],
                        "volumes": [
                            {"name": "config", "configMap": {"name": ENVOY}},
                            {"name": "tmp", "emptyDir": {}},
                        ],
                        "nodeSelector": dict(node.NODE_SELECTOR),
                        "tolerations": copy.deepcopy(node.TOLERATIONS),
                        "automountServiceAccountToken": False,
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": ENVOY, "labels": labels},
            "spec": {"selector": labels, "ports": [{"name": "http", "port": ENVOY_PORT, "targetPort": "http"}]},
        },
    ]


def through_envoy(cluster: Any, namespace: str, encoder_url: str, reference_url: str) -> ThroughEnvoy:
    """Envoy in front of the InferencePool's picker, then ENVOY_PICTURE REPEATS times through it."""
    pool = wait_for(
        lambda: get_json(
            cluster, "inferencepools.inference.networking.k8s.io", f"{NAME}-{serving.MODEL}", "-n", namespace
        ),
        120,
        "the model's InferencePool",
    )
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(envoy_objects(namespace)))
    cluster.kubectl("rollout", "status", f"deployment/{ENVOY}", "-n", namespace, "--timeout=180s", timeout=200)
    spec = get_json(cluster, "service", ENVOY, "-n", namespace)["spec"]
    url = f"http://{spec['clusterIP']}:{ENVOY_PORT}"
    wait_for(lambda: _accepts(url), 60, f"service/{ENVOY} taking connections")
    before = payloads.served_requests(encoder_url).get("/v1/chat/completions", 0)
    answers = [_short_answer(url, ENVOY_PICTURE.part) for _ in range(REPEATS)]
    primes = payloads.served_requests(encoder_url).get("/v1/chat/completions", 0) - before
    return ThroughEnvoy(url, pool, primes, answers, _short_answer(reference_url, ENVOY_PICTURE.part))


def repeat(front_url: str, encoder_url: str) -> Repeats:
    """REPEATED through the front door REPEATS times, as any OpenAI client sends it, then once
    under NEW_VERSION; the encoder's requests counted by its own /metrics."""

    def primes() -> int:
        return payloads.served_requests(encoder_url).get("/v1/chat/completions", 0)

    def send(headers: dict[str, str] | None = None) -> list[int]:
        started = time.monotonic()
        answer = _short_answer(front_url, REPEATED.part, headers)
        seconds.append(time.monotonic() - started)
        return answer

    seconds: list[float] = []
    before = primes()
    answers = [send() for _ in range(REPEATS)]
    after = primes()
    answers.append(send({"X-EPD-Weights-Version": NEW_VERSION}))
    return Repeats(after - before, primes() - after, seconds, answers)


def _unit_pod(cluster: Any, namespace: str) -> dict[str, Any] | None:
    """The unit's pod (its StatefulSet's first) once it is bound to a node and has an IP."""
    status = (get_json(cluster, "epd", NAME, "-n", namespace) or {}).get("status", {})
    models = status.get("models") or []
    if not models or not models[0].get("statefulSet"):
        return None
    pod = get_json(cluster, "pod", f"{models[0]['statefulSet']}-0", "-n", namespace)
    return pod if pod and pod["spec"].get("nodeName") and pod["status"].get("podIP") else None


async def _ask(
    cluster: Any, namespace: str, ec_store: str, endpoints: Endpoints, reference_endpoints: Endpoints
) -> Answer:
    (unit,) = endpoints.model(serving.MODEL).units
    engine_urls = {e.name: e.url for e in unit.engines if e.url}
    if unit.router_url:
        engine_urls["router"] = unit.router_url
    if unit.front_url and unit.front_url != unit.router_url:
        engine_urls["proxy"] = unit.front_url
    scraped = {n: url for n, url in engine_urls.items() if n not in ("router", "proxy")}  # vLLM's /metrics
    pod_files = PodFiles(cluster, namespace, unit.name, "encoder-0")
    before = {name: payloads.served_seconds(url) for name, url in scraped.items()}
    ec_before, kv_before = pod_files.list(ec_store), pod_files.list(KV_STORE)
    request = demo_request()

    start = time.monotonic()
    async with EPDClient(endpoints) as client:
        result = await client.generate(request)
    seconds = time.monotonic() - start

    served = {}
    for name, url in scraped.items():
        now, then = payloads.served_seconds(url), before[name]
        delta = {
            path: (n - then.get(path, (0, 0.0))[0], s - then.get(path, (0, 0.0))[1]) for path, (n, s) in now.items()
        }
        served[name] = {path: d for path, d in delta.items() if d[0]}
    token_ids, logprobs = payloads.output(result)
    (reference,) = reference_endpoints.model(serving.MODEL).units
    reference_url = reference.entry_url
    assert reference_url is not None, "the reference's status names no entry"
    # The reference renders the same request (unkeyed there: its engine names items by content).
    rendered = post(reference_url, "/v1/chat/completions/render", request)
    ref_ids, ref_logprobs = payloads.output(post(reference_url, "/inference/v1/generate", rendered))
    decode = next(url for name, url in engine_urls.items() if name.startswith("decode"))
    text = post(decode, "/detokenize", {"model": tiny_model.SERVED_NAME, "tokens": token_ids})["prompt"]
    ec_after = pod_files.list(ec_store)
    ec_files: dict[str, list[tuple[str, int]]] = {}
    for name, size in ec_after.items():
        if name not in ec_before and "/" in name:
            mm_hash, file = name.split("/", 1)
            ec_files.setdefault(mm_hash, []).append((file, size))
    kv_files = [(name, size) for name, size in pod_files.list(KV_STORE).items() if name not in kv_before]
    return Answer(
        engine_urls,
        front_service_url(cluster, namespace),
        reference_url,
        token_ids,
        logprobs,
        text,
        ref_ids,
        ref_logprobs,
        seconds,
        served,
        [media_key(item, "") for item in media_items(request["messages"])],
        ec_store,
        ec_files,
        kv_files,
        get_json(cluster, "pod", unit.name, "-n", namespace),
    )


def front_service(cluster: Any, namespace: str, deployment: str = NAME) -> dict[str, Any]:
    """The deployment's front Service (role router or consumer: not its units' headless governing
    Service, nor its endpoint picker's)."""
    selector = f"epd.vime.dev/deployment={deployment},epd.vime.dev/role in (router,consumer)"
    (front,) = get_json(cluster, "services", "-n", namespace, "-l", selector)["items"]
    return dict(front)


def front_service_url(cluster: Any, namespace: str, deployment: str = NAME) -> str:
    """The deployment's front Service at its ClusterIP, as any client in the cluster reaches it."""
    spec = front_service(cluster, namespace, deployment)["spec"]
    return f"http://{spec['clusterIP']}:{spec['ports'][0]['port']}"


def post(base: str, path: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        found: dict[str, Any] = json.loads(resp.read())
    return found


@dataclasses.dataclass(frozen=True)
class PodFiles:
    """The files of a folder in a container, through `kubectl exec` (the pod's /dev/shm is its
    own memory emptyDir: the host does not see it as /dev/shm)."""

    cluster: Any
    namespace: str
    pod: str
    container: str

    LIST = (
        "import os, json, sys; root = sys.argv[1]; "
        "print(json.dumps({os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f)) "
        "for d, _, fs in os.walk(root) for f in fs}))"
    )

    def list(self, folder: str) -> dict[str, int]:
        """Every file under `folder` (relative name -> bytes); {} when there is no such folder."""
        out = self.cluster.kubectl(
            "exec", "-n", self.namespace, self.pod, "-c", self.container, "--", "python3", "-c", self.LIST, folder
        )
        found: dict[str, int] = json.loads(out.stdout)
        return found


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _section(title: str) -> None:
    print(f"\n----- {title} -----", flush=True)


def print_answer(answer: Answer) -> None:
    _section("the request")
    print(
        f"  model     {tiny_model.SERVED_NAME}: random weights, so the words are noise; what counts is that "
        "EPD answers exactly as one aggregated engine"
    )
    for i, picture in enumerate(PICTURES, 1):
        print(f"  image {i}   {picture.describe()}")
    print(f"  text      {QUESTION!r}")
    print(
        f"  sampling  greedy, {MAX_TOKENS} tokens, among the {len(word_token_ids())} whole words of its "
        "vocabulary (allowed_token_ids)"
    )

    _section(f"through epd_client: EPDClient.generate (prime -> render -> generate), {answer.seconds:.2f}s end to end")
    order = list(STAGES.values())
    rows = sorted(
        (
            (STAGES.get(path, "other"), engine, path, str(count), f"{seconds:.2f}s")
            for engine, paths in answer.served.items()
            for path, (count, seconds) in paths.items()
        ),
        key=lambda row: order.index(row[0]) if row[0] in order else len(order),
    )
    _table([("stage", "engine", "path", "requests", "server time"), *rows])
    print(
        "  (requests and their time from each engine's /metrics: http_requests_total, "
        "http_request_duration_seconds; the encoder never renders or generates)"
    )

    _section(f"what the prime wrote: the EC store {answer.ec_store}, a folder per picture named by its key")
    for i, mm_hash in enumerate(answer.image_hashes, 1):
        files = answer.ec_files.get(mm_hash, [])
        listing = ", ".join(f"{mm_hash}/{name} ({_size(size)})" for name, size in files) or "(nothing new)"
        print(f"  image {i} -> {listing}")
    if answer.kv_files:
        total = sum(size for _, size in answer.kv_files)
        folders = sorted({name.split("/", 1)[0] for name, _ in answer.kv_files})
        print(
            f"  and prefill's KV cache for decode: {len(answer.kv_files)} files, {_size(total)} "
            f"(ExampleConnector, {', '.join(folders)})"
        )

    _section("the answer")
    print(f"  text       {answer.text!r}")
    print(f"  token ids  {answer.token_ids}")

    if answer.repeats is not None:
        _print_repeats(answer.repeats, answer.front_url)
    if answer.shared_uuid is not None:
        _print_shared_uuid(answer.shared_uuid)
    if answer.envoy is not None:
        _print_envoy(answer.envoy)

    _section("the same request on an aggregated engine (one vLLM engine, no disaggregation)")
    print(f"  token ids  {answer.reference_token_ids}")
    same = sum(a == b for a, b in zip(answer.token_ids, answer.reference_token_ids))
    print(
        f"  identical: {'yes' if answer.identical else 'NO'} ({same} of {len(answer.token_ids)} token ids equal; "
        f"logprobs differ by at most {answer.max_logprob_difference:.1e})"
    )

    pod = answer.pod
    _section(f"the unit's pod as its kubelet reports it: {pod['metadata']['name']} on {pod['spec']['nodeName']}")
    sidecars = {c["name"] for c in pod["spec"].get("initContainers", [])}
    kubelet: list[tuple[str, ...]] = [("container", "kind", "container ID", "started at", "ready", "restarts")]
    for status in containers(pod):
        running = status.get("state", {}).get("running", {})
        kubelet.append(
            (
                status["name"],
                "sidecar" if status["name"] in sidecars else "main",
                short_id(status.get("containerID", "")),
                running.get("startedAt", "-"),
                "yes" if status.get("ready") else "no",
                str(status.get("restartCount", 0)),
            )
        )
    _table(kubelet)


def _print_repeats(repeats: Repeats, front_url: str) -> None:
    _section(f"the same picture {REPEATS} times through the front door, as a GRPO group sends one prompt")
    print(f"  picture   {REPEATED.describe()}")
    print(f"  client    the official openai SDK, base URL {front_url}/v1 (the model's EPD gateway)")
    times = ", ".join(f"{s:.2f}s" for s in repeats.seconds[:REPEATS])
    print(
        f"  sends 1-{REPEATS}  encoder requests: {repeats.primes} (the first send primed it; the others found its "
        "embedding in the unit's EC store and were not primed)"
    )
    print(f"            each send end to end: {times}")
    print(
        f"  send {REPEATS + 1}    with X-EPD-Weights-Version: {NEW_VERSION}: encoder requests: "
        f"{repeats.primes_new_version} (a new weights version names the picture anew: never the old embedding)"
    )
    same = all(a == repeats.answers[0] for a in repeats.answers)
    print(f"  answers   identical token ids across the {REPEATS + 1} sends: {'yes' if same else 'NO'}")


def _print_envoy(envoy: ThroughEnvoy) -> None:
    _section(f"the same picture {REPEATS} times through a Gateway API gateway: Envoy and the model's InferencePool")
    pool = envoy.pool["spec"]
    picker = pool["endpointPickerRef"]
    print(
        f"  pool      InferencePool {envoy.pool['metadata']['name']}: pods {pool['selector']['matchLabels']}, port "
        f"{pool['targetPorts'][0]['number']}; endpoint picker {picker['name']}:{picker['port']['number']} "
        f"({picker['failureMode']})"
    )
    print(f"  picture   {ENVOY_PICTURE.describe()}")
    print(f"  client    the official openai SDK, base URL {envoy.url}/v1 (Envoy 1.40, GAIE's standalone configuration)")
    print(
        f"  sends 1-{REPEATS}  encoder requests: {envoy.primes} (the picker sent every send to the unit that holds it)"
    )
    same = all(a == envoy.reference for a in envoy.answers)
    print(f"  answers   the aggregated engine's for this picture, all {REPEATS}: {'yes' if same else 'NO'}")


def _print_shared_uuid(shared: SharedUuid) -> None:
    _section(f"two different pictures under one client uuid ({SHARED_UUID!r}), through the front door")
    for i, (picture, got, expected) in enumerate(
        zip(SHARED_UUID_PICTURES, shared.answers, shared.reference_answers, strict=True), 1
    ):
        same = "yes" if got == expected else "NO"
        print(f"  send {i}    {picture.title}: {got}  the aggregated engine's for this picture: {same}")
    print(
        f"  each its own: {'yes' if shared.each_its_own else 'NO'} (vLLM names a part by its uuid alone; the front "
        "door replaces a client's uuid by the picture's key, so no picture is answered from another's embedding)"
    )


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def print_explore(answer: Answer, cluster: Any, namespace: str) -> None:
    _section("keep exploring: everything keeps running")
    roles = {
        "encoder": "the EC producer (a sidecar): primes images into the EC store",
        "prefill": "EC consumer and KV producer",
        "decode": "KV consumer",
        "router": "vllm-router --vllm-pd-disaggregation: the unit's entry",
        "proxy": "the EPD proxy, the unit's entry: primes every picture, then vllm-router (PD, on the loopback)",
    }
    for name, url in answer.engine_urls.items():
        print(f"  {name:<11}{url:<25}{roles.get(name.split('-')[0], '')}")
    print(f"  {'aggregated':<11}{answer.reference_url:<25}the reference engine (pod of epd/{REFERENCE})")
    pod = answer.pod["metadata"]["name"]
    print(
        f"  kubectl    export KUBECONFIG={cluster.kubeconfig} PATH={cluster.dir / 'bin'}:$PATH; "
        f"kubectl -n {namespace} get epd,pods -o wide"
    )
    print(f"  logs       kubectl -n {namespace} logs {pod} -c prefill-0")
    print(f"  exec       kubectl -n {namespace} exec {pod} -c encoder-0 -- ls -R {answer.ec_store}")
    print(f"  operator   kubectl -n {namespace} logs deploy/{OPERATOR_DEPLOYMENT}")
    encoder = answer.engine_urls["encoder-0"]
    entry = answer.engine_urls.get("proxy") or answer.engine_urls["router"]
    print(
        f"  openai     OpenAI base URL: {answer.front_url}/v1 (the front Service, the model's EPD gateway: any "
        "OpenAI client gets EPD)"
    )
    if answer.envoy is not None:
        print(
            f"  envoy      {answer.envoy.url}/v1  Envoy, as a Gateway API gateway runs it, asking the model's "
            "InferencePool's endpoint picker (an OpenAI base URL too)"
        )
    image = payloads.data_url(SECOND.png)
    ask = {
        "model": tiny_model.SERVED_NAME,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "IMG"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ],
    }
    print(f"\n  A second request ({SECOND.title}) with curl through the front Service (its proxy primes it):\n")
    print(f"    IMG={shlex.quote(image)}")
    data = json.dumps(ask).replace('"IMG"', "\"'$IMG'\"")
    print(
        f"    curl -s -w '\\n' {answer.front_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{data}'"
    )

    def sdk(options: str = "") -> str:
        return (
            "import openai, sys; "
            f"c = openai.OpenAI(base_url={json.dumps(answer.front_url + '/v1')}, api_key='none'{options}); "
            f"r = c.chat.completions.create(model={json.dumps(tiny_model.SERVED_NAME)}, max_tokens=8, "
            'temperature=0, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": '
            '{"url": sys.argv[1]}}, {"type": "text", "text": "what is this?"}]}]); '
            "print(repr(r.choices[0].message.content))"
        )

    print("\n  The same with the official openai SDK (pip install openai):\n")
    print(f'    {sys.executable} -c {shlex.quote(sdk())} "$IMG"')
    messages_api = (
        "import anthropic, sys; "
        f"c = anthropic.Anthropic(base_url={json.dumps(answer.front_url)}, api_key='none'); "
        "kind, data = sys.argv[1].removeprefix('data:').split(';base64,'); "
        f"r = c.messages.create(model={json.dumps(tiny_model.SERVED_NAME)}, max_tokens=8, "
        'extra_body={"temperature": 0}, messages=[{"role": "user", "content": [{"type": "image", "source": '
        '{"type": "base64", "media_type": kind, "data": data}}, {"type": "text", "text": "what is this?"}]}]); '
        "print(repr(r.content[0].text))"
    )
    print("\n  Or Anthropic's Messages API, with the official anthropic SDK (pip install anthropic):\n")
    print(f'    {sys.executable} -c {shlex.quote(messages_api)} "$IMG"')
    client = (
        "import epd_client as c, sys; "
        f"ep = c.Endpoints.from_urls([{json.dumps(encoder)}], {json.dumps(entry)}, "
        f"served_model_name={json.dumps(tiny_model.SERVED_NAME)}); "
        'img = {"type": "image_url", "image_url": {"url": sys.argv[1]}}; '
        'r = c.generate_sync(ep, {"max_tokens": 8, "messages": [{"role": "user", "content": '
        '[img, {"type": "text", "text": "what is this?"}]}]}); print(r["choices"][0]["token_ids"])'
    )
    print("\n  With epd_client, as rollouts do (prime on the encoder, then render and generate):\n")
    print(f'    {sys.executable} -c {shlex.quote(client)} "$IMG"')
    engine_core = f"kubectl -n {namespace} exec {pod} -c encoder-0 -- pkill -{{}} -f EngineCore"
    print(
        f"\n  {FAILURE_HEADING}: its engine stopped (SIGSTOP: it hangs, its /health still answers), the\n"
        f"  picture under a weights version of its own (its unit holds no embedding of it for that version)\n"
        f"  is refused after the unit's proxy.primeTimeoutSeconds ({PRIME_TIMEOUT_SECONDS} s here), never\n"
        "  encoded on a consumer (the SDK raises openai.InternalServerError: Error code: 502); then it serves again:\n"
    )
    print(f"    {engine_core.format('STOP')}")
    fresh = ", max_retries=0, default_headers={'X-EPD-Weights-Version': 'encoder-stopped'}"
    print(f'    {sys.executable} -c {shlex.quote(sdk(fresh))} "$IMG"')
    print(f"    {engine_core.format('CONT')}")
    print()
