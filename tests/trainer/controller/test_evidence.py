"""What the controller learns from the layouts it runs, and when it tries one it has not run (pure)."""

import numpy as np
import pytest
from nereus.trainer.config import StageConfig
from nereus.trainer.controller.admission import trial
from nereus.trainer.controller.classes import fit_memory
from nereus.trainer.controller.evidence import LAYOUT_STEPS, MIN_BAND, NORMAL, UNSEEN_PRIOR, LayoutEvidence, layout_key, spread

A = layout_key(StageConfig(dp=4), 4)
B = layout_key(StageConfig(dp=2, tp=2, micro_batch_size=8), 4)


def test_a_layout_is_priced_at_what_its_steps_measured_and_its_band_shrinks_as_they_agree():
    """The correction is the median of measured ÷ predicted over the layout's last steps (one
    outlier does not move it); its band is the robust spread (1.4826 × the median magnitude) of
    its out-of-sample errors, with every run layout's spread (``seen``) as one pseudo-sample, so
    one straggler's step barely moves it; the first step of a layout is the model's error on a
    layout it had not run (the unseen band, with two pseudo-samples of the prior)."""
    from nereus.trainer.controller.profiles import OP_CLASSES

    coef = np.zeros(len(OP_CLASSES))
    coef[:2] = [1.0, 2.0]
    ev = LayoutEvidence()
    assert ev.unseen == pytest.approx(UNSEEN_PRIOR) and ev.band("actor.train", A) == ev.unseen
    assert not ev.measured("actor.train", A) and ev.seen == MIN_BAND
    f = np.zeros(len(OP_CLASSES))
    f[:2] = [1.0, 0.5]  # predicted 2 s by coef
    measured = [3.0, 3.0, 30.0, 3.0, 3.3]  # 1.5× the model, one outlier, one step 10% slow
    predicted = [2.0, 3.0, 3.0, 3.0, 3.0]  # as the controller priced each step: the first without a correction
    for m, p in zip(measured, predicted):
        ev.observe("actor.train", A, f, m, p)
    assert ev.measured("actor.train", A) and ev.corrections(coef) == {"actor.train": {A: 1.5}}
    first = (2.0 - 3.0) / 3.0
    assert ev.unseen == pytest.approx(spread([UNSEEN_PRIOR / NORMAL, UNSEEN_PRIOR / NORMAL, first])) == pytest.approx(UNSEEN_PRIOR)
    errors = [0.0, (3.0 - 30.0) / 30.0, 0.0, (3.0 - 3.3) / 3.3]
    assert ev.seen == pytest.approx(max(MIN_BAND, 1.4826 * float(np.median(np.abs(errors)))))
    assert ev.band("actor.train", A) == pytest.approx(max(MIN_BAND, spread([ev.seen / NORMAL, *errors])))
    assert ev.band("actor.train", A) < 0.1  # the outlier (−90%) is one of five
    ev.observe("actor.train", B, f, 2.0, 2.0)  # one step of another layout: its band is what the others' steps erred by
    assert ev.band("actor.train", B) == pytest.approx(ev.seen)
    for _ in range(3 * LAYOUT_STEPS):  # steps that agree with the correction: the band falls to its floor
        ev.observe("actor.train", A, f, 3.0, 3.0)
    assert ev.band("actor.train", A) == MIN_BAND
    assert ev.band("critic.train", A) == ev.unseen  # a layout not run: the model's error on layouts not run
    again = LayoutEvidence()
    again.load_state_dict(ev.state_dict())
    assert again.corrections(coef) == ev.corrections(coef) and again.band("actor.train", A) == ev.band("actor.train", A)
    assert again.unseen == ev.unseen
    state = ev.state_dict()
    state["samples"][0][2][0][0] = [1.0, 0.5]  # a state whose features another version priced
    with pytest.raises(ValueError, match="per-layout features of \\[2, 13\\] classes"):
        LayoutEvidence().load_state_dict(state)


def test_a_layout_is_its_config_without_what_a_running_stage_retunes_on_explicit_ranks():
    assert layout_key(StageConfig(dp=4, micro_batch_size=8, recompute="full"), 4) == layout_key(StageConfig(dp=4, ranks=(0, 1, 2, 3)), 4)
    assert layout_key(StageConfig(dp=2), 4) != layout_key(StageConfig(dp=2, ranks=(2, 3)), 4)


