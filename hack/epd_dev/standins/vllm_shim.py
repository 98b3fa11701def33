#!/usr/bin/python3
"""A STAND-IN for a vLLM engine in a pod, NOT vLLM: `vllm serve ...` as the operator renders it,
answered by a small server with vLLM's shapes, its load endpoints and its metric names.

For what real vLLM cannot do here: vLLM 0.34, which placement Pools needs (ECCPUConnector over
NIXL), has no CPU build, so an autoscaled encoder pool runs on the real node with these. The
image `localhost/vllm-standin:v0.34.0` carries this file as its `vllm`, on the standard library
alone (any python3): it reads the flags it needs (`--port`, `--served-model-name`, the
`ec_role` of `--ec-transfer-config`) and ignores the others.

Capacity is what makes it an engine for an autoscaler: at most ``EPD_STANDIN_RUNNING`` requests
run at once (vLLM's batch), each for ``EPD_STANDIN_SECONDS`` (an encoder's per picture, a
consumer's per request); the others wait, as `vllm:num_requests_waiting` shows them. An encoder
(`ec_producer`) answers a prime with `ec_transfer_params` naming its pod (VLLM_EC_SIDE_CHANNEL_HOST)
as the peer of each picture, as ECCPUConnector's producer does; a consumer counts the pictures
of a request that arrive without transfer params (`epd_standin_consumer_encodes_total`: what real
vLLM would encode itself, silently).

Endpoints: POST /v1/chat/completions; GET /health, /v1/models, /load ({"server_load": n}, vLLM's
--enable-server-load-tracking), /is_paused, /metrics (vllm:num_requests_running,
vllm:num_requests_waiting, vllm:request_success_total, vllm:prompt_tokens_total,
process_start_time_seconds: what the engine liveness check and the PodMonitor read). SIGTERM
stops accepting and lets the requests in flight finish, as vLLM's server does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 64 * 1024 * 1024


class Engine:
    """The engine's state: its slots, its counters."""

    def __init__(self, model: str, producer: bool, seconds: float, running: int, peer: str, port: int) -> None:
        self.model = model
        self.producer = producer
        self.seconds = seconds
        self.slots = threading.Semaphore(running)
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.success = 0
        self.consumer_encodes = 0
        self.started = time.time()
        self.peer = peer
        self.port = port

    def serve(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion: wait for a slot, hold it for the service time (per picture for
        an encoder), answer."""
        pictures = _pictures(body)
        with self.lock:
            self.waiting += 1
        with self.slots:
            with self.lock:
                self.waiting -= 1
                self.running += 1
            try:
                time.sleep(self.seconds * (max(1, len(pictures)) if self.producer else 1))
            finally:
                with self.lock:
                    self.running -= 1
                    self.success += 1
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
        }
        if self.producer:
            answer["ec_transfer_params"] = {
                name: {"peer_host": self.peer, "peer_port": self.port, "do_remote_decode": False} for name in pictures
            }
        else:
            announced = body.get("ec_transfer_params") or {}
            with self.lock:
                self.consumer_encodes += sum(1 for name in pictures if name not in announced)
        return answer

    def metrics(self) -> str:
        label = f'{{model_name="{self.model}"}}'
        with self.lock:
            lines = [
                f"vllm:num_requests_running{label} {self.running}",
                f"vllm:num_requests_waiting{label} {self.waiting}",
                f"vllm:request_success_total{label} {self.success}",
                f"vllm:prompt_tokens_total{label} {8 * self.success}",
                f"epd_standin_consumer_encodes_total {self.consumer_encodes}",
                f"process_start_time_seconds {self.started}",
            ]
        return "\n".join(lines) + "\n"


def _pictures(body: dict[str, Any]) -> list[str]:
    """The names vLLM gives the request's pictures: a part's uuid, else a hash of its URL."""
    names = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = (part.get("image_url") or {}).get("url", "")
                names.append(part.get("uuid") or hashlib.sha256(str(url).encode()).hexdigest())
    return names


def handler(engine: Engine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _answer(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path == "/health":
                self._answer(200, b"")
            elif path == "/metrics":
                self._answer(200, engine.metrics().encode(), "text/plain; version=0.0.4")
            elif path == "/load":
                with engine.lock:
                    load = engine.running + engine.waiting
                self._answer(200, json.dumps({"server_load": load}).encode())
            elif path == "/is_paused":
                self._answer(200, b'{"is_paused": false}')
            elif path == "/v1/models":
                self._answer(200, json.dumps({"object": "list", "data": [{"id": engine.model}]}).encode())
            else:
                self._answer(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if length > MAX_BODY_BYTES:
                self._answer(413, b'{"error": "too large"}')
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._answer(400, b'{"error": "not JSON"}')
                return
            if self.path.split("?")[0] != "/v1/chat/completions":
                self._answer(404, b'{"error": "not found"}')
                return
            self._answer(200, json.dumps(engine.serve(body)).encode())

    return Handler


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "serve":
        print("vllm (stand-in): only `vllm serve MODEL ...` is served", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="vllm serve")
    parser.add_argument("model")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--ec-transfer-config", default=None)
    known, _ = parser.parse_known_args(argv[1:])
    role = json.loads(known.ec_transfer_config).get("ec_role") if known.ec_transfer_config else None
    producer = role == "ec_producer"
    seconds = float(os.environ.get("EPD_STANDIN_SECONDS", "0.2" if producer else "0.05"))
    running = int(os.environ.get("EPD_STANDIN_RUNNING", "2"))
    peer = os.environ.get("VLLM_EC_SIDE_CHANNEL_HOST", "127.0.0.1")
    engine = Engine(known.served_model_name or known.model, producer, seconds, running, peer, known.port)
    server = ThreadingHTTPServer((known.host, known.port), handler(engine))
    server.daemon_threads = False  # requests in flight finish on shutdown
    server.block_on_close = True

    def stop(*_: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"vllm stand-in ({role or 'no EC role'}) serving {engine.model} on {known.host}:{known.port}", flush=True)
    server.serve_forever()
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
