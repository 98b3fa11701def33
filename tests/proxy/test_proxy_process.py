"""`epd-dataplane proxy` as the process a unit's container runs: its flags, and a SIGTERM that
lets a request in flight finish."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from epd_dataplane.cli import build_parser
from epd_dataplane.encoders import Ejection
from epd_dev.proxy_process import ProxyProcess

# Media on a public address, which the proxy's media URL check lets through without asking DNS
# (the stand-in encoders fetch nothing).
MEDIA = "https://93.184.216.34/x.png"


def test_flags_and_their_defaults():
    args = build_parser().parse_args(["proxy", "--upstream", "http://127.0.0.1:8001", "--encoder", "http://a:1"])
    assert (args.port, args.metrics_port, args.request_timeout_seconds, args.prime_timeout_seconds) == (
        8000,
        9401,
        1800.0,
        600.0,
    )
    assert (args.max_request_bytes, args.placement, args.encoder) == (64 * 2**20, "Unit", ["http://a:1"])
    assert args.prime_attempt_timeout_seconds is None  # epd_client's attempt timeout, capped by the whole
    ejection = Ejection.given(args.eject_after_failures, args.ejection_base_seconds, args.ejection_max_seconds)
    assert ejection == Ejection(consecutive_failures=5, base_seconds=30.0, max_seconds=300.0)  # Envoy's
    args = build_parser().parse_args(
        ["proxy", "--upstream", "u", "--encoders-dns", "pool.ns.svc:8100,8101", "--max-request-bytes", "1.5Mi"]
    )
    assert (args.encoders_dns, args.max_request_bytes) == ("pool.ns.svc:8100,8101", 1572864)
    assert (args.allowed_media_domains, args.media_allow_private_networks) == ([], False)  # any public host


@pytest.mark.parametrize(
    "argv",
    [
        ["--upstream", "u"],  # no encoder at all
        ["--upstream", "u", "--encoder", "e", "--encoders-dns", "pool:1"],
        ["--upstream", "u", "--encoders-dns", "pool"],
        ["--upstream", "u", "--encoder", "e", "--max-request-bytes", "100m"],
        ["--upstream", "u", "--encoder", "e", "--port", "0"],
        ["--upstream", "u", "--encoder", "e", "--eject-after-failures", "-1"],
        ["--upstream", "u", "--encoder", "e", "--prime-timeout-seconds", "nan"],
        ["--upstream", "u", "--encoder", "e", "--request-timeout-seconds", "inf"],
    ],
)
def test_bad_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["proxy", *argv])


def test_the_process_primes_serves_and_drains_on_sigterm(server, tmp_path):
    encoder, upstream = server(), server(delay=1.0)
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": MEDIA}}]}],
    }
    with ProxyProcess(upstream.url, [encoder.url], tmp_path, args=["--prime-max-attempts", "2"]) as proxy:
        answers = []

        def call() -> None:
            post = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(request).encode())
            with urllib.request.urlopen(post, timeout=30) as response:
                answers.append((response.status, json.load(response)["object"]))

        client = threading.Thread(target=call)
        client.start()
        while not upstream.records:  # the request reached the upstream, which answers in 1 s
            client.join(0.05)
        assert proxy.stop() == 0  # SIGTERM while the request is in flight
        client.join(30)
    assert answers == [(200, "chat.completion")]
    assert len(encoder.records) == 1
    log = proxy.tail()
    assert "serving on 127.0.0.1" in log
    assert "HTTP Request" not in log  # httpx's line per prime stays out at INFO


def test_a_hung_encoder_costs_one_prime_attempt_and_the_retry_reaches_the_next_encoder(server, tmp_path):
    hung, healthy, upstream = server(delay=60.0), server(), server()
    image = {"type": "image_url", "image_url": {"url": MEDIA}}
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": [image, image | {"image_url": {"url": MEDIA + "?2"}}]}],
    }
    attempts = ["--prime-attempt-timeout-seconds", "0.5", "--prime-timeout-seconds", "60"]
    with ProxyProcess(upstream.url, [hung.url, healthy.url], tmp_path, args=attempts) as proxy:
        post = urllib.request.Request(proxy.url + "/v1/chat/completions", data=json.dumps(request).encode())
        with urllib.request.urlopen(post, timeout=30) as response:  # well under the 60 s the priming may take
            assert response.status == 200
    # One part went to each encoder; the hung one's attempt was cut and tried again on the other.
    assert (len(hung.records), len(healthy.records), len(upstream.records)) == (1, 2, 1)


def test_an_encoder_failing_in_a_row_is_left_out_of_the_next_primes(server, tmp_path):
    hung, healthy, upstream = server(delay=60.0), server(), server()
    image = {"type": "image_url", "image_url": {"url": MEDIA}}
    request = json.dumps({"model": "m", "messages": [{"role": "user", "content": [image]}]}).encode()
    flags = ["--prime-attempt-timeout-seconds", "0.5", "--eject-after-failures", "1", "--ejection-base-seconds", "60"]
    with ProxyProcess(upstream.url, [hung.url, healthy.url], tmp_path, args=flags) as proxy:
        for _ in range(4):
            with urllib.request.urlopen(proxy.url + "/v1/chat/completions", data=request, timeout=30) as response:
                assert response.status == 200
        metrics = proxy.metrics()
    # Round-robin would have sent two of the four to the hung encoder: it got the first only.
    assert (len(hung.records), len(healthy.records), len(upstream.records)) == (1, 4, 4)
    assert "epd_proxy_encoder_ejections_total 1.0" in metrics
    assert "epd_proxy_encoders_ejected 1.0" in metrics
    assert f"encoder {hung.url} left out for 60 s" in proxy.tail()


def test_media_urls_the_flags_refuse_are_a_400_and_nothing_is_primed(server, tmp_path):
    encoder, upstream = server(), server()
    flags = ["--allowed-media-domains", "Images.Example.com", "cdn.example.com"]
    refused = {"type": "image_url", "image_url": {"url": MEDIA}}
    allowed = {"type": "image_url", "image_url": {"url": "https://images.example.com/a.png"}}
    answers = []
    with ProxyProcess(upstream.url, [encoder.url], tmp_path, args=flags) as proxy:
        for part in (refused, allowed):
            body = json.dumps({"model": "m", "messages": [{"role": "user", "content": ["hi", part]}]}).encode()
            post = urllib.request.Request(proxy.url + "/v1/chat/completions", data=body)
            try:
                with urllib.request.urlopen(post, timeout=30) as response:
                    answers.append((response.status, json.load(response)))
            except urllib.error.HTTPError as error:
                answers.append((error.code, json.load(error)))
    (status, refusal), (ok, answer) = answers
    assert (status, refusal["error"]["param"], ok, answer["object"]) == (
        400,
        "messages[0].content[1]",
        200,
        "chat.completion",
    )
    assert "spec.proxy.media.allowedDomains (cdn.example.com, images.example.com)" in refusal["error"]["message"]
    assert len(encoder.records) == len(upstream.records) == 1  # only the allowed part was primed and sent on
