"""The REAL part of `make demo`: the operator's pod for the tiny model run here, one request with
two images through epd_client, and what happened, printed as a person would want to read it.

`serve` is also what tests/vllm/test_demo.py runs, headless, with the test session's cluster,
operator and aggregated engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import re
import shlex
import shutil
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import yaml

from epd_client import Endpoints, EPDClient

from .operator_process import get_json, wait_for
from .vllm import engines, payloads, serving, tiny_model
from .vllm.unit_runner import UnitRunner

NAME = "tiny-llava-pd"
MAX_TOKENS = 12
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


class Records:
    """What the demo started that outlives it, written to `<root>/serving.json` as each thing
    starts, so that `down` (from any process) stops and removes exactly that."""

    def __init__(self, root: Path) -> None:
        self.path = root / "serving.json"
        self.data: dict[str, list[Any]] = (
            json.loads(self.path.read_text()) if self.path.exists() else {"engines": [], "folders": []}
        )

    def engine(self, engine: engines.Engine, name: str | None = None) -> None:
        assert engine.proc is not None
        self.data["engines"].append(
            {
                "name": name or engine.name,
                "pid": engine.proc.pid,
                "ticks": engines.start_ticks(engine.proc.pid),
                "log": str(engine.log_path),
            }
        )
        self._save()

    def folder(self, path: str | Path) -> None:
        """A folder in /dev/shm the engines write (EC and KV stores): memory until removed."""
        self.data["folders"].append(str(path))
        self._save()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2))
        tmp.replace(self.path)

    def stop_all(self) -> list[str]:
        """Stop every recorded engine (routers first, as started last) and remove the folders."""
        stopped = [e["name"] for e in reversed(self.data["engines"]) if engines.stop_recorded(e["pid"], e["ticks"])]
        for folder in self.data["folders"]:
            shutil.rmtree(folder, ignore_errors=True)
        self.path.unlink(missing_ok=True)
        self.data = {"engines": [], "folders": []}
        return stopped


class Progress:
    """While engines start (a minute or two each): says when each one answers its health check,
    and every `every` seconds which ones are still loading. `check` is also called before
    saying an engine started, so that lines come in the order things happen."""

    def __init__(self, watched: list[tuple[str, engines.Engine]], every: float = 15.0) -> None:
        self.watched, self.every = watched, every
        self.ready: set[str] = set()
        self.seen_loading: set[str] = set()
        self.last = time.monotonic()
        self.lock = threading.Lock()
        self.done = threading.Event()

    def check(self) -> None:
        with self.lock:
            loading = []
            for label, engine in self.watched:
                if label in self.ready or engine.proc is None or engine.proc.poll() is not None:
                    continue
                took = time.monotonic() - engine.started_at
                if _healthy(engine):
                    self.ready.add(label)
                    when = f"after {took:.0f}s" if label in self.seen_loading else "(it loaded meanwhile)"
                    say(f"REAL  {label} ready {when}: {engine.health_path} on :{engine.port} answers 200")
                else:
                    self.seen_loading.add(label)
                    loading.append(f"{label} {took:.0f}s")
            if loading and time.monotonic() - self.last >= self.every:
                self.last = time.monotonic()
                say(f"REAL  still loading: {', '.join(loading)}")

    def __enter__(self) -> Self:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.done.wait(1.0):
            self.check()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        if exc_type is None:
            self.check()  # the last ones ready, before whatever the caller says next


def _healthy(engine: engines.Engine) -> bool:
    try:
        with urllib.request.urlopen(engine.url + engine.health_path, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


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
    engine_urls: dict[str, str]  # container name -> local URL (router included)
    reference_url: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    reference_token_ids: list[int]
    reference_logprobs: list[float]
    seconds: float  # EPDClient.generate, end to end
    served: dict[str, dict[str, tuple[int, float]]]  # engine -> path -> (requests, seconds)
    image_hashes: list[str]  # vLLM's mm_hash of each picture: its folder in the EC store
    ec_store: Path
    ec_files: dict[str, list[tuple[str, int]]]  # mm_hash -> (file, bytes), written by the prime
    kv_files: list[tuple[str, int]]  # what prefill wrote for decode

    @property
    def max_logprob_difference(self) -> float:
        return max((abs(a - b) for a, b in zip(self.logprobs, self.reference_logprobs)), default=math.inf)

    @property
    def identical(self) -> bool:
        return self.token_ids == self.reference_token_ids and self.max_logprob_difference <= 1e-3


def serve(
    cluster: Any, root: Path, namespace: str, *, port_base: int, reference: engines.Engine, records: Records
) -> Answer:
    """Apply the tiny model's EPDDeployment, run the pod the operator makes as the kubelet would,
    send the request, print it all; the engines keep running (`records` lists them)."""
    model_dir = tiny_model.tiny_model_path()
    kv_store = Path(f"/dev/shm/epd-demo-kv-{uuid.uuid4().hex[:12]}")
    records.folder(kv_store)
    manifest = serving.in_process_workers(
        serving.tiny_manifest(NAME, model_dir, serving.prefill_decode_groups(kv_store), port_base=port_base)
    )
    manifest["metadata"]["namespace"] = namespace
    manifest_path = root / f"{NAME}.yaml"
    manifest_path.write_text(yaml.safe_dump(manifest, sort_keys=False))
    say(f"REAL  kubectl apply -f {manifest_path}  (encoder + prefill + decode of {model_dir.name})")
    cluster.kubectl("apply", "-f", str(manifest_path))

    def scheduled() -> dict[str, Any] | None:
        obj = get_json(cluster, "epd", NAME, "-n", namespace)
        status = (obj or {}).get("status", {})
        return status if status.get("phase") == "Ready" else None

    status = wait_for(scheduled, 120, f"epd/{NAME} to be Ready on kwok's node")
    found = serving.discover_ready(cluster.kubeconfig, NAME, namespace)
    (unit,) = found.model(serving.MODEL).units
    pod = get_json(cluster, "pod", unit.name, "-n", namespace)
    say(
        f"REAL  the operator made pod {unit.name}; kwok bound it to {unit.node} (pod IP "
        f"{pod['status']['podIP']}). Its containers now run HERE, on the CPU, as the kubelet would start "
        "them: the encoder sidecar first, on its startup probe; then prefill and decode; then the router."
    )

    def started(engine: engines.Engine) -> None:
        records.engine(engine)
        progress.check()
        pid = engine.proc.pid if engine.proc else None
        say(f"REAL  started {engine.name} (pid {pid}, port {engine.port}, log {engine.log_path})")

    runner = UnitRunner(pod, root / "logs", die_with_parent=False, on_start=started)
    if runner.ec_storage_path:
        records.folder(runner.ec_storage_path)
    began = time.monotonic()
    with Progress([*((e.name, e) for e in runner.engines), ("aggregated", reference)]) as progress:
        runner.start()
        reference.wait_healthy()
    say(f"REAL  the unit is serving, {time.monotonic() - began:.0f}s after its first container started")
    answer = asyncio.run(
        _ask(serving.localized(found, runner), runner, reference, Path(status["models"][0]["ecStoragePath"]), kv_store)
    )
    print_answer(answer)
    return answer


async def _ask(
    endpoints: Endpoints, runner: UnitRunner, reference: engines.Engine, ec_store: Path, kv_store: Path
) -> Answer:
    engine_urls = {e.name: e.url for e in runner.engines}
    scraped = [e for e in runner.engines if e is not runner.router]  # vLLM engines have /metrics
    before = {e.name: payloads.served_seconds(e.url) for e in scraped}
    ec_before, kv_before = payloads.ec_entries(ec_store), _files(kv_store)
    request = demo_request()

    start = time.monotonic()
    async with EPDClient(endpoints) as client:
        result = await client.generate(request)
    seconds = time.monotonic() - start

    served = {}
    for engine in scraped:
        now, then = payloads.served_seconds(engine.url), before[engine.name]
        delta = {
            path: (n - then.get(path, (0, 0.0))[0], s - then.get(path, (0, 0.0))[1]) for path, (n, s) in now.items()
        }
        served[engine.name] = {path: d for path, d in delta.items() if d[0]}
    token_ids, logprobs = payloads.output(result)
    # The reference renders the same request: its mm_hashes name each picture's EC folder.
    rendered = reference.post("/v1/chat/completions/render", request)
    ref_ids, ref_logprobs = payloads.output(reference.post("/inference/v1/generate", rendered))
    decode = next(e for e in runner.consumers if e.name.startswith("decode"))
    text = decode.post("/detokenize", {"model": tiny_model.SERVED_NAME, "tokens": token_ids})["prompt"]
    ec_after = payloads.ec_entries(ec_store)
    ec_files = {
        h: [(f, (ec_store / h / f).stat().st_size) for f in files]
        for h, files in ec_after.items()
        if h not in ec_before
    }
    kv_files = [(name, size) for name, size in _files(kv_store).items() if name not in kv_before]
    return Answer(
        engine_urls,
        reference.url,
        token_ids,
        logprobs,
        text,
        ref_ids,
        ref_logprobs,
        seconds,
        served,
        payloads.image_hashes(rendered),
        ec_store,
        ec_files,
        kv_files,
    )


def _files(folder: Path) -> dict[str, int]:
    """Every file under `folder` (relative name -> bytes)."""
    if not folder.is_dir():
        return {}
    return {str(f.relative_to(folder)): f.stat().st_size for f in folder.rglob("*") if f.is_file()}


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

    _section(f"what the prime wrote: the EC store {answer.ec_store}")
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

    _section("the same request on an aggregated engine (one vLLM engine, no disaggregation)")
    print(f"  token ids  {answer.reference_token_ids}")
    same = sum(a == b for a, b in zip(answer.token_ids, answer.reference_token_ids))
    print(
        f"  identical: {'yes' if answer.identical else 'NO'} ({same} of {len(answer.token_ids)} token ids equal; "
        f"logprobs differ by at most {answer.max_logprob_difference:.1e})"
    )


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def print_explore(answer: Answer, cluster: Any, namespace: str, root: Path) -> None:
    _section("keep exploring: everything keeps running")
    roles = {
        "encoder": "the EC producer (a sidecar): primes images into the EC store",
        "prefill": "EC consumer and KV producer",
        "decode": "KV consumer",
        "router": "vllm-router --vllm-pd-disaggregation: the unit's entry",
    }
    for name, url in answer.engine_urls.items():
        print(f"  {name:<11}{url:<25}{roles.get(name.split('-')[0], '')}")
    print(f"  {'aggregated':<11}{answer.reference_url:<25}the reference engine")
    print(f"  logs       {root / 'logs'}/*.log, operator: {root / 'operator.log'}")
    print(
        f"  kubectl    export KUBECONFIG={cluster.kubeconfig} PATH={cluster.dir / 'bin'}:$PATH; "
        f"kubectl -n {namespace} get epd,pods -o wide"
    )
    encoder, router = answer.engine_urls["encoder-0"], answer.engine_urls["router"]
    image = payloads.data_url(SECOND.png)
    prime = {
        "model": tiny_model.SERVED_NAME,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "IMG"}}]}],
    }
    ask = {
        "model": tiny_model.SERVED_NAME,
        "max_tokens": 8,
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
    print(f"\n  A second request with curl ({SECOND.title}): prime it on the encoder, then ask the router:\n")
    print(f"    IMG={shlex.quote(image)}")
    for url, body in ((encoder, prime), (router, ask)):
        data = json.dumps(body).replace('"IMG"', "\"'$IMG'\"")
        print(f"    curl -s -w '\\n' {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{data}'")
    client = (
        "import epd_client as c, sys; "
        f"ep = c.Endpoints.from_urls([{json.dumps(encoder)}], {json.dumps(router)}, "
        f"served_model_name={json.dumps(tiny_model.SERVED_NAME)}); "
        'img = {"type": "image_url", "image_url": {"url": sys.argv[1]}}; '
        'r = c.generate_sync(ep, {"max_tokens": 8, "messages": [{"role": "user", "content": '
        '[img, {"type": "text", "text": "what is this?"}]}]}); print(r["choices"][0]["token_ids"])'
    )
    print("\n  The same with epd_client (prime, render, generate):\n")
    print(f'    {sys.executable} -c {shlex.quote(client)} "$IMG"')
    print()
