"""Progress over days (``optimizer.campaign.history``): what ``tapestry status`` reports of a
campaign's course, from committed counters only."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from optimizer.campaign.history import eta_seconds, fmt_duration, plot_progress, progress_lines, progress_report


def _row(status: str = "finished", **counters) -> dict:
    c = {"evaluations": 12_000, "wall_seconds": 600.0, "hv_improved_wall": 450.0,
         "hv_history": [[100, 1.0, 5.0, 2e-3], [4000, 2.0, 200.0, 1.5e-3], [9000, 2.5, 450.0, 1.2e-3]],
         "workers": {"tcp://a:1": {"evaluations": 9000, "seconds": 500.0},
                     "tcp://b:2": {"evaluations": 3000, "seconds": 300.0}}, **counters}
    return {"status": status, "counters": c, "updated_at": datetime(2026, 1, 1, tzinfo=UTC),
            "config": {"config": {"budget": {"evaluations": 60_000, "wall_time": None}}}}


def test_eta_takes_the_sooner_of_the_time_and_evaluation_budgets() -> None:
    c = {"evaluations": 1000, "wall_seconds": 100.0}
    assert eta_seconds(c, {"wall_time": 3600.0}) == pytest.approx(3500.0)
    assert eta_seconds(c, {"evaluations": 5000}) == pytest.approx(400.0)  # 10/s, 4000 to go
    assert eta_seconds(c, {"evaluations": 5000, "wall_time": 300.0}) == pytest.approx(200.0)
    assert eta_seconds(c, {"stall_evaluations": 100}) is None  # no bound on time
    assert eta_seconds({"evaluations": 0, "wall_seconds": 0.0}, {"evaluations": 10}) is None  # no rate yet
    assert eta_seconds({"evaluations": 9000, "wall_seconds": 100.0}, {"evaluations": 5000}) == 0.0  # spent


def test_report_rates_per_worker_since_improvement_and_eta() -> None:
    r = progress_report(_row(), {"bytes": 3_000_000, "rows": {"candidates": 10}})
    assert r["evals_per_s"] == pytest.approx(20.0)
    assert r["workers"]["tcp://a:1"]["evals_per_s"] == pytest.approx(15.0)
    assert r["workers"]["tcp://b:2"]["evals_per_busy_s"] == pytest.approx(10.0)
    assert r["seconds_since_improvement"] == pytest.approx(150.0)
    assert r["eta_seconds"] == pytest.approx(2400.0)  # 48,000 evaluations to go at 20/s
    assert [p["best_makespan"] for p in r["history"]] == [2e-3, 1.5e-3, 1.2e-3]
    assert r["driver_restarts"] == 0 and r["worker_restarts"] == 0
    # a running campaign's counters lag the driver: the time since its last commit counts too
    live = progress_report(_row("running"), None, now=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=30))
    assert live["seconds_since_improvement"] == pytest.approx(180.0)


def test_report_uses_the_budget_the_driver_runs_with() -> None:
    """A resume with ``--evaluations`` changes the budget in the counters, not the stored config."""
    r = progress_report(_row(budget={"evaluations": 24_000, "wall_time": None}), None)
    assert r["eta_seconds"] == pytest.approx(600.0)


def test_lines_say_throughput_eta_archive_restarts_and_history() -> None:
    r = progress_report(_row(driver_restarts=2, worker_restarts=5),
                        {"bytes": 3 * 2**20, "rows": {"candidates": 10, "candidates_full": 4, "evaluations": 12}})
    text = "\n".join(progress_lines(r))
    assert "throughput: 20 evaluations/s (tcp://a:1 15/s, tcp://b:2 5/s)" in text
    assert "last improvement: 2m 30s ago; ETA: 40m 00s" in text
    assert "restarted on their lifetimes: the driver 2 times, workers 5 times" in text
    assert "10 candidates (4 full plans" in text and "12 evaluation rows" in text
    assert "hypervolume and best makespan over time: 5s: 1, 2 ms; 3m 20s: 2, 1.5 ms" in text
    assert "restarted" not in "\n".join(progress_lines(progress_report(_row(), None)))


def test_durations_read_as_days_hours_minutes() -> None:
    assert fmt_duration(93_784) == "1d 2h 03m"
    assert fmt_duration(3_900) == "1h 05m"
    assert fmt_duration(61) == "1m 01s"
    assert fmt_duration(7) == "7s"
    assert fmt_duration(None) == "-" and fmt_duration(float("inf")) == "-"


def test_progress_plot(tmp_path) -> None:
    r = progress_report(_row(), None)
    assert plot_progress(r, tmp_path / "p.png", "c") and (tmp_path / "p.png").stat().st_size > 2000
    empty = progress_report(_row(hv_history=[]), None)
    assert not plot_progress(empty, tmp_path / "q.png", "c") and not (tmp_path / "q.png").exists()
