"""The reference probes' load factors (trainer/metrics/probes.py), as a pure function."""

import math

import pytest

from nereus.trainer.metrics.probes import PROBES, load_factors


def _step(gemm, eager, allreduce, ranks=2):
    return {"gemm": [gemm] * ranks, "eager": [eager] * ranks, "allreduce": [allreduce] * ranks}


def test_a_step_twice_as_slow_in_every_probe_gets_twice_the_typical_factor():
    steps = [_step(1.0, 2.0, 3.0), _step(1.0, 2.0, 3.0), _step(2.0, 4.0, 6.0), _step(1.0, 2.0, 3.0)]
    assert load_factors(steps) == pytest.approx([1.0, 1.0, 2.0, 1.0])


def test_the_factor_is_the_geometric_mean_over_probes_of_the_rank_mean_over_the_median():
    steps = [_step(1.0, 1.0, 1.0), _step(1.0, 1.0, 1.0), {"gemm": [1.0, 3.0], "eager": [1.0, 1.0], "allreduce": [0.5, 0.5]}]
    # gemm: rank mean 2 / median 1; eager 1; allreduce 0.5
    assert load_factors(steps)[2] == pytest.approx(math.exp((math.log(2) + math.log(0.5)) / 3))
    assert load_factors(steps, probes=("gemm",))[2] == pytest.approx(2.0)
    assert load_factors([]) == []


def test_a_window_takes_the_median_of_the_steps_around_each():
    steps = [_step(1, 1, 1), _step(3, 3, 3), _step(1, 1, 1), _step(2, 2, 2), _step(2, 2, 2)]
    assert load_factors(steps) == pytest.approx([0.5, 1.5, 0.5, 1.0, 1.0])  # typical: the median, 2
    assert load_factors(steps, window=3) == pytest.approx([1.0, 0.5, 1.0, 1.0, 1.0])  # one slow probe smoothed away


@pytest.mark.parametrize("record", [{"gemm": [1.0], "eager": [1.0]}, {**_step(1, 1, 1, ranks=1), "eager": [0.0]}])
def test_a_missing_or_zero_probe_is_one_line_naming_it(record):
    with pytest.raises(ValueError) as e:
        load_factors([_step(1, 1, 1, ranks=1), record])
    assert "step 1" in str(e.value) and any(repr(p) in str(e.value) for p in PROBES) and "NEREUS_PROBES" in str(e.value)
