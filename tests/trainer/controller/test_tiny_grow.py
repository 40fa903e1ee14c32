"""configs/tiny_grow.yaml end to end: the controller moves actor.train before its plan stops
fitting the growing answers, the moved state is checked element for element, the run learns;
and a resumed run restarts in the plan it was in and repeats the uninterrupted losses."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore
from nereus.store.job import plan_config, read_job
from nereus.trainer.prepare import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_GROW = os.path.join(ROOT, "configs", "tiny_grow.yaml")
runner = CliRunner()
THRESHOLD = 0.8  # mean reward of the last 10 steps; measured 0.896 (chance ~0.06)


def train(*args: str):
    return runner.invoke(app, ["train", *args], catch_exceptions=False)


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path)]


def metrics_plan(run_dir) -> dict:
    """The plan the run ended in, as its last checkpoint holds it."""
    return CheckpointStore(str(run_dir / "checkpoints")).manifest().plan


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_controller_switches_before_the_plan_outgrows_the_budget(tmp_path):
    result = train(TINY_GROW, "--set", "controller.verify=true", "--run-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    cfg = load_config(TINY_GROW)
    rows = lines(tmp_path / "metrics.jsonl")
    events = lines(tmp_path / "transitions.jsonl")
    moves = [e for e in events if e["kind"] == "transition"]
    urgent = [e for e in events if e["kind"] == "decision" and e["admitted"] and "infeasible" in e["trigger"]]
    assert urgent and moves, "the budget never bound"
    assert not [e for e in events if e["kind"] in ("failed", "error")]
    budget = cfg.device_memory_gib * 2**30
    for move in moves:
        # a rebuilt stage's every parameter and AdamW tensor compared bit for bit; a micro-batch
        # change (what this job's growth calls for on CPU) retunes in place and moves nothing
        assert (move["verified_tensors"] > 0) == bool(move["rebuilt"]), move
        assert move["peak_bytes"] <= budget, f"a rank held {move['peak_bytes'] / 2**20:.0f} MiB while the state moved"
    first = urgent[0]["step"]
    plans = [r["plan"]["actor.train"] for r in rows]
    assert plans[first - 1] != plans[first], "the step after the decision runs the new plan"
    assert rows[first - 1]["lengths"]["width"] < rows[-1]["lengths"]["width"]  # it switched while the answers grew
    measured = max(max(r["peak_bytes"]) for row in rows for r in row["stages"].values())
    assert measured <= budget, f"a rank measured {measured / 2**20:.0f} MiB over the {budget / 2**20:.0f} MiB budget"
    assert sum(m["measured_s"] for m in moves) <= 0.05 * sum(r["step_seconds"] for r in rows)
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last >= THRESHOLD, f"reward over the last 10 steps {last:.3f}"
    predictions = lines(tmp_path / "predictions.jsonl")
    assert len(predictions) == cfg.steps and all("step_predicted_s" in p for p in predictions)
    report = runner.invoke(app, ["report", str(tmp_path)])
    assert report.exit_code == 0 and (tmp_path / "report" / "plan.png").exists(), report.output


# Reproducible decisions: the profile's priors, no drift triggers, a budget the raw memory
# model crosses at step ~5 (it retunes actor.train's micro-batches); a checkpoint at step 8,
# after the transition; a lookahead of one step. The budget is the uncalibrated model's: the
# measured peaks are not checked here.
RESUME = ["controller.calibrate=false", "controller.drift=1000", "controller.lookahead=1", "device_memory_gib=0.055", "checkpoint_every=8"]


@pytest.mark.timeout(900)
def test_resume_after_a_transition_restarts_in_the_new_plan_and_repeats_the_losses(tmp_path):
    sets = lambda *extra: [a for o in [*RESUME, *extra] for a in ("--set", o)]  # noqa: E731
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train(TINY_GROW, *sets("steps=12", "controller.verify=true"), "--run-dir", str(whole)).exit_code == 0
    shutil.copytree(whole, split)  # as a crash after step 12 was logged, before it was committed, leaves it
    assert CheckpointStore(str(split / "checkpoints")).delete(12) and CheckpointStore(str(split / "checkpoints")).steps() == [8]
    assert train(TINY_GROW, *sets("steps=12"), "--run-dir", str(split), "--resume").exit_code == 0
    a, b = lines(whole / "metrics.jsonl"), lines(split / "metrics.jsonl")
    moves = [e for e in lines(whole / "transitions.jsonl") if e["kind"] == "transition"]
    assert moves and moves[0]["step"] < 8, moves
    assert all((m["verified_tensors"] > 0) == bool(m["rebuilt"]) for m in moves), moves
    assert b[8]["plan"] == a[8]["plan"] != a[0]["plan"]  # step 9 of the resumed run: the transitioned plan
    assert [r["plan"] for r in b] == [r["plan"] for r in a]  # and it goes on deciding as the whole run did
    for log in ("transitions.jsonl", "predictions.jsonl"):  # cut back to the checkpoint, not appended twice
        assert [(e["step"], e.get("kind")) for e in lines(split / log)] == [(e["step"], e.get("kind")) for e in lines(whole / log)], log
    keys = ("step", "actor/loss", "actor/grad_norm", "reward_mean", "kl")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a]
    # the store's job record: every move with its measured cost, the same after the resume
    # (this job moves before step 8 only: the cut-back itself is tests/store/test_kv.py's)
    stores = [CheckpointStore(str(d / "checkpoints")).meta for d in (whole, split)]
    jw, js = (read_job(m) for m in stores)
    assert [(t.step, t.mode, t.measured_s) for t in jw.transitions] == [(m["step"], "stream", m["measured_s"]) for m in moves]
    assert [(t.step, t.mode) for t in js.transitions] == [(t.step, t.mode) for t in jw.transitions]
    assert [plan_config(stores[1], t.to_plan) for t in js.transitions] == [plan_config(stores[0], t.to_plan) for t in jw.transitions]
    assert plan_config(stores[0], jw.transitions[-1].to_plan) == metrics_plan(whole)
    shown = runner.invoke(app, ["inspect", str(split / "checkpoints")])
    assert shown.exit_code == 0 and f"job: {len(js.plans)} plan(s), {len(js.transitions)} transition(s)" in shown.output, shown.output
    # nereus report on a job still writing (a torn last line): plots and a summary
    with open(whole / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "reward_me')
    report = runner.invoke(app, ["report", str(whole)])
    assert report.exit_code == 0, report.output
    for name in ("reward", "stages", "plan", "predicted", "memory"):
        assert (whole / "report" / f"{name}.png").stat().st_size > 1000, name
    summary = (whole / "report" / "report.md").read_text()
    assert "| steps | 1–12 |" in summary and "![plan](plan.png)" in summary
    assert f"| {moves[0]['step']} | actor.train |" in summary  # the transition's row
