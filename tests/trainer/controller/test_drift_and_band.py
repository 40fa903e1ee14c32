"""The drift watch around a change of plan and a failed decision, and the per-stage error band
of admission (pure, no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from nereus.trainer.prepare import load_config
from nereus.trainer.controller import online
from nereus.trainer.controller.admission import difference_spread
from nereus.trainer.controller.online import MIN_BAND, Controller
from nereus.trainer.controller.profiles import load_profile

CPU = load_profile("cpu")
SECONDS = {"actor.gen": 0.2, "actor.train": 0.6, "ref.infer": 0.1, "sync.actor.gen": 0.02}


def tiny(*overrides: str):
    return load_config("configs/tiny_grpo.yaml", ["nproc=4", *overrides])


def metrics(step: int, seconds: dict[str, float], width: int = 9, response: float = 4.0) -> dict:
    return {"step": step, "response_length": response, "lengths": {"response_max": width - 5, "width": width, "prompt": 5},
            "stages": {k: {"seconds": s, "peak_bytes": [10 << 20] * 4} for k, s in seconds.items()}}


def other_plan(cfg):
    """The running plan with actor.train's micro-batch changed: a new plan (its key differs)."""
    sc = cfg.plan.actor.train
    new = dataclasses.replace(sc, micro_batch_size=1 if sc.micro_batch_size != 1 else 2)
    return dataclasses.replace(cfg.plan, actor=dataclasses.replace(cfg.plan.actor, train=new))


def test_a_moves_own_change_of_the_shares_triggers_no_decision():
    """The plan changes after step 1: on step 2 (its first measured step) actor.train's share
    falls by half — the move did that, not the work — so nothing fires and no gap is counted;
    the same swing on the same plan later is a drift."""
    cfg = tiny()
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    assert "first" in ctl.decide(cfg, metrics(1, SECONDS)).trigger
    gaps = {k: list(v) for k, v in ctl.watch.gaps.items()}
    cfg = dataclasses.replace(cfg, plan=other_plan(cfg))  # as an admitted move leaves it
    faster = {**SECONDS, "actor.train": 0.2}  # shares: actor.train 0.65 -> 0.38, actor.gen 0.22 -> 0.38
    ctl.observe(cfg, metrics(2, faster))
    assert ctl.decide(cfg, metrics(2, faster)) is None
    assert ctl.watch.gaps == gaps
    assert ctl.watch.reference["share:actor.train"] == pytest.approx(0.2 / sum(faster.values()))
    ctl.observe(cfg, metrics(3, SECONDS))  # the same swing back, the plan unchanged: a drift of the work
    d = ctl.decide(cfg, metrics(3, SECONDS))
    assert d is not None and "drift:share:actor.train" in d.trigger.split(",")


def test_the_rebase_is_kept_across_a_resume():
    """The plan the references were measured under goes into the controller's state: a
    resumed controller on the same plan does not rebase (a drift still fires), one that
    resumed into another plan does."""
    cfg = tiny()
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    ctl.decide(cfg, metrics(1, SECONDS))
    faster = {**SECONDS, "actor.train": 0.2}
    same = Controller(cfg, CPU, first_step=1)
    same.load_state(ctl.state_dict())
    same.observe(cfg, metrics(2, faster))
    assert "drift:share:actor.train" in same.decide(cfg, metrics(2, faster)).trigger
    moved = dataclasses.replace(cfg, plan=other_plan(cfg))
    into = Controller(moved, CPU, first_step=1)
    into.load_state(ctl.state_dict())
    into.observe(moved, metrics(2, faster))
    assert into.decide(moved, metrics(2, faster)) is None


def test_a_decision_that_raises_does_not_fire_again_nor_shorten_the_horizon(monkeypatch):
    """A drift whose pricing raises (the loop logs it and keeps the plan): the references
    were reset before the pricing, so the next step with the same signals triggers nothing,
    and no one-step gap enters H."""
    cfg = tiny()
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    ctl.decide(cfg, metrics(1, SECONDS))
    for step in (2, 3):
        ctl.observe(cfg, metrics(step, SECONDS))
        assert ctl.decide(cfg, metrics(step, SECONDS)) is None

    def broken(*a, **k):
        raise RuntimeError("pricing failed")

    monkeypatch.setattr(online, "plan_seconds", broken)
    slow = {**SECONDS, "actor.gen": 0.6, "actor.train": 0.2}  # a share drifts, the step's seconds do not
    ctl.observe(cfg, metrics(4, slow))
    with pytest.raises(RuntimeError, match="pricing failed"):
        ctl.decide(cfg, metrics(4, slow))
    gaps = {k: list(v) for k, v in ctl.watch.gaps.items()}
    assert gaps["share:actor.gen"] == [3]  # first seen at step 1, drifted at step 4
    for step in (5, 6):
        ctl.observe(cfg, metrics(step, slow))
        assert ctl.decide(cfg, metrics(step, slow)) is None  # no refire
    assert ctl.watch.gaps == gaps


