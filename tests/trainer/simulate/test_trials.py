"""Trials and per-layout evidence in the loop, on the world (64 MI250X GCDs, Llama-3.1-8B shapes)."""

import json

from nereus.trainer.simulate.run import simulate


def _decisions(run_dir):
    lines = [json.loads(x) for x in (run_dir / "adaptive" / "transitions.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "decision"]


def test_a_trial_is_judged_on_its_first_measured_step_and_a_move_back_returns_to_the_plan_it_left(small, tmp_path):
    """Every admitted trial (``admission.trial``) at step s is followed by the decision of
    step s + ``TRIAL_STEPS`` with the ``trial`` trigger (or a move before it); where that
    decision moves back, it moves to exactly the plan the trial left. With
    ``controller.explore: 0`` (the default) there is no trial."""
    import dataclasses

    from nereus.trainer.controller.online import TRIAL_STEPS

    cluster, job, trace = small
    on = dataclasses.replace(job, controller={**(job.controller or {}), "explore": 0.005})
    simulate(cluster, on, trace, policies=("adaptive",), run_dir=str(tmp_path / "on"))
    decisions = _decisions(tmp_path / "on")
    trials = [d for d in decisions if d["admitted"] and d["reason"].startswith("trial: ")]
    assert trials, "no trial on this trace: the test shows nothing"
    by_step = {d["step"]: d for d in decisions}
    for t in trials:
        if t["step"] + TRIAL_STEPS >= len(trace) or any(by_step.get(t["step"] + k, {}).get("admitted") for k in range(1, TRIAL_STEPS)):
            continue  # no step left to judge it, or an urgent move came first
        judged = by_step.get(t["step"] + TRIAL_STEPS)
        assert judged is not None and "trial" in judged["trigger"].split(","), t
        if judged["admitted"] and judged["reason"].startswith("trial ended"):
            assert judged["new_plan"] == t["old_plan"]
    simulate(cluster, job, trace, policies=("adaptive",), run_dir=str(tmp_path / "off"))
    assert not any("trial" in d["trigger"] or d["reason"].startswith("trial") for d in _decisions(tmp_path / "off"))


def test_a_layout_run_for_a_few_steps_is_predicted_at_what_it_measured(small, tmp_path):
    """The step's prediction (made before it) of a plan that has run unchanged for 3 steps
    errs by less than 5% on average, where the model's first prediction of the job erred by
    more: the calibration and the layouts' corrections (``evidence.LayoutEvidence``) together
    (``test_evidence`` checks the correction alone)."""
    cluster, job, trace = small
    simulate(cluster, job, trace, policies=("adaptive",), run_dir=str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "adaptive" / "predictions.jsonl").read_text().splitlines()]
    moved = {d["step"] for d in _decisions(tmp_path) if d["admitted"]}
    settled = [x["error"] for x in lines if x["step"] > 3 and not any(x["step"] - k in moved for k in range(1, 4))]
    assert len(settled) >= 5
    assert sum(settled) / len(settled) < 0.05 < lines[0]["error"]
