"""The length forecast (``Workload.observed``): a robust trend that a one-step jump barely moves."""

import random

import pytest
from nereus.trainer.controller.workload import TREND_WINDOW, Workload, trend
from nereus.trainer.prepare import load_config

CFG = load_config("configs/tiny_grpo.yaml", ["rollout.max_new_tokens=4000", "model.max_seq_len=4200"])


def _ramp(n: int, *, noise: float, seed: int = 0) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    return [(round(1000 + 20 * i + rng.gauss(0, noise)), 500 + 10 * i + rng.gauss(0, noise / 2)) for i in range(n)]


def test_the_trend_is_the_theil_sen_slope_checked_by_hand():
    assert trend([]) == trend([5.0]) == 0.0
    assert trend([0.0, 10.0, 20.0, 30.0]) == 10.0
    assert trend([0.0, 10.0, 20.0, 30.0, 1000.0]) == 10.0  # 6 of the 10 slopes are 10, the 4 through the jump larger
    assert trend([30.0, 20.0, 10.0]) == 0.0  # shrinking lengths forecast no growth, never a fall
    assert trend([0.0, 1.0, 5.0]) == 2.5  # slopes 1, 2.5, 4


@pytest.mark.parametrize("seed", range(5))
def test_a_one_step_jump_moves_the_forecast_by_the_jump_and_little_more(seed):
    """Stated bound: a jump J of the last longest response moves the 8-step forecast by less
    than 1.05·J (the last step is the forecast's floor, so J itself always passes). The endpoint
    slope over 5 steps moved it by J·(1 + 8/5) = 2.6·J."""
    steps = _ramp(TREND_WINDOW, noise=30.0, seed=seed)
    jump = 500
    jumped = steps[:-1] + [(steps[-1][0] + jump, steps[-1][1])]
    before = Workload.observed(CFG, steps, ahead=8).response_max
    after = Workload.observed(CFG, jumped, ahead=8).response_max
    assert jump <= after - before < 1.05 * jump


def test_a_clean_ramp_is_extrapolated_exactly_and_capped_by_max_new_tokens():
    steps = [(1000 + 20 * i, 500.0 + 10 * i) for i in range(12)]
    work = Workload.observed(CFG, steps, ahead=8)
    assert (work.response_max, work.response_mean) == (1220 + 160, 610.0 + 80)
    assert Workload.observed(CFG, steps, ahead=1000).response_max == 4000  # rollout.max_new_tokens
    assert Workload.observed(CFG, [(3990, 3000.0), (4000, 3500.0)], ahead=8).response_mean == 4000.0


def test_only_the_last_window_of_steps_sets_the_trend():
    """A ramp that stopped growing more than ``TREND_WINDOW`` steps ago forecasts no growth."""
    old = [(100 + 50 * i, 50.0 + 25 * i) for i in range(40)]
    flat = [(old[-1][0], old[-1][1])] * TREND_WINDOW
    assert Workload.observed(CFG, old + flat, ahead=8).response_max == old[-1][0]
