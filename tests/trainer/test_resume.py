"""Resuming a job: `nereus train --resume` on the same processes repeats the uninterrupted run
bit for bit; `nereus resume` continues it on another number of processes, in a plan chosen
for them, and repeats it up to reduction order (float64); a NaN after a resume stops the job
and keeps the last good checkpoint.

One uninterrupted 4-step run (checkpoints at steps 2 and 4) is made once; each test resumes a
copy of it as a crash after step 3 was logged, before step 4 was checkpointed, leaves it
(``crashed``).
"""

import json
import math
import os
import shutil

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore, load_checkpoint
from nereus.store.job import plan_config, read_job
from nereus.trainer.config import load_config
from nereus.trainer.resume import resume_config, runs_on

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
runner = CliRunner()
# The controller watches (and calibrates) without ever moving: no budget, no drift that triggers.
COMMON = ["--set", "model.dtype=float64", "--set", "checkpoint_every=2", "--set", "rollout.prompts_per_step=16",
          "--set", "ppo.minibatch_size=32", "--set", "controller.enabled=true", "--set", "controller.drift=1000"]
KEYS = ("actor/loss", "critic/loss", "reward_mean", "kl", "actor/grad_norm", "critic/grad_norm", "response_length")


def lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def metrics(run_dir) -> list[dict]:
    return lines(os.path.join(run_dir, "metrics.jsonl"))


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The uninterrupted run: 4 steps on 4 processes, checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("whole")
    result = runner.invoke(app, ["train", TINY_PPO, *COMMON, "--set", "steps=4", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert CheckpointStore(str(run_dir / "checkpoints")).steps() == [2, 4]
    return run_dir


def crashed(whole, run_dir):
    """A copy of ``whole`` as a crash after step 3 was logged and before step 4 was committed
    leaves it: the step-4 checkpoint gone, step 3's lines false (so that what the resumed run
    writes is what is compared), a torn line after them."""
    shutil.copytree(whole, run_dir)
    assert CheckpointStore(str(run_dir / "checkpoints")).delete(4)
    for name in ("metrics.jsonl", "predictions.jsonl"):
        kept = [r for r in lines(run_dir / name) if r["step"] <= 2]
        false = {**kept[-1], "step": 3, "actor/loss": 123.0}
        with open(run_dir / name, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in [*kept, false]) + '{"step": 4, "tor')
    return run_dir


@pytest.mark.timeout(600)
def test_a_resumed_run_repeats_the_uninterrupted_losses_bit_for_bit(whole, tmp_path):
    split = crashed(whole, tmp_path / "split")
    result = runner.invoke(app, ["train", TINY_PPO, *COMMON, "--set", "steps=4", "--run-dir", str(split), "--resume"])
    assert result.exit_code == 0, result.output
    keys = ("step", *KEYS)
    assert [[r[k] for k in keys] for r in metrics(split)] == [[r[k] for k in keys] for r in metrics(whole)]  # each step once
    assert CheckpointStore(str(split / "checkpoints")).steps() == [2, 4]
    # the controller's calibration came back with the checkpoint: step 3's predictions (made
    # with the fit of steps 1-2) are the uninterrupted run's, to the bit
    ours, ref = (lines(d / "predictions.jsonl") for d in (split, whole))
    assert [p["step"] for p in ours] == [1, 2, 3, 4]
    assert {k: v["predicted_s"] for k, v in ours[2]["pieces"].items()} == {k: v["predicted_s"] for k, v in ref[2]["pieces"].items()}
    state = CheckpointStore(str(split / "checkpoints")).manifest().state["controller"]
    assert state["transfers"] and {link for link, _, _ in state["transfers"]} == {"node"}  # the weight syncs' messages
    job = read_job(CheckpointStore(str(split / "checkpoints")).meta)
    assert job.transitions == () and len(job.plans) == 1  # the same plan throughout


@pytest.mark.timeout(600)
def test_a_job_resumed_on_two_processes_repeats_the_four_process_run(whole, tmp_path):
    split = crashed(whole, tmp_path / "split")
    cfg, how = resume_config(str(split), nproc=2, overrides=["steps=4"])
    assert cfg.nproc == 2 and "planned for 2 ranks by the controller" in how
    assert runs_on(cfg.plan, 2) and not runs_on(load_config(TINY_PPO).plan, 2)
    same, how = resume_config(str(split), overrides=["steps=4"])  # the same world: the checkpoint's plan
    assert how == "the checkpoint's plan (it runs on 4 ranks)" and same.plan == load_config(TINY_PPO).plan
    given, how = resume_config(str(split), nproc=2, overrides=["plan.actor.train.dp=1", "plan.actor.gen.dp=2", "plan.critic.train.dp=2",
                                                                "plan.critic.infer.dp=1", "plan.ref.infer.dp=1"])
    assert given.plan.actor.train.tp == 2 and how.startswith("the checkpoint's plan with plan.actor.train.dp")
    bad = runner.invoke(app, ["resume", str(split), "--nproc", "2", "--set", "plan.actor.train.dp=2"])
    assert bad.exit_code == 2 and "plan 'actor.train': dp=2 · tp=2 · pp=1 needs 4 ranks, but nproc=2" in bad.output
    assert "Traceback" not in bad.output
    result = runner.invoke(app, ["resume", str(split), "--nproc", "2", "--set", "steps=4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "resuming" in result.output and "on 2 processes" in result.output
    ours, ref = metrics(split), metrics(whole)
    assert [r["step"] for r in ours] == [1, 2, 3, 4]  # each step once
    assert len(ours[-1]["peak_memory_bytes"]) == 2
    for a, b in zip(ours[2:], ref[2:]):
        for k in KEYS:
            assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), f"step {a['step']} {k}: {a[k]} vs {b[k]}"
    store = CheckpointStore(str(split / "checkpoints"))
    assert store.steps() == [2, 4]
    job = read_job(store.meta)  # the store's job record: the resume's config, and the move to the 2-rank plan
    assert job.config["nproc"] == 2 and len(job.plans) == 2
    [move] = job.transitions
    assert (move.step, move.from_plan, move.to_plan, move.mode) == (2, job.plans[0], job.plans[1], "resume") and move.measured_s > 0
    assert plan_config(store.meta, move.to_plan) == store.manifest().plan != plan_config(store.meta, move.from_plan)


@pytest.mark.timeout(600)
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(whole, tmp_path):
    split = crashed(whole, tmp_path / "split")
    result = runner.invoke(app, ["train", TINY_PPO, *COMMON, "--set", "steps=5", "--set", "checkpoint_every=1", "--set", "ppo.lr=1e300",
                                 "--run-dir", str(split), "--resume"])
    assert result.exit_code == 1, result.output
    assert "loss or gradient is not finite" in result.output and "step 3" in result.output
    assert CheckpointStore(str(split / "checkpoints")).steps() == [2]
    cfg = load_config(TINY_PPO, ["model.dtype=float64"])
    from nereus.reshard.derive import derive_emus
    from nereus.trainer.stage_args import model_args

    args = model_args(cfg, "actor.train")
    emus = derive_emus(args.spec, cfg.plan.actor.train.parallel_config(cfg.nproc), model="actor", stage="train", optimizer=True)
    manifest, _ = load_checkpoint(str(split / "checkpoints"), emus, rank=0)
    assert manifest.step == 2


def test_resume_names_what_is_missing(tmp_path):
    nothing = runner.invoke(app, ["resume", str(tmp_path)])
    assert nothing.exit_code == 2 and "no config.json, so no `nereus train` run to resume here" in nothing.output
    (tmp_path / "config.json").write_text(json.dumps({"steps": 1}))
    unsaved = runner.invoke(app, ["resume", str(tmp_path)])
    assert unsaved.exit_code == 2 and "no committed checkpoint to resume from" in unsaved.output
