"""`make bench` and `make chaos` at toy size on the session's cluster: the tools work, the
report carries every key, and a few kill -9s leave no orphan or duplicate. Not timed: the
numbers at this size mean nothing."""

from __future__ import annotations

import pytest

from epd_dev.bench import chaos
from epd_dev.bench.bench_operator import benchmark, report
from epd_dev.bench.kit import Api

pytestmark = pytest.mark.cluster

KEYS = {
    "reconcile_p50_ms",
    "kcm_p50_ms",
    "reconcile_p50_ratio",
    "reconcile_p99_ratio",
    "scale_5_seconds",
    "scale_3_seconds",
    "operator_peak_rss_mb",
    "operator_peak_rss_mb_5",
    "idle_cpu_percent",
    "reconciles_per_epd",
    "reconciles_per_epd_to_idle",
    "rss_mb_slope_kb_per_epd",
    "floor_5_seconds",
    "scale_5_over_floor",
    "restart_5_seconds",
    "restart_5_writes",
    "big_3_ready_seconds",
    "big_3_ready_ratio_floor",
    "big_3_ready_ratio_children_floor",
    "big_3_status_bytes",
    "big_3_scale_3_to_1_ratio_floor",
    "big_status_patches_per_unit",
    "big_status_bytes_per_unit",
    "client_discover_3_ms",
    "neighbour_3_pods_operator_cpu_seconds",
}
ZERO_OR_MORE = {
    "idle_cpu_percent",
    "rss_mb_slope_kb_per_epd",
    "restart_5_writes",
    "neighbour_3_pods_operator_cpu_seconds",
}


@pytest.fixture
def api(cluster):
    api = Api(cluster)
    yield api
    api.close()


def test_benchmark_reports_every_key(cluster, api, bench_operator, capsys):
    results = benchmark(
        cluster,
        api,
        bench_operator,
        sizes=[5],
        scales=[3, 5],
        idle_seconds=2,
        floor=True,
        restart=True,
        big=[3],
        big_scale_to=1,
    )
    report(results)
    lines = capsys.readouterr().out.splitlines()
    values = dict(line.split("=", 1) for line in lines if "=" in line and " " not in line)
    assert KEYS <= values.keys(), lines[-20:]
    assert all(float(values[key]) > 0 for key in KEYS - ZERO_OR_MORE), values
    # A restarted operator beside converged objects rewrites none of them.
    assert float(values["restart_5_writes"]) == 0 and float(values["restart_3_writes"]) == 0
    # The API server's own metrics: measured for our creates, and printed (its busiest 12 rows;
    # which rows those are at this toy size depends on the machine's leases and events).
    assert all(("POST", "statefulsets") in s.api_requests for s in results.scales)
    assert any(line.startswith("  | verb | resource | requests | mean ms | total s |") for line in lines), lines
    assert list(values) == [line.split("=", 1)[0] for line in lines[-len(values) :]]  # the last lines
    ((epd, deploy),) = results.latencies
    assert epd.stages_ms.keys() == {"plan", "children", "status"} and all(ms > 0 for ms in epd.stages_ms.values())
    # Each latency run's own window of API requests: our creates on one side, kcm's ReplicaSets on the other.
    assert ("POST", "statefulsets") in epd.api_requests and ("POST", "replicasets") in deploy.api_requests
    assert any(line.startswith("  API server, 5 EPDDeployments, until all converged") for line in lines), lines
    assert any(line.startswith("  API server, 5 Deployments, until every pod exists") for line in lines), lines


def test_chaos_leaves_no_orphans_or_duplicates(cluster, api, bench_operator, namespace):
    # 4 nodes of 8 GPUs, 2 per unit, shared with other tests' leftovers: at most 6 units at once.
    result = chaos.run(
        cluster, api, bench_operator, namespace, objects=20, kills=3, seed=20261129, max_units=6, settle_timeout=40
    )
    assert result.kills == 3
    assert result.verdict.clean, "\n".join(result.lines())
