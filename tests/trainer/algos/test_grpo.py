"""GRPO maths: group advantages on hand-made rewards, broadcast over tokens, a bandit."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.trainer.algos.advantages import minibatch_indices
from nereus.trainer.algos.grpo import group_advantages
from nereus.trainer.algos.ppo import policy_loss  # GRPO's loss is PPO's clipped surrogate with the k3 KL term


def test_group_advantages_by_hand() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0])
    adv, metrics = group_advantages(scores, 4, eps=0.0 + 1e-12)
    # group 0: mean 0.5, std (Bessel) sqrt(4·0.25/3) = 1/sqrt(3)
    s = 1 / math.sqrt(3)
    assert adv[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], rel=1e-6)
    # group 1: every sample scores the same → advantage 0
    assert adv[4:8].tolist() == [0.0] * 4
    # group 2: mean 0.25, std sqrt((3·0.0625 + 0.5625)/3) = 0.5
    assert adv[8:].tolist() == pytest.approx([-0.5, -0.5, -0.5, 1.5], rel=1e-6)
    assert metrics["zero_std_frac"] == pytest.approx(1 / 3)
    assert set(metrics) == {"group_std", "zero_std_frac"}  # the step's reward_mean is the loop's


def test_dr_grpo_does_not_divide_by_std() -> None:
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0])
    adv, _ = group_advantages(scores, 2, scale_by_std=False)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_group_size_must_divide_the_batch() -> None:
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size=1"):
        group_advantages(torch.zeros(8), 1)


def test_advantage_is_broadcast_over_valid_tokens() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old = torch.full((2, 3), -1.0)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([2.0, -1.0])
    loss, sums = policy_loss(logp, old, adv, mask, clip=0.2)
    metrics = sums.mean()
    # ratio 1 everywhere: loss = token-mean of −A = (−2·3 + 1)/4
    assert float(loss.detach()) == pytest.approx(-5 / 4)
    loss.backward()
    assert logp.grad.tolist() == [[-0.5, -0.5, -0.5], [0.25, 0.0, 0.0]]
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == 0.0


def test_k3_kl_loss_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    mask = torch.ones(1, 2)
    old = torch.tensor([[-1.0, -2.0]])
    zero = torch.zeros(1)
    at_ref, s0 = policy_loss(old, old, zero, mask, clip=0.2, ref_logprobs=old, kl_coef=0.1)
    m0 = s0.mean()
    assert float(at_ref) == 0.0 and m0["kl_ref_k3"] == 0.0
    away, s1 = policy_loss(old, old, zero, mask, clip=0.2, ref_logprobs=old - 0.5, kl_coef=0.1)
    m1 = s1.mean()
    want = math.exp(-0.5) - 1 + 0.5
    assert m1["kl_ref_k3"] == pytest.approx(want, rel=1e-6)
    assert float(away) == pytest.approx(0.1 * want, rel=1e-6)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_solves_a_four_arm_bandit(scale_by_std: bool) -> None:
    """4 prompts × G=8 pulls per step of learnable logits, arm 1 pays 1: E[r] 0.25 → > 0.9."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    ref = torch.log_softmax(torch.zeros(4), 0)
    opt = torch.optim.Adam([logits], lr=0.05)
    G, B = 8, 32
    mask = torch.ones(B, 1)
    for _ in range(100):
        with torch.no_grad():
            arms = torch.multinomial(torch.softmax(logits, 0), B, replacement=True, generator=g)
            old = torch.log_softmax(logits, 0)[arms][:, None]
        adv, _ = group_advantages((arms == 1).float(), G, scale_by_std=scale_by_std)
        for idx in minibatch_indices(B, 16, epochs=2, generator=g):
            logp = torch.log_softmax(logits, 0)[arms[idx]][:, None]
            loss, _ = policy_loss(logp, old[idx], adv[idx], mask[idx], clip=0.2, ref_logprobs=ref[arms[idx]][:, None], kl_coef=0.01)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert float(logits.detach().softmax(0)[1]) > 0.9
