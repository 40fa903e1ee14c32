"""`nereus resume`: a job continues on another number of processes, in a plan chosen for
them, and repeats what the uninterrupted job would have done (float64: reduction order)."""

import json
import math
import os

import pytest
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore
from nereus.trainer.config import load_config
from nereus.trainer.resume import resume_config, runs_on

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
runner = CliRunner()
COMMON = ["--set", "model.dtype=float64", "--set", "checkpoint_every=2", "--set", "rollout.prompts_per_step=16",
          "--set", "ppo.minibatch_size=32"]
KEYS = ("actor/loss", "critic/loss", "reward_mean", "kl", "actor/grad_norm", "critic/grad_norm", "response_length")


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(600)
def test_a_job_resumed_on_two_processes_repeats_the_four_process_run(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert runner.invoke(app, ["train", TINY_PPO, *COMMON, "--set", "steps=4", "--run-dir", str(whole)]).exit_code == 0
    assert runner.invoke(app, ["train", TINY_PPO, *COMMON, "--set", "steps=2", "--run-dir", str(split)]).exit_code == 0
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
    assert CheckpointStore(str(split / "checkpoints")).steps() == [2, 4]


def test_resume_names_what_is_missing(tmp_path):
    nothing = runner.invoke(app, ["resume", str(tmp_path)])
    assert nothing.exit_code == 2 and "no config.json, so no `nereus train` run to resume here" in nothing.output
    (tmp_path / "config.json").write_text(json.dumps({"steps": 1}))
    unsaved = runner.invoke(app, ["resume", str(tmp_path)])
    assert unsaved.exit_code == 2 and "no committed checkpoint to resume from" in unsaved.output
