"""tools/bench_controller.py's pure parts: the calibration job's schedule of layouts, and the
CPU oracle over fixed plans from an interleaved job (fits, the burst a robust fit drops)."""

import dataclasses
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

import bench_controller as bench  # noqa: E402


def test_the_calibration_job_alternates_seen_and_held_out_layouts_and_counts_no_step_after_a_move():
    moves, names = bench.interleaved_schedule(warmup=2, segment=3, rounds=2)
    layouts = bench.CALIBRATE + bench.PREDICT
    assert len(names) == 2 + 2 * 3 * len(layouts) and names[0] == bench.CALIBRATE[0]
    first_round = names[2::3][:len(layouts)]
    assert [n in bench.CALIBRATE for n in first_round] == [True, False] * 3  # seen, held-out, seen...
    assert names[2::3][len(layouts):] == first_round[::-1]  # the second round reversed
    assert sorted(moves) == [s for s in range(1, len(names)) if names[s] != names[s - 1]]  # a move where the layout changes
    counted = bench.measured_steps(names, warmup=2)
    assert not any(counted[:2]) and not any(counted[s] for s in moves)  # a move after step s: step s + 1 (index s) runs it
    assert all(counted[i] for i in range(2, len(names)) if i not in moves)
    for name in layouts:  # every layout has steps counted in both rounds
        assert sum(c for n, c in zip(names, counted) if n == name) >= 4


def test_the_oracle_job_runs_every_plan_once_a_pass_at_a_different_place_each_pass_then_at_the_longest():
    order = bench.cycle_order(12, 6)
    assert len(order) == 72
    for c in range(6):
        assert sorted(order[12 * c:12 * (c + 1)]) == list(range(12))
    places = {p: {order[12 * c:12 * (c + 1)].index(p) for c in range(6)} for p in range(12)}
    assert all(len(v) == 6 for v in places.values())
    job = bench.oracle_order(12)  # and a last pass at the longest answers, where the wall is
    passes = 12 * bench.ORACLE_CYCLES
    assert job[:passes] == bench.cycle_order(12, bench.ORACLE_CYCLES) and sorted(job[passes:]) == list(range(12))


def test_a_robust_fit_drops_a_burst_and_keeps_the_curve():
    xs = [float(x) for x in range(10, 170, 20)]
    ys = [1.0 + 0.01 * x for x in xs]
    ys[3] *= 2.5  # another job's burst
    coef = bench.robust_fit(xs, ys)
    assert all(abs(sum(c * x ** (len(coef) - 1 - i) for i, c in enumerate(coef)) - (1.0 + 0.01 * x)) < 1e-6 for x in xs)


def test_peaks_are_interpolated_and_extended_by_the_end_slope():
    points = [(10.0, 100.0), (50.0, 140.0), (90.0, 150.0)]
    assert bench.peak_at(points, 30.0) == pytest.approx(120.0)
    assert bench.peak_at(points, 130.0) == pytest.approx(160.0)
    assert bench.peak_at(points, 0.0) == pytest.approx(90.0)


def _plan(seconds, peak, lengths=(4.0, 40.0, 80.0, 120.0, 160.0)):
    return [(L, seconds(L), peak(L)) for L in lengths]


def test_the_oracle_switches_where_the_fast_plan_stops_fitting_and_the_best_fixed_plan_fits_every_step():
    points = {
        "fast": _plan(lambda L: 1.0 + 0.01 * L, lambda L: 50.0 + L),  # over a budget of 150 past length 100
        "lean": _plan(lambda L: 2.0 + 0.01 * L, lambda L: 50.0 + 0.2 * L),  # always fits, 1 s slower a step
        "huge": _plan(lambda L: 0.5, lambda L: 500.0),  # never fits
    }
    common = [(L, 0.5) for L in (4.0, 40.0, 80.0, 120.0, 160.0)]
    lengths = [float(L) for L in range(10, 170, 10)]  # 16 steps, 9 of them within the fast plan's memory
    got = bench.oracle_over_fixed(points, common, lengths, budget=150.0)
    assert [s["plan"] for s in got["steps"]] == ["fast"] * 10 + ["lean"] * 6
    assert got["best_fixed"] == "lean" and set(got["fixed_s"]) == {"lean"}
    assert got["steps"][0]["fixed_seconds"] == pytest.approx(2.5 + 0.01 * 10) and got["steps"][0]["seconds"] == pytest.approx(1.5 + 0.1)
    lean = sum(2.5 + 0.01 * L for L in lengths)
    oracle = sum((1.5 if L <= 100 else 2.5) + 0.01 * L for L in lengths)
    assert got["oracle_over_best_fixed"] == pytest.approx(lean / oracle)
    none = bench.oracle_over_fixed(points, common, lengths, budget=40.0)
    assert none["best_fixed"] is None and none["oracle_over_best_fixed"] is None and math.isnan(none["steps"][0]["seconds"])


def test_the_plan_the_controller_ended_in_is_pinned_whole_as_overrides():
    from nereus.trainer.prepare import load_config

    cfg = load_config(bench.TINY_WALL)
    moved = {"actor": {"train": {**dataclasses.asdict(cfg.plan.actor.train), "dp": 2, "ranks": [0, 1], "micro_batch_tokens": 165},
                       "gen": {**dataclasses.asdict(cfg.plan.actor.gen), "dp": 2, "ranks": [2, 3], "dp_shard": True}}}
    pinned = load_config(bench.TINY_WALL, bench.plan_sets(moved)).plan
    assert dataclasses.asdict(pinned.actor.train) == {**moved["actor"]["train"], "ranks": (0, 1)}
    assert dataclasses.asdict(pinned.actor.gen) == {**moved["actor"]["gen"], "ranks": (2, 3)}
    assert pinned.ref == cfg.plan.ref  # what the move left alone stays as the config has it
