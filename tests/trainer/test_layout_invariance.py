"""The update does not depend on the layout: one PPO/GRPO step from the same state under
every training plan gives the same losses, metrics, parameters and AdamW state.

``trainer.layout_check.run_layouts`` builds the job once per plan inside one 4-process
launch and gathers the whole training state after the step. The rollout and the inference
stages keep one layout; ``actor.train`` and ``critic.train`` move through the matrix below
(dp4, dp2·tp2, tp2·pp2, FSDP over dp4 and over dp2·tp2, tp4 with KV heads copied, FSDP with
pp2, one rank alone) with micro-batches of 1 row, 3 rows and the whole batch.

- float64, 2 epochs × 2 mini-batches: every metric, parameter and AdamW tensor agrees to
  1e-10 — the update is one function of the data, the layout only reorders its roundings
  (PPO over the whole matrix; GRPO over three layouts for each ``loss_agg``);
- bfloat16 over float32 masters: FSDP2 and replicated dp agree to float32 rounding, with
  one micro-batch (4.5e-9) and with several (their gradient sums differ in order);
- tied embeddings across pipeline stages (float64) agree to 1e-10;
- float32, one update: metrics and gradient norms to 1e-6, AdamW's moments (the gradient's
  images) to 4e-6 (reduction order in float32: 1.3e-6 on m, 1.8e-6 on v measured), and each
  parameter to within what one Adam step does with that gradient difference: the update
  lr·g/(|g| + ε) moves by at most lr·|g − g'|·ε/(|g| + ε)² (its slope), which is large only
  in Adam's ε band (|g| near ε) — plus 1e-6 of the tensor's scale; at most 0.1% of the
  parameters may sit in that band.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from nereus.trainer.config import load_config
from nereus.trainer.layout_check import compare, run_layouts, state_kind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_PPO = os.path.join(ROOT, "configs", "tiny_ppo.yaml")
TINY_GRPO = os.path.join(ROOT, "configs", "tiny_grpo.yaml")

# 24 responses a step; training mini-batches of 12 rows: 3, 6 or 12 rows per replica.
SMALL = ["rollout.prompts_per_step=6", "checkpoint_every=0"]


def both(models: tuple[str, ...], **plan) -> list[str]:
    return [f"plan.{m}.train.{k}={v}" for m in models for k, v in plan.items()]


def matrix(models: tuple[str, ...]) -> list[list[str]]:
    """Training layouts of the matrix; the first is the reference (plain dp4, whole batch)."""
    layouts = [
        dict(dp=4, tp=1, pp=1, dp_shard="false"),
        dict(dp=2, tp=2, pp=1, dp_shard="false", micro_batch_size=3),
        dict(dp=1, tp=2, pp=2, dp_shard="false", micro_batch_size=1),
        dict(dp=4, tp=1, pp=1, dp_shard="true", micro_batch_size=3),
        dict(dp=2, tp=2, pp=1, dp_shard="true", micro_batch_size=1),
        dict(dp=1, tp=4, pp=1, dp_shard="false", micro_batch_size=3),  # 2 KV heads on 4 TP ranks: copied
        dict(dp=2, tp=1, pp=2, dp_shard="true"),  # FSDP inside each pipeline stage
        dict(dp=1, tp=1, pp=1, dp_shard="false", ranks="[2]", micro_batch_size=12),  # one rank, the whole batch
    ]
    return [both(models, **layout) for layout in layouts]


def run(config: str, overrides: list[str], models: tuple[str, ...], tmp_path, layouts: list[int] | None = None):
    plans = matrix(models)
    plans = plans if layouts is None else [plans[i] for i in layouts]
    cfg = load_config(config, [*SMALL, *overrides, f"run_dir={tmp_path}", *plans[0]])
    results = run_layouts(cfg, plans)
    assert [r.plan for r in results] == [tuple(p) for p in plans]
    assert results[0].state and results[0].metrics, "nothing was gathered"
    return results


@pytest.mark.timeout(600)
def test_ppo_float64_every_layout_gives_the_same_update(tmp_path):
    results = run(TINY_PPO, ["model.dtype=float64", "ppo.minibatch_size=12", "ppo.epochs=2"], ("actor", "critic"), tmp_path)
    keys = set(results[0].metrics)
    assert {"actor/loss", "actor/grad_norm", "actor/clipfrac", "actor/ratio", "critic/loss", "critic/grad_norm"} <= keys
    assert {state_kind(k) for k in results[0].state} == {"param", "exp_avg", "exp_avg_sq", "step"}
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= 1e-10, f"{plan}: {kind} differs by {err:.2e} at {where}"


@pytest.mark.timeout(600)
def test_grpo_float64_layouts_give_the_same_update_under_every_aggregation(tmp_path):
    """Three layouts for each ``loss_agg`` in one launch; each aggregation compared within itself."""
    aggs = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
    layouts = [matrix(("actor",))[i] for i in (0, 2, 4)]
    plans = [[f"grpo.loss_agg={agg}", *layout] for agg in aggs for layout in layouts]
    cfg = load_config(TINY_GRPO, [*SMALL, "model.dtype=float64", "grpo.minibatch_size=12", "grpo.epochs=2",
                                  f"run_dir={tmp_path}", *plans[0]])
    results = run_layouts(cfg, plans)
    losses = set()
    for k, agg in enumerate(aggs):
        group = results[3 * k : 3 * k + 3]
        assert group[0].metrics["response_length"] < cfg.rollout.max_new_tokens  # unequal lengths: some stop early
        losses.add(round(group[0].metrics["actor/loss"], 12))
        for plan, worst in compare(group).items():
            for kind, (err, where) in worst.items():
                assert err <= 1e-10, f"{agg}, {plan}: {kind} differs by {err:.2e} at {where}"
    assert len(losses) == 3, "the three aggregations must weigh the tokens differently"


@pytest.mark.timeout(600)
def test_ppo_float32_one_update_agrees_to_reduction_order(tmp_path):
    lr, eps = 2e-3, 1e-8  # tiny_ppo's actor lr (critic_lr 1e-3 below it); torch AdamW's eps
    results = run(TINY_PPO, ["ppo.minibatch_size=24", "ppo.epochs=1", "ppo.critic_lr=2e-3"], ("actor", "critic"), tmp_path)
    ref = results[0]
    for r, (plan, worst) in zip(results[1:], compare(results).items()):
        assert worst["metrics"][0] <= 1e-6, f"{plan}: metric {worst['metrics'][1]} differs by {worst['metrics'][0]:.2e}"
        for kind in ("exp_avg", "exp_avg_sq"):
            assert worst[kind][0] <= 4e-6, f"{plan}: {kind} differs by {worst[kind][0]:.2e} at {worst[kind][1]}"
        band = total = 0
        for key in ref.state:
            if state_kind(key) != "param":
                continue
            model, name = key.split("/", 1)
            g, g2 = (x.state[f"{model}/optim/exp_avg/{name}"].astype(np.float64) / 0.1 for x in (ref, r))  # m = (1 − β1)·g
            near = np.where(np.sign(g) == np.sign(g2), np.minimum(np.abs(g), np.abs(g2)), 0.0)
            slack = 1e-6 * np.abs(ref.state[key]).max()
            slope = np.minimum(lr * np.abs(g - g2) * eps / (near + eps) ** 2, 2 * lr)  # |Δ update| < 2·lr at most
            diff = np.abs(r.state[key].astype(np.float64) - ref.state[key])
            assert (diff <= slope + slack).all(), f"{plan}: {key} moved {float((diff / (slope + slack)).max()):.2f}× more than Adam's slope allows"
            band, total = band + int((slope > slack).sum()), total + g.size
        assert band <= 1e-3 * total, f"{plan}: {band} of {total} parameters sit in Adam's ε band: the gradients differ too much"


@pytest.mark.timeout(300)
def test_bf16_fsdp_and_replicated_dp_give_the_same_update_to_float32_rounding(tmp_path):
    """bf16 compute over float32 masters: FSDP2's mixed precision (bf16 all-gather) and the
    casts inside the model (replicated dp) are the same bf16 arithmetic; with one
    micro-batch the update agrees to float32 rounding. It agreed bit for bit on the
    rollouts sampled before sampling was keyed by row; on these it differs by 4.5e-9 on one
    tensor (with or without clipping), a difference in the float32 gradient sums that is not
    isolated yet, so the bound is float32's, as with several micro-batches below."""
    plans = [both(("actor", "critic"), dp=4, tp=1, pp=1, dp_shard=s) for s in ("false", "true")]
    cfg = load_config(TINY_PPO, [*SMALL, "model.dtype=bfloat16", "ppo.minibatch_size=12", f"run_dir={tmp_path}", *plans[0]])
    results = run_layouts(cfg, plans)
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= 1e-7, f"{plan}: {kind} differs by {err:.2e} at {where}"


