"""`make bench-proxy` at toy size: the tool runs the real proxy in front of the real vllm-router,
and the byte relay, with the stand-in engine and then the real vLLM engine, and reports every
key. Not timed: the numbers at this size mean nothing."""

from __future__ import annotations

import pytest

from epd_dev.bench import bench_proxy

pytestmark = pytest.mark.vllm  # vllm-router and the serving venv, from `make vllm-envs`


def test_the_proxy_benchmark_reports_every_key(capsys):
    keys = bench_proxy.main(["--levels", "1,4", "--seconds", "0.3", "--repeats", "1", "--rate", "200"])
    out = capsys.readouterr().out
    expected = {
        f"{stat}_{n}"
        for n in (1, 4)
        for stat in (
            *("added_p50_ms", "added_p99_ms", "throughput_ratio", "first_byte_ratio"),
            *("relay_added_p50_ms", "relay_added_p99_ms", "relay_throughput_ratio", "throughput_ratio_over_relay"),
            *("router_added_p50_ms", "router_added_p99_ms", "proxy_cpu_us_per_request"),
            *("throughput_ratio_min", "throughput_ratio_max"),
        )
    }
    expected |= {"saturated_throughput_ratio", "saturated_relay_throughput_ratio", "proxy_cpu_us_per_request"}
    expected |= {"saturated_engine_rps", "saturated_router_rps", "saturated_proxy_rps"}
    expected |= {"proxy_rss_mb", "proxy_peak_rss_mb"}
    expected |= {"real_engine_p50_ms_1", "real_router_p50_ms_1", "real_throughput_ratio_1"}
    expected |= {"real_added_p50_ms_1", "real_added_p99_ms_1", "real_relay_added_p50_ms_1"}
    expected |= {"real_relay_throughput_ratio_1", "real_proxy_cpu_us_per_request_1"}
    expected |= {"real_throughput_ratio_min_1", "real_throughput_ratio_max_1"}
    assert expected <= keys.keys()
    assert all(keys[k] > 0 for k in expected if "added" not in k)
    lines = out.splitlines()
    assert [line.split("=", 1)[0] for line in lines[-len(keys) :]] == list(keys)  # key=value lines come last
    assert any(line.startswith("targets: added_p50_ms_1 ") and "real_throughput_ratio_1" in line for line in lines)
    # One round: its ratio is the lowest, the highest and the median.
    assert keys["throughput_ratio_min_4"] == keys["throughput_ratio_4"] == keys["throughput_ratio_max_4"]
