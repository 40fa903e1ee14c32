"""`nereus train` end to end: bad input stops cleanly, the training step's pieces (the default
job's learning, through a stop and resumes on 2 and 3 processes: test_resume.py).

Each job runs on 4 local gloo processes through the same launcher the CLI uses.
"""

import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

from nereus.cli.app import app
from nereus.store.checkpoint import CheckpointStore
from nereus.trainer.prepare import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
TINY_GRPO = os.path.join(ROOT, "configs", "tiny_grpo.yaml")

runner = CliRunner()


def train(*args: str):
    return runner.invoke(app, ["train", *args], catch_exceptions=False)


def metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.kl_coeff=0.1"], "did you mean 'ppo.kl_coef'"),
        (["plan.actor.train.tp=3"], "plan 'actor.train'"),
        (["device_memory_gib=0.0001"], "plan over the memory budget on rank"),
        (["model.path=/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_input_is_a_one_line_error(overrides, message, tmp_path):
    args = [a for o in overrides for a in ("--set", o)]
    result = runner.invoke(app, ["train", TINY_PPO, *args, "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error")
def test_device_cuda_without_cuda_is_a_one_line_error(tmp_path):
    result = runner.invoke(app, ["train", TINY_PPO, "--set", "device=cuda", "--run-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "config key 'device' is 'cuda'" in result.output
    assert "Traceback" not in result.output


# tiny_ppo on one process (every model-stage dp=tp=1); tools/gpu_check.sh runs it with device=cuda.
ONE_PROCESS_PPO = [
    "nproc=1", "plan.actor.train.dp=1", "plan.actor.train.tp=1", "plan.actor.gen.dp=1", "plan.critic.train.dp=1",
    "plan.critic.infer.dp=1", "plan.critic.infer.tp=1", "plan.ref.infer.dp=1", "plan.ref.infer.tp=1",
]


@pytest.mark.timeout(300)
def test_one_process_job_on_an_explicit_device(tmp_path):
    sets = [a for o in [*ONE_PROCESS_PPO, "device=cpu", "steps=2"] for a in ("--set", o)]
    result = train(TINY_PPO, *sets, "--run-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert len(rows[-1]["peak_memory_bytes"]) == 1
    assert "peak_device_memory_bytes" not in rows[-1]  # CUDA only


@pytest.mark.timeout(300)
def test_a_fresh_run_refuses_a_run_dir_with_an_earlier_runs_checkpoints(tmp_path):
    sets = [a for o in [*ONE_PROCESS_PPO, "steps=1"] for a in ("--set", o)]
    assert train(TINY_PPO, *sets, "--run-dir", str(tmp_path)).exit_code == 0
    again = runner.invoke(app, ["train", TINY_PPO, *sets, "--run-dir", str(tmp_path)])
    assert again.exit_code == 2 and "holds checkpoints of an earlier run (steps [1])" in again.output
    assert "Traceback" not in again.output
    assert train(TINY_PPO, *sets, "--set", "checkpoint_every=0", "--run-dir", str(tmp_path), "--overwrite").exit_code == 0
    assert CheckpointStore(str(tmp_path / "checkpoints")).steps() == [1]  # the new run's end-of-run checkpoint
    assert [r["step"] for r in metrics(tmp_path)] == [1]


def test_resume_without_a_checkpoint_says_so(tmp_path):
    result = runner.invoke(app, ["train", TINY_PPO, "--set", "steps=1", "--run-dir", str(tmp_path), "--resume"])
    assert result.exit_code == 1
    assert "no committed checkpoint" in result.output


# tiny_grpo on 2 processes: actor.train dp2, actor.gen and ref.infer tp2 (two layouts still)
TWO_PROCS = ["nproc=2", "plan.actor.train.dp=2", "plan.actor.gen.dp=1", "plan.ref.infer.dp=1"]


def _two_steps(rank, world_size, run_dir, on_policy, algo):
    """Two steps of one update each; the shortcut on or forced off (old log-probs computed).
    GRPO on 2 processes; PPO (KL as a loss term) on one."""
    from nereus.trainer.runtime.step import Trainer

    if algo == "grpo":
        cfg = load_config(TINY_GRPO, [*TWO_PROCS, f"run_dir={run_dir}", "grpo.epochs=1", "grpo.minibatch_size=256", "device=cpu"])
    else:
        cfg = load_config(TINY_PPO, [*ONE_PROCESS_PPO, f"run_dir={run_dir}", "ppo.epochs=1", "ppo.minibatch_size=256",
                                     "ppo.kl_in_reward=false", "device=cpu"])
    trainer = Trainer(cfg)
    assert trainer.on_policy  # one epoch of one mini-batch, KL as a loss term
    trainer.on_policy = on_policy
    steps = [trainer.run_step() for _ in range(2)]
    params = {k: v.detach().numpy().copy() for k, v in trainer.stages["actor.train"].param_buffers().items()}  # by value
    return [{k: s[k] for k in ("actor/loss", "actor/pg_loss", "actor/ratio", "reward_mean")} for s in steps], params


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algo, nproc", [("grpo", 2), ("ppo", 1)])
def test_one_update_per_step_skips_the_old_logprob_forward_exactly(tmp_path, algo, nproc):
    from tests.distributed_harness import run_distributed

    fast = run_distributed(_two_steps, nproc, str(tmp_path / "a"), True, algo, timeout=240)
    slow = run_distributed(_two_steps, nproc, str(tmp_path / "b"), False, algo, timeout=240)
    for (fm, fp), (sm, sp) in zip(fast, slow):
        for f, s in zip(fm, sm):
            assert f["reward_mean"] == s["reward_mean"]
            assert f["actor/ratio"] == pytest.approx(1.0, abs=1e-6)
            assert f["actor/loss"] == pytest.approx(s["actor/loss"], abs=1e-6)
        for name in sp:
            assert abs(fp[name] - sp[name]).max() <= 1e-6, name


def _entropy_step(rank, world_size, run_dir):
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_GRPO, [*TWO_PROCS, f"run_dir={run_dir}", "grpo.entropy_coef=0.5", "device=cpu"])
    return Trainer(cfg).run_step()


@pytest.mark.timeout(300)
def test_entropy_coef_adds_the_policy_entropy_bonus(tmp_path):
    from tests.distributed_harness import run_distributed

    step = run_distributed(_entropy_step, 2, str(tmp_path), timeout=240)[0]
    # H of the near-uniform initial policy over the 16-token vocabulary: close to log 16
    assert 0.9 * math.log(16) < step["actor/entropy"] <= math.log(16) + 1e-6


def _reward_model_step(rank, world_size, run_dir, rm_dir):
    """One PPO step on 2 processes scored by a reward model loaded from an HF directory
    (reward.infer tp2: the scores cross a TP layout), with the batch and scores it used."""
    from nereus.trainer.runtime.step import Trainer

    rm = "{path: %s, hidden_size: 64, intermediate_size: 192, num_layers: 2, num_heads: 4, num_kv_heads: 2}" % rm_dir
    two = [o.replace("=1", "=2") if ".dp=" in o or o.startswith("nproc") else o for o in ONE_PROCESS_PPO]  # all dp=2
    cfg = load_config(TINY_PPO, [*two, f"run_dir={run_dir}", "device=cpu", f"reward_model={rm}", "plan.reward.infer.tp=2"])
    trainer = Trainer(cfg)
    seen = {}
    advantages = trainer._advantages

    def spy(batch, scores):
        seen.update(batch={k: v.clone() for k, v in batch.items()}, scores=scores.clone())
        return advantages(batch, scores)

    trainer._advantages = spy
    step = trainer.run_step()
    return step, seen


@pytest.mark.timeout(300)
def test_a_reward_model_scores_each_sequence_at_its_last_real_token(tmp_path):
    from tests.distributed_harness import run_distributed
    from tests.store.models import llama_config, write_hf_model

    from nereus.trainer.models.decoder import ModelArgs, build_model

    config = llama_config(
        architectures=["LlamaForSequenceClassification"], vocab_size=16, hidden_size=64, intermediate_size=192,
        num_hidden_layers=2, max_position_embeddings=32,
    )
    weights = write_hf_model(tmp_path / "rm", config, seed=3)
    step, seen = run_distributed(_reward_model_step, 2, str(tmp_path / "run"), str(tmp_path / "rm"), timeout=240)[0]

    model = build_model(ModelArgs.from_hf_config(config), device="cpu")
    model.load_state_dict(weights)
    batch = seen["batch"]
    with torch.no_grad():
        values = model(batch["input_ids"], attention_mask=batch["attention_mask"].bool())
    real = batch["attention_mask"].bool()
    last = torch.tensor([int(row.nonzero().max()) for row in real])
    expected = values[torch.arange(len(last)), last]
    torch.testing.assert_close(seen["scores"], expected, atol=1e-4, rtol=1e-4)  # tp2 vs one process; N(0, 1) weights
    assert step["reward_mean"] == pytest.approx(float(seen["scores"].mean()), abs=1e-6)
    assert 0.0 <= step["task_reward_mean"] <= 1.0 and step["task_reward_mean"] != step["reward_mean"]


def _critic_params(rank, world_size, run_dir, lm_dir):
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_PPO, [*ONE_PROCESS_PPO, f"run_dir={run_dir}", "device=cpu", f"model.path={lm_dir}"])
    trainer = Trainer(cfg)
    stages = ("critic.train", "actor.train")
    return {k: {n: t.detach().numpy().copy() for n, t in trainer.stages[k].param_buffers().items()} for k in stages}  # by value


@pytest.mark.timeout(300)
def test_a_critic_on_the_actors_checkpoint_loads_its_backbone_and_draws_a_value_head(tmp_path):
    """As verl and OpenRLHF start a critic: the LM's backbone, a fresh value head (no lm_head)."""
    from tests.distributed_harness import run_distributed
    from tests.store.models import llama_config, write_hf_model

    from nereus.trainer.models.decoder import init_tensor

    config = llama_config(vocab_size=16, hidden_size=64, intermediate_size=192, num_hidden_layers=2, max_position_embeddings=32)
    weights = write_hf_model(tmp_path / "lm", config, seed=5)
    params = run_distributed(_critic_params, 1, str(tmp_path / "run"), str(tmp_path / "lm"), timeout=240)[0]
    critic, actor = ({n: torch.from_numpy(a) for n, a in params[k].items()} for k in ("critic.train", "actor.train"))
    assert set(critic) == {n for n in weights if n != "lm_head.weight"} | {"score.weight"}
    for name, value in weights.items():
        assert torch.equal(actor[name], value), name
        if name != "lm_head.weight":
            assert torch.equal(critic[name], value), name
    init_std = load_config(TINY_PPO).model.init_std
    assert torch.equal(critic["score.weight"], init_tensor("score.weight", (1, 64), seed=1, std=init_std))


def _grpo_steps(rank, world_size, run_dir, overrides):
    """Two GRPO steps on 2 processes (fixed-length responses), their metrics and the weights."""
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_GRPO, [*TWO_PROCS, f"run_dir={run_dir}", "device=cpu", "rollout.ignore_eos=true", *overrides])
    trainer = Trainer(cfg)
    calls = {"actor.train": 0, "ref.infer": 0}  # forwards of this rank's modules
    for key in calls:
        if trainer.stages[key].part is not None:
            trainer.stages[key].part.module.register_forward_pre_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    steps = [trainer.run_step() for _ in range(2)]
    params = {k: v.detach().numpy().copy() for k, v in trainer.stages["actor.train"].param_buffers().items()}
    return [{k: s[k] for k in ("actor/loss", "actor/grad_norm", "reward_mean", "kl")} for s in steps], params, calls


@pytest.mark.timeout(300)
def test_micro_batches_accumulate_the_same_update(tmp_path):
    """actor.train in 4-row micro-batches and ref.infer in 8-row ones give the whole batch's
    losses, KL, gradient norms and weights (each micro-batch's loss is normalised by the whole
    mini-batch, ppo.py's aggregation; tests/trainer/runtime/test_layout_invariance.py checks unequal
    response lengths over every layout). Weights to 1e-4 only: AdamW turns float rounding in
    near-zero gradients into updates of up to lr · rounding / eps."""
    from tests.distributed_harness import run_distributed

    micro = ["plan.actor.train.micro_batch_size=4", "plan.ref.infer.micro_batch_size=8"]
    whole = run_distributed(_grpo_steps, 2, str(tmp_path / "a"), [], timeout=240)
    split = run_distributed(_grpo_steps, 2, str(tmp_path / "b"), micro, timeout=240)
    assert whole[0][2]["ref.infer"] == 2 and split[0][2]["ref.infer"] == 2 * 32  # 256 rows in 8-row micro-batches
    assert split[0][2]["actor.train"] >= 16 * whole[0][2]["actor.train"]  # 64 rows per replica in 4-row ones
    for (wm, wp, _), (sm, sp, _) in zip(whole, split):
        for w, s in zip(wm, sm):
            assert s["reward_mean"] == w["reward_mean"]
            assert s["kl"] == pytest.approx(w["kl"], abs=1e-6)
            assert s["actor/loss"] == pytest.approx(w["actor/loss"], abs=1e-6)
            assert s["actor/grad_norm"] == pytest.approx(w["actor/grad_norm"], rel=1e-5)
        for name in wp:
            assert abs(sp[name] - wp[name]).max() <= 1e-4, name


def _one_ppo_step(rank, world_size, run_dir, overrides):
    from nereus.trainer.runtime.step import Trainer

    cfg = load_config(TINY_PPO, [*ONE_PROCESS_PPO, f"run_dir={run_dir}", "device=cpu", *overrides])
    trainer = Trainer(cfg)
    step = trainer.run_step()
    return sorted(trainer.stages), {k: step[k] for k in ("reward_mean", "critic/loss", "actor/loss", "kl")}


@pytest.mark.timeout(300)
def test_without_critic_infer_the_values_come_from_critic_train(tmp_path):
    """No critic.infer in the plan: no such stage, no second copy of the critic, and the
    step equals one whose critic.infer holds the same weights in the same layout."""
    from tests.distributed_harness import run_distributed

    with_infer = run_distributed(_one_ppo_step, 1, str(tmp_path / "a"), ["plan.critic.train.dp_shard=false"], timeout=240)[0]
    without = run_distributed(_one_ppo_step, 1, str(tmp_path / "b"), ["plan.critic.train.dp_shard=false", "plan.critic.infer=null"], timeout=240)[0]
    assert "critic.infer" in with_infer[0] and "critic.infer" not in without[0]
    for key, value in with_infer[1].items():
        assert without[1][key] == pytest.approx(value, abs=1e-6), key