@pytest.mark.timeout(600)
def test_tied_embeddings_give_the_same_update_across_pipeline_stages(tmp_path):
    """Tied embeddings: with pp > 1 the embedding and the LM head live on different pipeline
    stages, and the shared matrix's gradient is the sum of both uses; float64, 2 × 2 updates."""
    layouts = [matrix(("actor",))[i] for i in (0, 2, 6)]  # dp4; tp2·pp2; FSDP over dp2 with pp2
    cfg = load_config(TINY_GRPO, [*SMALL, "model.dtype=float64", "model.tie_embeddings=true", "grpo.minibatch_size=12",
                                  "grpo.epochs=2", f"run_dir={tmp_path}", *layouts[0]])
    results = run_layouts(cfg, layouts)
    assert not any("lm_head" in k for k in results[0].state), "a tied model has no lm_head of its own"
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= 1e-10, f"{plan}: {kind} differs by {err:.2e} at {where}"


@pytest.mark.timeout(300)
def test_bf16_fsdp_and_replicated_dp_agree_bit_for_bit_over_several_micro_batches(tmp_path):
    """As above, with each replica's 3 rows in 3 micro-batches. The bf16 arithmetic is the
    same; the float32 gradient sums are not in the same order — FSDP2 reduce-scatters each
    micro-batch's gradient and adds the shards, replicated dp adds the micro-batches and
    all-reduces once — so the update agrees to float32 rounding (measured: 3.7e-8 on a
    parameter), not bit for bit."""
    plans = [both(("actor", "critic"), dp=4, tp=1, pp=1, dp_shard=s, micro_batch_size=1) for s in ("false", "true")]
    cfg = load_config(TINY_PPO, [*SMALL, "model.dtype=bfloat16", "ppo.minibatch_size=12", f"run_dir={tmp_path}", *plans[0]])
    results = run_layouts(cfg, plans)
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= 1e-6, f"{plan}: {kind} differs by {err:.2e} at {where}"
        assert max(err for err, _ in worst.values()) > 0, "several micro-batches should change the float32 order"


