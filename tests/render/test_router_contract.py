"""Contract with the REAL vllm-router (0.1.17, tests/vllm/envs.py): its launcher accepts every
rendered router command and reads it as intended, and the binary starts with one."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from epd_dev.vllm import envs
from epd_operator.render import render
from epd_operator.validation import validate

from .cases import CASES, OBJECT, VERSIONS, plans, raw_spec

HELPER = Path(__file__).with_name("parse_with_router.py")


@pytest.fixture(scope="module")
def router_binary() -> Path:
    try:
        return envs.router_binary()
    except envs.MissingEnvironment as missing:
        pytest.fail(str(missing), pytrace=False)


def _launcher_parse(router_binary: Path, argvs: dict[str, list[str]]) -> dict[str, dict]:
    # The binary is a console script: its interpreter sits next to it.
    python = router_binary.parent / "python"
    out = subprocess.run(
        [str(python), str(HELPER)], input=json.dumps(argvs), capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout)


def test_every_rendered_router_command_is_read_as_intended(router_binary: Path) -> None:
    routers = {
        f"{case}/{version}/{plan.name}": (plan, version)
        for case in CASES
        for version in VERSIONS
        for plan in plans(case, version)
        if plan.router
    }
    assert {key.split("/")[0] for key in routers} == {
        "encoder-prefill-decode",
        "overrides-regular",
        "overrides-prefill-decode",
        "text-only",
        "pools-regular",
        "pools-prefill-decode",
    }
    results = _launcher_parse(router_binary, {key: plan.router.args for key, (plan, _) in routers.items()})
    for key, (plan, version) in routers.items():
        result = results[key]
        assert result["ok"], f"{key}: {result['error']}"
        args = result["args"]
        consumers = [e for e in plan.engines if e.worker_type != "encoder"]
        url = "http://127.0.0.1:{}".format
        # Behind the EPD proxy (every model with encoders) it serves the pod's loopback only.
        host = "127.0.0.1" if plan.proxy else "0.0.0.0"
        assert (args["host"], args["port"]) == (host, plan.router.port), key
        assert args["policy"] == raw_spec(key.split("/")[0], version).get("router", {}).get("policy", "round_robin")
        if any(e.worker_type == "prefill" for e in consumers):
            assert args["vllm_pd_disaggregation"] and args["kv_connector"] == "nixl", key
            assert args["prefill_urls"] == [[url(e.port), None] for e in consumers if e.worker_type == "prefill"]
            assert args["decode_urls"] == [url(e.port) for e in consumers if e.worker_type == "decode"]
            assert args["worker_urls"] == []
        else:
            assert not args["vllm_pd_disaggregation"], key
            assert args["worker_urls"] == [url(e.port) for e in consumers]
    overrides = results["overrides-regular/0.33/vlm"]["args"]
    assert (overrides["request_timeout_secs"], overrides["disable_circuit_breaker"]) == (600, True)


def test_the_launcher_rejects_what_it_does_not_know(router_binary: Path) -> None:
    results = _launcher_parse(
        router_binary,
        {
            "unknown-flag": ["vllm-router", "--no-such-flag"],
            "pd-without-decode": ["vllm-router", "--vllm-pd-disaggregation", "--prefill", "http://127.0.0.1:1"],
        },
    )
    assert results["unknown-flag"]["exit_code"] == 2
    assert "PD disaggregation mode requires --decode" in results["pd-without-decode"]["error"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("case", ["encoder-prefill-decode", "overrides-regular"])
def test_the_binary_starts_with_a_rendered_command(router_binary: Path, case: str) -> None:
    raw = raw_spec(case, VERSIONS[-1])
    raw["ports"] = {"router": _free_port(), "routerLoopback": _free_port()}
    raw["router"] = {**raw.get("router", {}), "extraArgs": ["--prometheus-port", str(_free_port())]}
    [plan] = render(validate(raw), **OBJECT)
    proc = subprocess.Popen(
        [str(router_binary), *plan.router.args[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # The workers do not exist: the router logs its mode, then keeps waiting for them.
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline and not any("Starting router on" in l for l in lines):
            time.sleep(0.1)
        time.sleep(1)  # an argument error would end it right away
        assert proc.poll() is None, f"vllm-router exited {proc.returncode}: {''.join(lines)[-3000:]}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=10)
    output = "".join(lines)
    host = "127.0.0.1" if plan.proxy else "0.0.0.0"
    assert f"Starting router on {host}:{plan.router.port}" in output, output[-3000:]
    for engine in plan.engines:
        listed = f'"http://127.0.0.1:{engine.port}"' in output
        assert listed == (engine.worker_type != "encoder"), (engine.container_name, output[-3000:])
