"""A model's engines for the trainer: listed by role from the status, paused and resumed
all at once."""

from __future__ import annotations

import dataclasses

import pytest

from epd_client import (
    Endpoints,
    EndpointsError,
    Engine,
    EngineError,
    EPDClient,
    ModelEndpoints,
    RetryPolicy,
    Unit,
)
from epd_dev.standins.engine_control import EngineControl
from epd_dev.standins.fault_proxy import http_status

from .helpers import FAST, endpoint_slice, model_status

# A status as the operator writes it, and the units Services' EndpointSlices.
STATUS = {
    "models": [
        model_status(
            "actor",
            "demo-actor",
            2,
            [("encoder-0", "encoder", 8100), ("prefill-0", "prefill", 8101), ("decode-0", "decode", 8102)],
            served_model_name="actor",
        ),
        model_status("reward", "demo-reward", 1, [("regular-0", "regular", 8100)], served_model_name="reward"),
    ]
}
SLICES = [
    endpoint_slice("demo-actor-units", ("demo-actor-0", "10.0.0.5", True)),  # demo-actor-1 has no IP yet
    endpoint_slice("demo-reward-units", ("demo-reward-0", "10.0.0.7", True)),
]


def test_engines_by_role_from_the_status() -> None:
    endpoints = Endpoints.from_status(STATUS, SLICES)
    assert endpoints.engines("actor") == (
        Engine("demo-actor-0", "encoder-0", "encoder", "http://10.0.0.5:8100"),
        Engine("demo-actor-0", "prefill-0", "prefill", "http://10.0.0.5:8101"),
        Engine("demo-actor-0", "decode-0", "decode", "http://10.0.0.5:8102"),
        Engine("demo-actor-1", "encoder-0", "encoder", None),  # listed while it has no IP
        Engine("demo-actor-1", "prefill-0", "prefill", None),
        Engine("demo-actor-1", "decode-0", "decode", None),
    )
    assert [e.url for e in endpoints.engines("actor", "encoder")] == ["http://10.0.0.5:8100", None]
    assert endpoints.engines("reward", "encoder") == ()
    assert endpoints.engines("reward") == (Engine("demo-reward-0", "regular-0", "regular", "http://10.0.0.7:8100"),)
    # An encoder without a URL still makes the model an EPD one.
    assert endpoints.model("actor").has_encoders and not endpoints.model("reward").has_encoders
    assert EPDClient(endpoints).engines("actor", "decode") == endpoints.engines("actor", "decode")
    with pytest.raises(EndpointsError, match="unknown model 'critic'"):
        endpoints.engines("critic")


def test_units_built_from_urls_list_engines_derived_from_them() -> None:
    # Units built from URLs list their engines derived from their URLs when asked (roles beyond
    # "encoder" unknown), so a copy with other URLs (e.g. mapped to localhost) lists those.
    endpoints = Endpoints.from_urls(["http://e:1"], "http://c:2")
    assert endpoints.engines("default") == (
        Engine("default", "encoder-0", "encoder", "http://e:1"),
        Engine("default", "consumer-0", "consumer", "http://c:2"),
    )
    (unit,) = endpoints.model("default").units
    assert unit.engines == ()
    moved = dataclasses.replace(unit, encoder_urls=("http://127.0.0.1:1",))
    assert moved.all_engines()[0] == Engine("default", "encoder-0", "encoder", "http://127.0.0.1:1")


def control_endpoints(*units: list, router: EngineControl | None = None) -> Endpoints:
    """Model "actor" whose unit i has the engines at the URLs of units[i] (servers or
    proxies; the first an encoder)."""
    built = tuple(
        Unit(
            name=f"u{i}",
            router_url=router.url if router else None,
            engines=tuple(
                Engine(f"u{i}", f"e{j}", "encoder" if j == 0 else "regular", e.url) for j, e in enumerate(engines)
            ),
        )
        for i, engines in enumerate(units)
    )
    return Endpoints((ModelEndpoints("actor", built),))


