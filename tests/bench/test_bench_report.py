"""`make bench`'s report from measured runs (no cluster): the keys the issue names, the spread
of repeated runs and the RSS slope per object."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epd_dev.bench import bench_proxy
from epd_dev.bench.bench_operator import KCM_DEFAULT, Results, Scale, report, stage_means_ms
from epd_dev.bench.big import RUNS, Big, Step, run_order
from epd_dev.bench.observe import cpu_seconds
from epd_dev.bench.restart import Restart


def run(n: int, converged: float, peak_mb: float, rss_mb: float, reconciles: float) -> Scale:
    return Scale(
        n,
        KCM_DEFAULT,
        apply_seconds=1.0,
        reconciled_seconds=converged,
        ready_seconds=converged + 10,
        not_ready=[],
        quiet_seconds=converged + 20,
        cpu_seconds=5.0,
        peak_rss_mb=peak_mb,
        rss_mb=rss_mb,
        idle_cpu_percent=0.05,
        idle_seconds=30,
        idle_events=0,
        reconciles={"reconciles_success": reconciles * 2 * n},
        reconciles_converged={"reconciles_success": reconciles * n},
    )


@pytest.fixture
def results() -> Results:
    return Results(
        scales=[
            run(100, 2.0, 70.0, 68.0, 1.5),
            run(1000, 55.0, 126.0, 124.0, 1.2),
            run(1000, 47.0, 125.0, 123.0, 1.1),
            run(1000, 48.0, 127.0, 125.0, 1.3),
            run(5000, 550.0, 340.0, 339.0, 1.0),
        ],
        floors={1000: 40.0},
    )


def test_repeated_runs_give_the_median_and_the_spread(results):
    keys = results.keys()
    assert (keys["scale_1000_seconds_min"], keys["scale_1000_seconds"], keys["scale_1000_seconds_max"]) == (
        47,
        48,
        55,
    )  # the median, not the mean (50)
    assert "scale_5000_seconds_min" not in keys  # one run: no spread to show
    assert keys["operator_peak_rss_mb_1000"] == 127.0  # the worst run: a peak is a limit
    assert keys["operator_peak_rss_mb"] == 127.0 and keys["operator_peak_rss_mb_5000"] == 340.0
    assert keys["reconciles_per_epd"] == pytest.approx(1.2) and keys["reconciles_per_epd_to_idle"] == pytest.approx(2.4)
    assert keys["scale_1000_over_floor"] == pytest.approx(48 / 40)


def test_the_rss_slope_is_fitted_over_every_run(results):
    # Least squares over (100, 68), (1000, 124, 123, 125), (5000, 339): 55.8 KB per object.
    assert results.keys()["rss_mb_slope_kb_per_epd"] == pytest.approx(55.8, abs=0.1)
    assert Results(scales=[run(1000, 48.0, 126.0, 124.0, 1.2)]).rss_slope_kb("rss_mb") is None


def test_the_report_marks_each_target_and_ends_with_the_keys(results, capsys):
    report(results)
    lines = capsys.readouterr().out.splitlines()
    assert "MISS  1,000 EPDDeployments converged (children + status) within 15 s: 48.00" in lines
    assert "MISS  operator peak RSS <= 200 MB at 5,000 EPDDeployments: 340.00" in lines
    assert "PASS  successful reconciles per EPDDeployment until converged <= 2: 1.20" in lines
    assert lines[-1].startswith("rss_mb_slope_kb_per_epd=") or lines[-1].startswith("peak_rss_mb_slope_kb_per_epd=")


def test_stage_means_are_per_reconcile_that_ran_the_stage():
    before = {"stage_plan_sum": 1.0, "stage_plan_count": 100, "stage_children_sum": 2.0, "stage_children_count": 10}
    after = {
        "stage_plan_sum": 1.5,
        "stage_plan_count": 300,
        "stage_children_sum": 4.0,
        "stage_children_count": 20,
        "stage_status_sum": 0.3,
        "stage_status_count": 10,
    }
    # plan: 0.5 s over 200 reconciles; children: 2 s over the 10 that wrote; status: 0.3 s over 10.
    assert stage_means_ms(before, after) == pytest.approx({"plan": 2.5, "children": 200.0, "status": 30.0})
    assert stage_means_ms(after, after) == {}  # no reconcile between the two: no mean to give


def big(ready: float, floor: float, patches: float, *, discover: list[float]) -> Big:
    steps = [
        Step(0, 1000, ready, floor, 55.0, patches, status_bytes=4000, object_bytes=9000),
        Step(1000, 100, 20.0, 25.0, 16.0, 2, status_bytes=3000, object_bytes=8000),
        Step(100, 1000, 50.0, 40.0, 40.0, 30, status_bytes=4100, object_bytes=9100),
    ]
    return Big(1000, KCM_DEFAULT, steps, 30.0, 110.0, 90.0, 80.0, discover)


def test_the_big_and_restart_keys():
    results = Results(
        bigs=[
            big(66.0, 60.0, 40, discover=[12.0, 10.0]),
            big(70.0, 60.0, 50, discover=[14.0]),
            big(64.0, 64.0, 30, discover=[11.0]),
        ],
        restarts=[Restart(1000, seconds=42.0, child_writes=0, status_writes=3, events=5, reconciles=1000)],
    )
    keys = results.keys()
    assert keys["big_1000_ready_seconds"] == 66.0 and keys["big_1000_floor_seconds"] == 60.0
    assert keys["big_1000_ready_ratio_floor"] == pytest.approx(1.1)  # median of 1.1, 1.167, 1.0
    assert keys["big_1000_ready_ratio_children_floor"] == pytest.approx(66.0 / 55.0)  # the floor with its Services
    assert keys["big_1000_scale_1000_to_100_ratio_children_floor"] == pytest.approx(1.25)
    assert keys["big_status_patches_per_unit"] == pytest.approx(0.04) == keys["big_1000_status_patches_per_unit"]
    assert keys["big_status_bytes_per_unit"] == pytest.approx(4.1)  # the largest status of a run, per unit
    # Scaled down and up again: each step against the floor's same step, patches per unit moved.
    assert keys["big_1000_scale_1000_to_100_ratio_floor"] == pytest.approx(0.8)
    assert keys["big_1000_scale_100_to_1000_status_patches_per_unit"] == pytest.approx(30 / 900)
    assert keys["client_discover_1000_ms"] == 11.0  # the median of each run's median
    assert keys["big_1000_operator_peak_rss_mb"] == 110.0
    assert keys["big_1000_runs"] == 3  # and the spread of the repeats' ratios
    assert (keys["big_1000_ready_ratio_floor_min"], keys["big_1000_ready_ratio_floor_max"]) == pytest.approx(
        (1.0, 70.0 / 60.0)
    )
    # Status writes count, Events do not (anyone posts them).
    assert (keys["restart_1000_seconds"], keys["restart_1000_writes"]) == (42.0, 3)


def test_a_repeat_without_the_scale_steps_counts_in_the_creation_only():
    scaled, created_only = big(66.0, 60.0, 40, discover=[12.0]), big(80.0, 50.0, 40, discover=[12.0])
    created_only.steps = created_only.steps[:1]
    keys = Results(bigs=[created_only, scaled]).keys()
    assert keys["big_1000_ready_seconds"] == 73.0  # both runs
    assert keys["big_1000_scale_1000_to_100_seconds"] == 20.0  # the one that scaled


def test_runs_on_a_cluster_set_up_otherwise_have_keys_of_their_own():
    without_endpoints = big(90.0, 60.0, 400, discover=[99.0])
    without_endpoints.steps = without_endpoints.steps[:1]
    without_endpoints.variant = "_no_endpoints_controller"
    keys = Results(bigs=[big(66.0, 60.0, 40, discover=[12.0]), without_endpoints]).keys()
    assert keys["big_1000_no_endpoints_controller_ready_ratio_floor"] == pytest.approx(1.5)
    assert keys["big_1000_no_endpoints_controller_ready_ratio_children_floor"] == pytest.approx(90.0 / 55.0)
    # The headline keys and discover's stay the default cluster's.
    assert keys["big_1000_ready_ratio_floor"] == pytest.approx(1.1) and keys["big_1000_runs"] == 1
    assert keys["big_status_patches_per_unit"] == pytest.approx(0.04) and keys["client_discover_1000_ms"] == 12.0


def test_each_repeat_of_a_size_makes_its_three_runs_in_another_order():
    orders = [run_order(rotation) for rotation in range(4)]
    assert orders[0] == RUNS == ("floor", "children floor", "EPDDeployment")
    assert len(set(orders[:3])) == 3 and orders[3] == orders[0]
    assert {order.index("EPDDeployment") for order in orders[:3]} == {0, 1, 2}  # each run once first, once last


def test_the_big_report_has_a_row_per_step(capsys):
    report(Results(bigs=[big(66.0, 60.0, 40, discover=[12.0])]))
    lines = capsys.readouterr().out.splitlines()
    assert "| 1000 -> 100 | 20.0 | 25.0 | 0.80x | 16.0 | 1.25x | 2 | 0.002 | 3000 | 8000 |" in lines
    assert "PASS  status patches per unit during the scale-up <= 0.2: 0.04" in lines


def test_a_process_cpu_time_is_read_to_the_millisecond_with_its_ended_threads():
    """What the benchmarks divide by a run's requests: a clock tick (10 ms) is more than a short
    run uses."""
    code = (
        "import threading, time\n"
        "def burn():\n"
        "    end = time.process_time() + 0.03\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "worker = threading.Thread(target=burn)\n"
        "worker.start()\n"
        "worker.join()\n"
        "print(time.process_time(), flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        own = float(child.stdout.readline())
        assert own > 0.03
        assert cpu_seconds(child.pid) == pytest.approx(own, abs=0.002)
    finally:
        child.kill()
        child.wait()


def test_the_throughput_ratio_is_reported_with_its_spread_over_rounds_each_paired_in_its_round():
    def runs(*throughputs: float) -> list[bench_proxy.Run]:
        return [bench_proxy.Run(1.0, latencies=[0.001] * int(t)) for t in throughputs]

    # The machine slowed down in round 2: the router's and the proxy's runs of a round are paired.
    level = bench_proxy.Level(
        1,
        0.0025,
        {
            ("engine", False): runs(400, 200, 400),
            ("router", False): runs(300, 150, 300),
            ("relay", False): runs(294, 147, 291),
            ("proxy", False): runs(285, 147, 276),
        },
    )
    assert level.round_ratios("proxy", "router") == [0.95, 0.98, 0.92]
    keys = bench_proxy.compared(level)
    assert (keys["throughput_ratio_min"], keys["throughput_ratio_max"]) == (0.92, 0.98)
    assert keys["throughput_ratio"] == 276 / 300  # medians: 276 over 300