def test_a_trial_is_taken_when_its_risk_is_small_against_what_it_may_win_and_exploration_can_pay():
    base = dict(old_seconds=100.0, optimistic_seconds=80.0, new_seconds=95.0, there_seconds=5.0, back_seconds=5.0, horizon=20,
                steps_left=100, gamma=0.5, allowance=50.0)
    ok, reason = trial(**base)
    assert ok and reason.startswith("trial: ") and "risk 10 s" in reason  # 5 + 5 + max(0, 95 − 100)
    assert trial(**{**base, "new_seconds": 120.0})[0]  # a slower prediction: its step's loss joins the risk (30 s <= 200 s)
    assert not trial(**{**base, "optimistic_seconds": 100.0})[0]  # nothing to hope for
    assert not trial(**{**base, "steps_left": 1})[0]  # no step left to use it
    refused = trial(**{**base, "allowance": 9.0})
    assert not refused[0] and "exploration may still spend" in refused[1]
    refused = trial(**{**base, "there_seconds": 250.0, "allowance": 1000.0})
    assert not refused[0] and "γ·h" in refused[1]  # 255 s > 0.5 · 20 · 20 s
    assert not trial(**{**base, "optimistic_seconds": float("nan")})[0]


def test_a_class_is_priced_at_its_measured_excess_in_bytes_or_as_a_share_and_an_unseen_one_at_the_largest():
    """(class, resident, transient, measured): a exceeds the model by 20% (20 of 100), b by 5%
    (10 of 200); "" (no training layout) by 50%. A class is priced at max(its bytes, its share ×
    what the model counts): a at twice the transients, 40 of 200 — the slack grew with them. A
    class not run takes the largest bytes or the largest share of a training class (20%); the
    share of a generation-only rank does not count. An excess larger than the model's figure is
    a process's own memory, not a slack: bytes alone. Before any step, nothing measured: the
    model, priced with the Nereus paper's 10% on its transients (the resident tensors are exact).
    A noisy measurement (a CPU's) prices a measured excess with its noise on top."""
    from nereus.trainer.controller.classes import MemoryFit
    from nereus.trainer.controller.memory import HEADROOM

    fit = fit_memory([("a", 80, 20, 120), ("b", 100, 100, 210), ("a", 80, 20, 110), ("", 10, 0, 15)], unseen=0.25)
    assert fit.offsets == {"a": 20.0, "b": 10.0, "": 5.0} and fit.relative == {"a": 0.2, "b": 0.05, "": 0.5}
    assert fit.unseen == pytest.approx(0.2) and fit.terms("c") == (20.0, pytest.approx(0.2))
    assert fit.peak(80, 120, "a") == pytest.approx(200 + 40) and fit.peak(80, 0, "a") == pytest.approx(80 + 20)
    assert fit.peak(100, 100, "c") == pytest.approx(240.0) and fit.peak(10, 10, "c") == pytest.approx(20 + 20)
    assert fit.priced(80, 120, "a") == pytest.approx(240 + (HEADROOM - 1) * 120)  # the excess measured: headroom on the transients
    noisy = fit_memory([("a", 80, 20, 120), ("a", 80, 20, 110)], unseen=0.25, noise=0.1)  # a CPU's resident high-water marks
    assert noisy.peak(80, 120, "a") == pytest.approx(240) and noisy.priced(80, 120, "a") == pytest.approx(200 + 40 * 1.1 + 12)
    assert noisy.priced(80, 20, "b") >= noisy.priced(80, 20, "a")  # a class not run is never priced below the one it borrows from
    process = fit_memory([("a", 1, 1, 12)], unseen=0.25)  # 10 over a model of 2: no slack of it
    assert process.relative == {"a": 0.0} and process.peak(1, 100, "a") == pytest.approx(111.0)
    assert process.unseen == pytest.approx(0.25 * 2 / 3)  # one training class measured: the prior, shrunk
    nothing = MemoryFit()
    assert nothing.peak(80, 20) == 100 and nothing.priced(80, 20) == pytest.approx(100 + (HEADROOM - 1) * 20)


def test_the_search_prices_a_layout_the_job_ran_at_its_correction_and_the_others_as_the_model_says():
    import dataclasses

    from nereus.trainer.config.names import ACTOR_TRAIN
    from nereus.trainer.controller.profiles import load_profile
    from nereus.trainer.controller.search import candidate_seconds, stage_candidates
    from nereus.trainer.controller.steptime import Placement, StepTimeModel
    from nereus.trainer.controller.workload import Workload
    from nereus.trainer.prepare import load_config

    cfg = load_config("configs/tiny_grpo.yaml")
    cpu = load_profile("cpu")
    where, work = Placement(nproc=cfg.nproc, profile=cpu), Workload.from_config(cfg)
    c = stage_candidates(cfg, ACTOR_TRAIN, tuple(range(cfg.nproc)), work)
    model = StepTimeModel.for_profile(cpu)
    plain = candidate_seconds(cfg, ACTOR_TRAIN, c, work, where, model)
    ran = layout_key(c.config(0), cfg.nproc)
    corrected = candidate_seconds(cfg, ACTOR_TRAIN, c, work, where, dataclasses.replace(model, corrections={ACTOR_TRAIN: {ran: 1.5}}))
    same = np.array([layout_key(c.config(i), cfg.nproc) == ran for i in range(len(plain))])
    assert same.any() and not same.all()
    assert np.allclose(corrected[same], 1.5 * plain[same], rtol=1e-12) and np.array_equal(corrected[~same], plain[~same])