async def test_pause_and_resume_call_every_engine_at_once(stack) -> None:
    units = [[stack.enter_context(EngineControl(delay=0.3)) for _ in range(3)] for _ in range(2)]
    router = stack.enter_context(EngineControl())
    engines = [e for unit in units for e in unit]
    async with EPDClient(control_endpoints(*units, router=router), retry=FAST) as client:
        await client.pause("actor")
        assert all(e.paused for e in engines)
        assert [c.target for e in engines for c in e.calls] == ["/pause?mode=abort&clear_cache=true"] * 6
        calls = [c for e in engines for c in e.calls]
        # Concurrent: every call started before the first one was answered.
        assert max(c.started for c in calls) < min(c.finished for c in calls)

        await client.resume("actor")
        assert not any(e.paused for e in engines)
        assert {(c.method, c.target) for e in engines for c in e.calls[1:]} == {("POST", "/resume")}
    assert router.calls == []  # the router holds no weights


async def test_pause_passes_vllms_options(stack) -> None:
    engine = stack.enter_context(EngineControl())
    async with EPDClient(control_endpoints([engine])) as client:
        await client.pause("actor", mode="keep", clear_cache=False)
    assert [c.target for c in engine.calls] == ["/pause?mode=keep&clear_cache=false"]


async def test_pause_retries_like_every_request(stack, proxy) -> None:
    engine = stack.enter_context(EngineControl())
    front = proxy(engine.url)
    front.add(http_status(503), times=2)
    async with EPDClient(control_endpoints([front]), retry=FAST) as client:
        await client.pause("actor")
    assert front.faults() == ["status", "status", "forward"]
    assert engine.paused


async def test_failed_engines_are_named_with_the_fix(stack, proxy) -> None:
    healthy = stack.enter_context(EngineControl())
    no_dev_mode = stack.enter_context(EngineControl(dev_mode=False))
    down = proxy(stack.enter_context(EngineControl()).url)
    down.add(http_status(503), times=None)
    policy = RetryPolicy(max_attempts=3, backoff=0.01, deadline=10)
    async with EPDClient(control_endpoints([healthy, no_dev_mode, down]), retry=policy) as client:
        with pytest.raises(EngineError) as caught:
            await client.pause("actor")

    error = caught.value
    assert error.model == "actor"
    assert [(e.name, e.url, x.status_code, x.attempts) for e, x in error.failures] == [
        ("e1", no_dev_mode.url, 404, 1),  # a 404 is not retried
        ("e2", down.url, 503, 3),
    ]
    message = str(error)
    assert "2 of 3 engine(s) of model 'actor'" in message
    assert f"u0/e1 ({no_dev_mode.url})" in message and f"u0/e2 ({down.url})" in message
    assert "VLLM_SERVER_DEV_MODE=1" in message
    assert healthy.paused  # the others were still called


async def test_engines_without_a_url_fail_before_any_call(stack) -> None:
    engine = stack.enter_context(EngineControl())
    endpoints = Endpoints(
        (
            ModelEndpoints(
                "actor",
                (
                    Unit("u0", engines=(Engine("u0", "encoder-0", "encoder", engine.url),)),
                    Unit("u1", engines=(Engine("u1", "encoder-0", "encoder", None),)),
                ),
            ),
        )
    )
    async with EPDClient(endpoints) as client:
        with pytest.raises(EndpointsError, match=r"no IP yet\): u1/encoder-0;"):
            await client.pause("actor")
        with pytest.raises(EndpointsError, match="unknown model"):
            await client.resume("critic")
    assert engine.calls == []


async def test_a_unit_known_only_by_urls_is_paused_whole(stack) -> None:
    encoder, consumer = stack.enter_context(EngineControl()), stack.enter_context(EngineControl())
    unit = Unit("u", encoder_urls=(encoder.url,), consumer_urls=(consumer.url,))
    async with EPDClient(Endpoints((ModelEndpoints("actor", (unit,)),))) as client:
        await client.pause("actor")
    assert encoder.paused and consumer.paused