def test_the_band_of_a_stage_is_its_own_layouts_error_not_the_steps():
    """actor.train predicted 30% low and ref.infer + actor.gen high so that the step's total
    is nearly right: the step's band stays at its floor, actor.train's layout's band is its
    own 30% (blended by one pseudo-sample with every layout's), and a change of actor.train
    is charged it (the step's band would charge 5%). The first step of each layout is the
    model's error on a layout it had not run: the unseen band, with its prior."""
    from nereus.trainer.controller.evidence import NORMAL, UNSEEN_PRIOR, spread

    cfg = tiny("controller.calibrate=false")  # the priors' predictions, the same every step
    probe = Controller(cfg, CPU)
    predicted = {k: v["predicted_s"] for k, v in probe.observe(cfg, metrics(1, SECONDS))["pieces"].items()}
    up = 0.3 * predicted["actor.train"] + predicted["sync.actor.gen"]  # actor.train 30% above, its sync twice the prediction
    rest = predicted["actor.gen"] + predicted["ref.infer"]
    measured = {"actor.train": predicted["actor.train"] * 1.3, "sync.actor.gen": predicted["sync.actor.gen"] * 2,
                **{k: predicted[k] * (1 - up / rest) for k in ("actor.gen", "ref.infer")}}
    ctl = Controller(cfg, CPU)
    for step in range(1, 6):
        ctl.observe(cfg, metrics(step, measured))
    assert ctl.band == MIN_BAND  # the step's error: ~0
    gen_p = predicted["actor.gen"] + predicted["sync.actor.gen"]
    gen_m = measured["actor.gen"] + measured["sync.actor.gen"]
    errors = {"actor.train": -0.3 / 1.3, "ref.infer": (up / rest) / (1 - up / rest), "actor.gen": (gen_p - gen_m) / gen_m}
    unseen = spread([UNSEEN_PRIOR / NORMAL, UNSEEN_PRIOR / NORMAL, *errors.values()])  # each layout's first step
    assert ctl.evidence.unseen == pytest.approx(unseen, rel=1e-9)
    bands = ctl.stage_bands(cfg.plan, cfg.nproc)
    assert set(bands) == {"actor.gen", "actor.train", "ref.infer"}  # the weight sync is its stage's, as search sums it
    seen = spread([e for e in errors.values() for _ in range(4)])  # every run layout's errors, steps 2-5
    for key, e in errors.items():  # steps 2-5: four errors of the layout's own, one pseudo-sample of every layout's
        assert bands[key] == pytest.approx(max(0.02, spread([seen / NORMAL, e, e, e, e])), rel=1e-9), key
    assert bands["actor.train"] == pytest.approx(1.4826 * 0.3 / 1.3, rel=1e-9)  # its own error, the median of five
    old, new = {"actor.train": 10.0, "actor.gen": 5.0}, {"actor.train": 8.0, "actor.gen": 5.0}
    assert difference_spread(old, new, ctl.band, bands=bands) == pytest.approx(bands["actor.train"] * (100 + 64) ** 0.5)
    assert difference_spread(old, new, ctl.band, bands=bands) > 4 * difference_spread(old, new, ctl.band)
    # a new layout's side is charged the unseen band
    assert difference_spread(old, new, ctl.band, bands=bands, new_bands={"actor.train": unseen}) == pytest.approx(
        (bands["actor.train"] ** 2 * 100 + unseen**2 * 64) ** 0.5)
    # a stage without its own errors gets the step's band
    assert difference_spread({"x": 3.0}, {"x": 4.0}, 0.1, bands=bands) == pytest.approx(0.1 * 5.0)
    # and the per-layout evidence survives a resume
    again = Controller(cfg, CPU, first_step=5)
    again.load_state(ctl.state_dict())
    assert again.stage_bands(cfg.plan, cfg.nproc) == bands and again.evidence.unseen == ctl.evidence.unseen


