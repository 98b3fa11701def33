"""`make bench`'s report from measured runs (no cluster): the keys the issue names, the spread
of repeated runs and the RSS slope per object."""

from __future__ import annotations

import pytest

from epd_dev.bench.bench_operator import KCM_DEFAULT, Results, Scale, report, stage_means_ms


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