@pytest.mark.timeout(600)
def test_recompute_packed_micro_batches_and_the_rollout_layout_give_the_same_update(tmp_path):
    """Activation checkpointing (full, selective) and token-budget micro-batches, padding
    removed (every training and inference stage packed, the replicas' shares balanced by
    tokens), under FSDP2, TP and PP: the same update as the padded, stored run (float64,
    2 epochs × 2 mini-batches, 1e-10). The rollouts stop at <eos>, so rows differ in length.

    The rollout's own layout neither: sampling is keyed by the step and the row, never by the
    dp replica, so actor.gen over dp2·tp2 or one rank samples what dp4 samples — what lets a
    job resume on another number of processes."""
    models = ("actor", "critic")
    packed = ["plan.ref.infer.micro_batch_tokens=23", "plan.critic.infer.micro_batch_tokens=23"]
    plans = [
        matrix(models)[0],
        both(models, dp=4, tp=1, pp=1, dp_shard="false", recompute="full"),
        both(models, dp=2, tp=2, pp=1, dp_shard="true", recompute="selective", micro_batch_tokens=23) + packed,
        both(models, dp=1, tp=2, pp=2, dp_shard="false", recompute="full", micro_batch_tokens=23) + packed,
        both(models, dp=2, tp=1, pp=2, dp_shard="true", micro_batch_tokens=40),
        both(models, dp=4, tp=1, pp=1, dp_shard="true", micro_batch_tokens=17),  # unequal pack counts, evened for FSDP2
        [*matrix(models)[0], "plan.actor.gen.dp=2", "plan.actor.gen.tp=2"],
        [*matrix(models)[0], "plan.actor.gen.dp=1", "plan.actor.gen.tp=1", "plan.actor.gen.ranks=[3]"],
    ]
    # responses of 1 to 12 tokens (the random-init policy stops at <eos>): rows of 6 to 17 tokens
    cfg = load_config(TINY_PPO, [*SMALL, "model.dtype=float64", "ppo.minibatch_size=12", "ppo.epochs=2", "rollout.max_new_tokens=12",
                                 f"run_dir={tmp_path}", *plans[0]])
    results = run_layouts(cfg, plans)
    assert results[0].metrics["response_length"] % 1, "rows of one length would pack trivially"
    for i, (plan, worst) in enumerate(compare(results).items()):
        for kind, (err, where) in worst.items():
            bound = 0.0 if i == 0 else 1e-10  # recompute alone: the same kernels on the same inputs
            assert err <= bound, f"{plan}: {kind} differs by {err:.2e} at {where}"

