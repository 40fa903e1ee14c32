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


def test_the_forecast_keeps_the_last_steps_length_shape():
    """With the rows' mean square measured, the forecast prices the coming step at the last
    step's shape E[ℓ²] ÷ (mean · longest); without it, at its bound mean · longest."""
    steps = [(1000 + 20 * i, 500.0 + 10 * i, 0.6 * (500.0 + 10 * i) * (1000 + 20 * i)) for i in range(12)]
    work = Workload.observed(CFG, steps, ahead=8)
    assert (work.response_max, work.response_mean) == (1380, 690.0)
    assert work.sq_mean == pytest.approx(0.6 * 690.0 * 1380) and work.sq_shape == pytest.approx(0.6)
    bare = Workload.observed(CFG, [s[:2] for s in steps], ahead=8)
    assert bare.response_sq_mean is None and bare.sq_mean == 690.0 * 1380 and bare.sq_shape == 1.0


def test_generation_prices_each_row_for_its_own_length():
    """Stopped rows leave the decoding batch (rollout/generator.py): a batch's decode FLOPs and
    TP traffic are the mean, over its rows, of uniform batches each as long as one row (each
    row costs what it would alone), while the per-step dispatch runs as many steps as the
    longest row; a uniform batch prices as before the lengths had a shape."""
    from nereus.trainer.config.names import ACTOR_GEN
    from nereus.trainer.controller.candidates import kept_of
    from nereus.trainer.controller.profiles import load_profile
    from nereus.trainer.controller.steptime import Placement, candidate_features

    cfg = load_config("configs/tiny_grpo.yaml", ["rollout.max_new_tokens=64", "model.max_seq_len=80"])
    where = Placement(nproc=cfg.nproc, profile=load_profile("cpu"))
    c = kept_of((cfg.plan.actor.gen,))
    base = Workload.from_config(cfg)

    def price(lengths):
        mean, sq = sum(lengths) / len(lengths), sum(x * x for x in lengths) / len(lengths)
        return candidate_features(cfg, ACTOR_GEN, c, base.at(max(lengths), mean, sq), where)

    lengths = [3, 7, 7, 20, 64]
    mixed = price(lengths)
    alone = [price([x] * len(lengths)) for x in lengths]
    for part in ("gemm", "comm_tp"):
        assert mixed[part][0] == pytest.approx(sum(a[part][0] for a in alone) / len(lengths), rel=1e-12)
    assert mixed["decode"][0] == alone[-1]["decode"][0] > alone[0]["decode"][0]
    assert mixed["gemm"][0] < alone[-1]["gemm"][0]  # the static batch's price: every row to the longest
    uniform = candidate_features(cfg, ACTOR_GEN, c, base.at(64, 64.0), where)
    assert all(uniform[k][0] == pytest.approx(alone[-1][k][0], rel=1e-12) for k in uniform)