def test_a_decision_charges_each_changed_stage_its_own_band(monkeypatch):
    """``decide`` hands admission the controller's per-stage bands: the running plan's layouts'
    (``difference_spread``'s ``bands``) and the new plan's (``new_bands``: the unseen band for
    a layout the job has not run), measured on this job."""
    from nereus.trainer.config import PlanConfig, build_tree

    cfg = tiny()
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    seen = []

    def spread(*args, **kwargs):
        seen.append((kwargs.get("bands"), kwargs.get("new_bands")))
        return difference_spread(*args, **kwargs)

    monkeypatch.setattr(online, "difference_spread", spread)
    d = ctl.decide(cfg, metrics(1, SECONDS))
    assert d is not None and d.new_plan is not None and d.new_plan != d.old_plan, d
    new = build_tree(PlanConfig, d.new_plan, "plan.")
    assert seen == [(ctl.stage_bands(cfg.plan, cfg.nproc), ctl.stage_bands(new, cfg.nproc))]
    assert set(seen[0][0]) == {"actor.gen", "actor.train", "ref.infer"}
    from nereus.trainer.controller.evidence import layout_key

    moved = [k for k, sc in new.stages().items() if layout_key(cfg.plan.stages()[k], cfg.nproc) != layout_key(sc, cfg.nproc)]
    assert moved and all(seen[0][1][k] == ctl.evidence.unseen and not ctl.evidence.measured(k, layout_key(new.stages()[k], cfg.nproc))
                         for k in moved)


def test_a_share_that_falls_below_the_watch_on_a_new_plan_loses_its_old_reference():
    """ref.infer is watched on the old plan (11% of the step); on the new plan's first step it
    is under 10% and not watched: the old plan's reference goes (``reset`` drops it too), and
    when it is watched again its reference is what the new plan measures."""
    cfg = tiny()
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    ctl.decide(cfg, metrics(1, SECONDS))
    assert "share:ref.infer" in ctl.watch.reference
    cfg = dataclasses.replace(cfg, plan=other_plan(cfg))
    low = {**SECONDS, "ref.infer": 0.04}
    ctl.observe(cfg, metrics(2, low))
    assert ctl.decide(cfg, metrics(2, low)) is None
    assert "share:ref.infer" not in ctl.watch.reference
    back = {**SECONDS, "ref.infer": 0.13}
    ctl.observe(cfg, metrics(3, back))
    ctl.decide(cfg, metrics(3, back))
    assert ctl.watch.reference["share:ref.infer"] == pytest.approx(0.13 / sum(back.values()))


def test_a_trial_ends_with_a_change_of_world_a_resume_on_another_or_a_judgement_that_raises():
    """A trial under way (``Controller.trial``) ends when the devices change (the plan it left
    was for the old world), when the controller resumes on another number of ranks, and when
    its judgement raises (once: the next step does not raise again)."""
    from nereus.trainer.config import config_to_dict

    cfg = tiny("controller.explore=0.005")
    ctl = Controller(cfg, CPU)
    ctl.observe(cfg, metrics(1, SECONDS))
    ctl.trial = {"origin": config_to_dict(cfg.plan), "step": 1, "nproc": cfg.nproc}
    elsewhere = Controller(tiny("controller.explore=0.005", "nproc=2", "plan=auto"), CPU)
    elsewhere.load_state(ctl.state_dict())
    assert elsewhere.trial is None
    again = Controller(cfg, CPU)
    again.load_state(ctl.state_dict())
    assert again.trial == ctl.trial
    ctl.decide(cfg, None, nproc=2)
    assert ctl.trial is None
    ctl.trial = {"origin": {"actor": {"train": {"dp": "not a number"}}}, "step": 1, "nproc": cfg.nproc}
    for step in (2, 3, 4):
        ctl.observe(cfg, metrics(step, SECONDS))
    with pytest.raises(Exception):
        ctl.decide(cfg, metrics(4, SECONDS))
    assert ctl.trial is None
    ctl.observe(cfg, metrics(5, SECONDS))
    ctl.decide(cfg, metrics(5, SECONDS))  # no trial to judge: no raise
