"""PPO maths: GAE against a plain loop, whitening, KL placement, clipping gradients, a bandit."""

from __future__ import annotations

import math

import pytest
import torch

from nereus.trainer.algos.advantages import (
    kl_k3,
    masked_mean,
    masked_whiten,
    minibatch_indices,
)
from nereus.trainer.algos.ppo import LOSS_AGG, compute_advantages, gae, loss_weights, policy_loss, token_rewards, value_loss
from nereus.trainer.parallel.vocab_parallel import token_logprobs


def random_batch(B: int = 6, T: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T  # one full row
    lengths[1] = 1  # one single-token row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return {
        "mask": mask,
        "lengths": lengths,
        "rewards": torch.randn(B, T, generator=g, dtype=torch.float64) * mask,
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "scores": torch.rand(B, generator=g),
        "old": -torch.rand(B, T, generator=g) * 3,
        "ref": -torch.rand(B, T, generator=g) * 3,
    }


def gae_loop(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE of one episode, textbook form: the value after the last token is 0."""
    n = len(rewards)
    adv = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        next_v = values[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_python_loop(gamma: float, lam: float) -> None:
    b = random_batch()
    adv, ret = gae(b["rewards"], b["values"], b["mask"], gamma=gamma, lam=lam)
    for row, n in enumerate(b["lengths"].tolist()):
        want_adv, want_ret = gae_loop(b["rewards"][row, :n].tolist(), b["values"][row, :n].tolist(), gamma, lam)
        torch.testing.assert_close(adv[row, :n], torch.tensor(want_adv, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[row, :n], torch.tensor(want_ret, dtype=torch.float64), rtol=0, atol=1e-6)
        assert (adv[row, n:] == 0).all() and (ret[row, n:] == 0).all()


def test_gae_rejects_a_mask_with_holes() -> None:
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), mask, gamma=1.0, lam=1.0)


def test_whitening_uses_valid_tokens_only() -> None:
    b = random_batch(B=8, T=7, seed=3)
    x = b["values"] * 5 + 3
    x = torch.where(b["mask"].bool(), x, torch.full_like(x, 1e6))  # garbage in the padding
    w = masked_whiten(x, b["mask"])
    valid = w[b["mask"].bool()]
    assert abs(float(valid.mean())) < 1e-9
    assert abs(float(valid.var(unbiased=True)) - 1.0) < 1e-6
    assert (w[~b["mask"].bool()] == 0).all()
    kept = masked_whiten(x, b["mask"], shift_mean=False)[b["mask"].bool()]
    assert abs(float(kept.mean()) - float(x[b["mask"].bool()].mean())) < 1e-6


def test_kl_penalty_on_every_token_and_score_on_the_last() -> None:
    b = random_batch()
    beta = 0.1
    rewards, kl = token_rewards(b["scores"], b["mask"], old_logprobs=b["old"], ref_logprobs=b["ref"], kl_coef=beta)
    for row, n in enumerate(b["lengths"].tolist()):
        k1 = (b["old"][row, :n] - b["ref"][row, :n]).double()  # token rewards are float64
        want = -beta * k1
        want[n - 1] += b["scores"][row]
        torch.testing.assert_close(rewards[row, :n], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(kl[row, :n], k1, rtol=0, atol=1e-6)
        assert (rewards[row, n:] == 0).all()
    plain, kl0 = token_rewards(b["scores"], b["mask"])
    assert (kl0 == 0).all()
    rows = torch.arange(len(b["lengths"]))
    assert torch.equal(plain[rows, b["lengths"] - 1], b["scores"].double())
    assert float(plain.sum()) == pytest.approx(float(b["scores"].sum()))


def test_kl_in_loss_instead_of_reward() -> None:
    b = random_batch()
    common = dict(old_logprobs=b["old"], kl_coef=0.5, gamma=1.0, lam=1.0, whiten=False)
    in_reward, _, m1 = compute_advantages(b["scores"], b["values"], b["mask"], ref_logprobs=b["ref"], kl_in_reward=True, **common)
    in_loss, _, m2 = compute_advantages(b["scores"], b["values"], b["mask"], ref_logprobs=b["ref"], kl_in_reward=False, **common)
    no_ref, _, _ = compute_advantages(b["scores"], b["values"], b["mask"], ref_logprobs=None, kl_in_reward=True, **common)
    assert torch.equal(in_loss, no_ref) and not torch.allclose(in_reward, in_loss)
    assert set(m1) == set(m2) == {"return", "value"}  # the step's kl, reward_mean, response_length are the loop's
    # as a loss: β · token-mean k3(π_θ, π_ref), differentiable in π_θ
    logp = b["old"].clone().requires_grad_(True)
    adv = torch.zeros_like(logp)
    loss, sums = policy_loss(logp, b["old"], adv, b["mask"], clip=0.2, ref_logprobs=b["ref"], kl_coef=0.5)
    metrics = sums.mean()
    want = 0.5 * masked_mean(kl_k3(b["old"], b["ref"]), b["mask"])
    assert float(loss.detach()) == pytest.approx(float(want), abs=1e-6)
    assert metrics["kl_ref_k3"] == pytest.approx(float(want) / 0.5, abs=1e-6)
    loss.backward()
    assert logp.grad is not None and (logp.grad[b["mask"] == 0] == 0).all()


def test_padding_may_hold_inf_and_nan() -> None:
    """Log-probs of padding can be −inf or nan: losses, metrics and gradients ignore them."""
    b = random_batch()
    pad = b["mask"] == 0
    adv = torch.randn(b["old"].shape, generator=torch.Generator().manual_seed(4))

    def run(dirty: bool) -> tuple[float, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
        junk = (lambda x, v: torch.where(pad, torch.full_like(x, v), x)) if dirty else (lambda x, v: x)
        logp = junk(b["old"] + 0.1, float("-inf")).requires_grad_(True)
        loss, sums = policy_loss(
            logp, junk(b["old"], float("nan")), junk(adv, float("nan")), b["mask"], clip=0.2,
            ref_logprobs=junk(b["ref"], float("inf")), kl_coef=0.1,
        )
        metrics = sums.mean()
        loss.backward()
        values = junk(b["values"], float("nan"))
        a, r, _ = compute_advantages(
            b["scores"], values, b["mask"], old_logprobs=junk(b["old"], float("nan")),
            ref_logprobs=junk(b["ref"], float("-inf")), kl_coef=0.1, kl_in_reward=True, gamma=1.0, lam=0.9,
        )
        return float(loss.detach()), metrics, logp.grad, a, r

    clean, dirty = run(False), run(True)
    assert clean[0] == pytest.approx(dirty[0], rel=1e-12) and clean[1] == dirty[1]
    for x, y in zip(clean[2:], dirty[2:]):
        assert torch.isfinite(y).all() and torch.equal(x, y)
    assert (dirty[2][pad] == 0).all()


EPS = 0.2


@pytest.mark.parametrize(
    "adv,ratio,clipped",
    [
        (1.0, 1 + EPS - 1e-3, False),  # just inside: gradient flows
        (1.0, 1 + EPS + 1e-3, True),  # above 1+ε with A>0: no gradient
        (1.0, 1 - EPS - 1e-3, False),  # below 1−ε with A>0: pessimistic branch, gradient flows
        (-1.0, 1 - EPS + 1e-3, False),
        (-1.0, 1 - EPS - 1e-3, True),  # below 1−ε with A<0: no gradient
        (-1.0, 1 + EPS + 1e-3, False),
    ],
)
def test_clipping_zeroes_the_gradient_outside_the_trust_region(adv: float, ratio: float, clipped: bool) -> None:
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([[ratio, 1.0]], dtype=torch.float64))).requires_grad_(True)
    advantages = torch.tensor([[adv, adv]], dtype=torch.float64)
    loss, sums = policy_loss(logp, old, advantages, mask, clip=EPS)
    metrics = sums.mean()
    loss.backward()
    g = logp.grad[0, 0].item()
    if clipped:
        assert g == 0.0
        assert metrics["clipfrac"] == pytest.approx(0.5)
    else:
        # d/dlogp of −A·ρ/2 (token-mean over 2 tokens) = −A·ρ/2
        assert g == pytest.approx(-adv * ratio / 2, rel=1e-9)
        assert metrics["clipfrac"] == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-adv / 2)


def test_policy_loss_token_mean_and_metrics() -> None:
    b = random_batch()
    logp = b["old"] + 0.05 * torch.randn(b["old"].shape, generator=torch.Generator().manual_seed(1))
    adv = torch.randn(b["old"].shape, generator=torch.Generator().manual_seed(2))
    loss, sums = policy_loss(logp, b["old"], adv, b["mask"], clip=10.0)  # nothing clipped
    metrics = sums.mean()
    ratio = torch.exp(logp - b["old"])
    m = b["mask"].bool()
    assert float(loss) == pytest.approx(float((-adv * ratio)[m].mean()), rel=1e-6)
    assert metrics["clipfrac"] == 0.0
    lr = (logp - b["old"])[m]
    assert metrics["approx_kl"] == pytest.approx(float((lr.exp() - 1 - lr).mean()), rel=1e-6)
    entropy = token_logprobs(torch.zeros(*b["old"].shape, 16), torch.zeros(b["old"].shape, dtype=torch.long), entropy=True)[1]
    torch.testing.assert_close(entropy, torch.full(b["old"].shape, float(torch.log(torch.tensor(16.0)))))  # uniform over 16
    loss_h, sums_h = policy_loss(logp, b["old"], adv, b["mask"], clip=10.0, entropy=entropy, entropy_coef=0.1)
    metrics_h = sums_h.mean()
    assert float(loss_h) == pytest.approx(float(loss) - 0.1 * float(torch.log(torch.tensor(16.0))), rel=1e-6)
    assert metrics_h["entropy"] == pytest.approx(float(torch.log(torch.tensor(16.0))), rel=1e-6)


def test_value_loss_clips_the_step_from_the_old_values() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    ret = torch.tensor([[1.0, -1.0, 5.0]])
    v = torch.tensor([[0.5, 0.5, 9.0]], requires_grad=True)
    loss, sums = value_loss(v, old, ret, mask, clip=0.2)
    metrics = sums.mean()
    # token 0: unclipped (0.5−1)² = 0.25 vs clipped (0.2−1)² = 0.64 → 0.64, no grad
    # token 1: unclipped (0.5+1)² = 2.25 vs clipped (0.2+1)² = 1.44 → 2.25, grad flows
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 2.25) / 2)
    assert metrics["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * 1.5 / 2, 0.0])


def test_minibatches_are_deterministic_partitions() -> None:
    a = list(minibatch_indices(12, 4, epochs=3, generator=torch.Generator().manual_seed(7)))
    b = list(minibatch_indices(12, 4, epochs=3, generator=torch.Generator().manual_seed(7)))
    assert len(a) == 9 and all(torch.equal(x, y) for x, y in zip(a, b))
    for epoch in range(3):
        assert sorted(torch.cat(a[epoch * 3 : epoch * 3 + 3]).tolist()) == list(range(12))
    assert not torch.equal(torch.cat(a[:3]), torch.cat(a[3:6]))
    with pytest.raises(ValueError, match="must divide"):
        list(minibatch_indices(10, 4, epochs=1, generator=torch.Generator()))


@pytest.mark.parametrize("kl_in_reward", [True, False])
def test_ppo_solves_a_four_arm_bandit(kl_in_reward: bool) -> None:
    """Learnable logits over 4 arms, arm 2 pays 1: PPO must move E[r] from 0.25 to > 0.9."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    baseline = torch.zeros(1, requires_grad=True)  # the critic
    opt = torch.optim.Adam([logits], lr=0.05)
    vopt = torch.optim.Adam([baseline], lr=0.05)
    ref = torch.log_softmax(torch.zeros(4), 0)
    B = 32
    mask = torch.ones(B, 1)
    assert float(logits.detach().softmax(0)[2]) == pytest.approx(0.25)
    for _ in range(100):
        with torch.no_grad():
            arms = torch.multinomial(torch.softmax(logits, 0), B, replacement=True, generator=g)
            old = torch.log_softmax(logits, 0)[arms][:, None]
            values = baseline.expand(B)[:, None].clone()
        scores = (arms == 2).float()
        adv, ret, _ = compute_advantages(
            scores, values, mask, old_logprobs=old, ref_logprobs=ref[arms][:, None],
            kl_coef=0.01, kl_in_reward=kl_in_reward, gamma=1.0, lam=0.95,
        )
        for idx in minibatch_indices(B, 16, epochs=2, generator=g):
            logp = torch.log_softmax(logits, 0)[arms[idx]][:, None]
            loss, _ = policy_loss(
                logp, old[idx], adv[idx], mask[idx], clip=0.2,
                ref_logprobs=None if kl_in_reward else ref[arms[idx]][:, None], kl_coef=0.01,
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            vloss, _ = value_loss(baseline.expand(len(idx))[:, None], values[idx], ret[idx], mask[idx], clip=0.2)
            vopt.zero_grad()
            vloss.backward()
            vopt.step()
    assert float(logits.detach().softmax(0)[2]) > 0.9
    assert float(baseline.detach()) > 0.5  # the critic followed the rising reward


# ---------------------------------------------------------------------------- aggregation

LENGTHS = [1, 4, 4, 4]


def unequal_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Responses of lengths [1, 4, 4, 4]: the case where a mean of means goes wrong."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]).to(torch.float64)
    old = -torch.rand(4, 4, generator=g, dtype=torch.float64) * 2
    return {
        "mask": mask,
        "old": old,
        "logp": old + 0.1 * torch.randn(4, 4, generator=g, dtype=torch.float64),
        "adv": torch.randn(4, 4, generator=g, dtype=torch.float64),
    }


def test_token_mean_weights_every_token_alike_and_the_per_sequence_means_do_not() -> None:
    m = unequal_batch()["mask"]
    tm, sm, ss = (loss_weights(m, agg) for agg in LOSS_AGG)
    assert tm[m.bool()].tolist() == [1 / 13] * 13
    assert sm[0, 0] == pytest.approx(1 / 4) and sm[1, 0] == pytest.approx(1 / 16)
    assert ss[m.bool()].tolist() == [1 / 16] * 13  # B = 4 rows, L = the mask's width 4
    assert loss_weights(m, "seq_mean_token_sum", max_length=8)[m.bool()].tolist() == [1 / 32] * 13
    assert all((w[~m.bool()] == 0).all() for w in (tm, sm, ss))
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        loss_weights(m, "token-mean")


@pytest.mark.parametrize("agg", LOSS_AGG)
@pytest.mark.parametrize("splits", [[2, 2], [1, 3], [1, 1, 1, 1], [3, 1]])
def test_split_batches_add_up_to_the_whole_loss_gradient_and_metrics(agg: str, splits: list[int]) -> None:
    """Σ over micro-batches of Σ w·ℓ with the whole batch's weights is the whole batch's loss,
    its gradient, and its metrics, however the rows are cut (a mean of means is not)."""
    b = unequal_batch()
    w = loss_weights(b["mask"], agg)
    logp = b["logp"].clone().requires_grad_(True)
    whole, whole_sums = policy_loss(logp, b["old"], b["adv"], b["mask"], clip=0.2, weights=w)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    total, sums, grad = 0.0, None, torch.zeros_like(logp)
    for rows in torch.arange(4).split(splits):
        part = logp[rows].detach().requires_grad_(True)
        loss, s = policy_loss(part, b["old"][rows], b["adv"][rows], b["mask"][rows], clip=0.2, weights=w[rows])
        (g,) = torch.autograd.grad(loss, part)
        grad[rows] = g
        total += float(loss.detach())
        sums = s if sums is None else sums + s
    assert total == pytest.approx(float(whole.detach()), rel=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-15)
    assert sums.mean() == pytest.approx(whole_sums.mean(), rel=1e-12)


def test_the_mean_of_micro_batch_means_is_what_token_mean_corrects() -> None:
    """[1, 4, 4, 4] cut in two: the mean of the halves' token-means gives the short row's
    token 1/10 (30% more than token_mean's 1/13) and the second half's tokens 1/16."""
    b = unequal_batch()
    logp = b["logp"].clone().requires_grad_(True)
    mean_of_means = sum(policy_loss(logp[r], b["old"][r], b["adv"][r], b["mask"][r], clip=0.2)[0] for r in ([0, 1], [2, 3])) / 2
    (g_old,) = torch.autograd.grad(mean_of_means, logp)
    token_mean, _ = policy_loss(logp, b["old"], b["adv"], b["mask"], clip=0.2, weights=loss_weights(b["mask"]))
    (g_new,) = torch.autograd.grad(token_mean, logp)
    per_token = lambda g: (g / (-b["adv"] * torch.exp(b["logp"] - b["old"]))).abs()  # noqa: E731  (nothing clipped here)
    assert float(per_token(g_new)[0, 0]) == pytest.approx(1 / 13) and float(per_token(g_new)[1, 0]) == pytest.approx(1 / 13)
    assert float(per_token(g_old)[0, 0]) == pytest.approx(1 / 10) and float(per_token(g_old)[2, 0]) == pytest.approx(1 / 16)


def test_value_loss_aggregates_like_the_policy_loss() -> None:
    b = unequal_batch(1)
    w = loss_weights(b["mask"], "seq_mean_token_mean")
    v = b["logp"].clone().requires_grad_(True)
    loss, sums = value_loss(v, b["old"], b["adv"], b["mask"], clip=0.2, weights=w)
    per_token = 0.5 * torch.maximum((v - b["adv"]) ** 2, (b["old"] + (v - b["old"]).clamp(-0.2, 0.2) - b["adv"]) ** 2)
    want = sum(float(per_token[i, :n].mean().detach()) for i, n in enumerate(LENGTHS)) / 4
    assert float(loss) == pytest.approx(want, rel=1e-12) and sums.mean()["loss"] == pytest.approx(want, rel=1e-12)


def test_a_wild_log_ratio_is_clamped_before_exp() -> None:
    mask = torch.ones(1, 2)
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]])
    loss, sums = policy_loss(logp, old, torch.tensor([[1.0, 1.0]]), mask, clip=0.2)
    assert torch.isfinite(loss) and sums.mean()["ratio"] == pytest.approx((math.exp(20.0) + 1) / 2, rel=1e-6)
