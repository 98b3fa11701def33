"""Shared pieces of the client tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epd_client import RetryPolicy, Unit
from epd_dev.standins.vllm_server import StandinServer

# Quick retries so failure paths take milliseconds.
FAST = RetryPolicy(max_attempts=4, backoff=0.01, max_backoff=0.05, attempt_timeout=2, deadline=10)


def image_messages(count: int) -> list[dict[str, Any]]:
    """A system text, then ``count`` images spread over two user messages, with parts the
    client must ignore (text, embeddings given inline, typed media whose URL is not a string,
    which vLLM refuses)."""
    images = [{"type": "image_url", "image_url": {"url": f"https://images.test/{i}.png"}} for i in range(count)]
    half = count // 2
    return [
        {"role": "system", "content": "You describe pictures."},
        {"role": "user", "content": [{"type": "text", "text": "first"}, *images[:half]]},
        {
            "role": "user",
            "content": [
                {"type": "image_embeds", "image_embeds": "AAAA"},
                {"type": "image_url", "image_url": {"url": None}},
                {"type": "video_url", "video_url": {"url": 7}},
                {"type": "prompt_embeds", "data": "AAAA"},
                *images[half:],
            ],
        },
    ]


def image_urls(server: StandinServer) -> list[str]:
    """Image URLs of the prime requests a stand-in received, in arrival order."""
    return [r.body["messages"][0]["content"][0]["image_url"]["url"] for r in server.requests("/v1/chat/completions")]


@dataclass
class UnitServers:
    """Stand-ins for one EPD unit: encoders and a consumer sharing one EC store."""

    name: str
    encoders: list[StandinServer]
    consumer: StandinServer

    def unit(self, *, ready: bool = True) -> Unit:
        return Unit(
            name=self.name,
            encoder_urls=tuple(e.url for e in self.encoders),
            consumer_urls=(self.consumer.url,),
            ready=ready,
        )

    @property
    def prime_count(self) -> int:
        return sum(len(e.requests("/v1/chat/completions")) for e in self.encoders)


def model_status(
    name: str,
    stateful_set: str,
    units: int,
    engines: list[tuple[str, str, int]],
    *,
    entry_port: int | None = 8000,
    router_port: int | None = None,
    served_model_name: str | None = None,
    pool: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One model of an EPDDeployment status as the operator writes it: what each unit holds;
    where the units are, the EndpointSlices of ``<stateful_set>-units`` say."""
    model: dict[str, Any] = {
        "name": name,
        "statefulSet": stateful_set,
        "unitsService": f"{stateful_set}-units",
        "desiredUnits": units,
        "engines": [{"name": n, "role": r, "port": p} for n, r, p in engines],
    }
    if served_model_name is not None:
        model["servedModelName"] = served_model_name
    if entry_port is not None:
        model["entryPort"] = entry_port
    if router_port is not None:
        model["routerPort"] = router_port
    if pool is not None:
        model.update(placement="Pools", encoderPool=pool)
    return model


def endpoint_slice(service: str, *endpoints: tuple[str, str, bool], node: str = "gpu-1") -> dict[str, Any]:
    """An EndpointSlice of ``service`` as kube-controller-manager writes it for a Service with
    publishNotReadyAddresses: every pod ``ready``, ``serving`` its readiness. Each endpoint is
    (pod name, IP, serving)."""
    return {
        "metadata": {"name": f"{service}-abcde", "labels": {"kubernetes.io/service-name": service}},
        "endpoints": [
            {
                "addresses": [ip],
                "conditions": {"ready": True, "serving": serving, "terminating": False},
                "hostname": pod,
                "nodeName": node,
                "targetRef": {"kind": "Pod", "namespace": "ns", "name": pod, "uid": "u"},
            }
            for pod, ip, serving in endpoints
        ],
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
    }
