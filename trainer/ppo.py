"""PPO with a learned critic, as pure tensor functions over right-padded response tokens.

Notation, per response b and response token t (shapes [B, T], mask m as in advantages.py,
n_b = Σ_t m_bt the response length, the last token at t = n_b − 1):

    π_θ  current policy      log-probs ``logprobs``       (differentiable)
    π_old sampling policy    log-probs ``old_logprobs``   (computed once per rollout)
    π_ref reference policy   log-probs ``ref_logprobs``
    V    critic values ``values`` (old, per token, before the token is emitted)
    R_b  task reward of response b (``scores``, one float)

1. Token rewards. With the KL penalty in the reward (``kl_in_reward=True``, InstructGPT):

        r_bt = −β · (log π_old − log π_ref)_bt · m_bt  +  R_b · [t = n_b − 1]

   (k1 estimator, coefficient β = ``kl_coef``). With ``kl_in_reward=False`` r_bt is just the
   task reward on the last token and the KL enters the loss instead (step 4).

2. GAE(γ, λ) within each response, the critic bootstrapping to 0 after the last token:

        δ_t = r_t + γ V_{t+1} m_{t+1} − V_t
        A_t = (δ_t + γ λ A_{t+1}) m_t,      A_T = 0
        G_t = A_t + V_t                      (returns, the critic's targets)

   then the advantages are whitened over all valid tokens of the batch (``whiten``).

3. Clipped surrogate, token-mean over the mask, with ratio ρ_t = exp(log π_θ − log π_old):

        L_pg = mean_m( max(−A ρ, −A clip(ρ, 1−ε, 1+ε)) )

   Where the clipped branch wins the token contributes no gradient. Metrics: clip fraction
   (tokens where it wins) and approx-KL(π_old‖π_θ) = mean_m(ρ − 1 − log ρ) (k3).

4. Optional loss terms: + β mean_m(k3(log π_θ, log π_ref)) when the KL is a loss rather
   than a reward; − c_H mean_m(H_t) for an entropy bonus.

5. Clipped value loss (separate critic), with V' the critic's new values:

        L_V = ½ mean_m( max((V' − G)², (V_old + clip(V' − V_old, −c, c) − G)²) )

Shortcuts: one task reward per response (no per-token rewards from the task); the KL of the
reward is the k1 sample estimate on sampled tokens, not the full-vocabulary KL; the critic
is a separate model (no shared trunk, so no value coefficient is needed).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .advantages import check_mask, kl_k1, kl_k3, masked_mean, masked_whiten, zero_pad


def last_token_index(mask: Tensor) -> Tensor:
    """Index of each row's last valid token; raises on empty responses."""
    lengths = mask.sum(dim=1).long()
    if bool((lengths == 0).any()):
        rows = (lengths == 0).nonzero().flatten().tolist()
        raise ValueError(f"responses {rows} are empty: every response needs at least one token")
    return lengths - 1


def token_rewards(
    scores: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards r [B, T] (step 1) and the per-token k1 KL [B, T] (zeros without a reference).

    Pass ``ref_logprobs`` only when the KL belongs in the reward (``kl_in_reward``)."""
    check_mask(mask)
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    kl = torch.zeros_like(rewards)
    if ref_logprobs is not None:
        if old_logprobs is None:
            raise ValueError("the KL penalty needs old_logprobs beside ref_logprobs")
        check_mask(mask, old_logprobs, ref_logprobs)
        kl = zero_pad(kl_k1(old_logprobs, ref_logprobs).float(), mask)
        rewards = rewards - kl_coef * kl
    last = last_token_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages and returns by GAE(γ, λ) (step 2), both [B, T] and zero on padding."""
    check_mask(mask, rewards, values)
    m = mask.to(rewards.dtype)
    rewards, values = zero_pad(rewards, m), zero_pad(values.to(rewards.dtype), m)
    T = rewards.shape[1]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m[:, t]
        adv[:, t] = running
    return adv, zero_pad(adv + values, m)


def compute_advantages(
    scores: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    kl_coef: float,
    kl_in_reward: bool,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Steps 1–2: (advantages, returns, metrics) from task scores [B] and the rollout tensors."""
    in_reward = ref_logprobs if kl_in_reward else None
    rewards, kl = token_rewards(scores, mask, old_logprobs=old_logprobs, ref_logprobs=in_reward, kl_coef=kl_coef)
    adv, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    m = mask.to(rewards.dtype)
    metrics = {
        "score": float(scores.float().mean()),
        "kl_ref_k1": float(masked_mean(kl, m)) if in_reward is not None else 0.0,
        "response_len": float(m.sum(1).mean()),
        "return": float(masked_mean(returns, m)),
        "value": float(masked_mean(values.to(m.dtype), m)),
    }
    return adv, returns, metrics


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip: float,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Steps 3–4: clipped surrogate (+ β·k3 KL to the reference, − c_H·entropy), token-mean.

    ``advantages`` is [B, T], or [B] for one advantage per response (GRPO), broadcast over
    the valid tokens. Shared by PPO and GRPO."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(mask)
    check_mask(mask, logprobs, old_logprobs, advantages)
    m = mask.to(logprobs.dtype)
    log_ratio = zero_pad(logprobs - old_logprobs, m)
    ratio = torch.exp(log_ratio)
    adv = zero_pad(advantages.to(logprobs.dtype).detach(), m)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    pg_loss = masked_mean(torch.maximum(unclipped, clipped), m)
    loss = pg_loss
    with torch.no_grad():
        metrics = {
            "pg_loss": float(pg_loss),
            "clipfrac": float(masked_mean((clipped > unclipped).to(m.dtype), m)),
            "approx_kl": float(masked_mean(ratio - 1 - log_ratio, m)),
            "ratio": float(masked_mean(ratio, m)),
        }
    if ref_logprobs is not None and kl_coef:
        kl = masked_mean(kl_k3(zero_pad(logprobs, m), zero_pad(ref_logprobs.to(logprobs.dtype), m)), m)
        loss = loss + kl_coef * kl
        metrics["kl_ref_k3"] = float(kl.detach())
    if entropy is not None:
        ent = masked_mean(entropy, m)
        loss = loss - entropy_coef * ent
        metrics["entropy"] = float(ent.detach())
    return loss, metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float
) -> tuple[Tensor, dict[str, float]]:
    """Step 5: ½ token-mean of the larger of the unclipped and clipped squared errors."""
    check_mask(mask, values, old_values, returns)
    m = mask.to(values.dtype)
    old, ret = zero_pad(old_values.to(values.dtype).detach(), m), zero_pad(returns.to(values.dtype).detach(), m)
    clipped_values = old + torch.clamp(values - old, -clip, clip)
    err = (values - ret) ** 2
    err_clipped = (clipped_values - ret) ** 2
    loss = 0.5 * masked_mean(torch.maximum(err, err_clipped), m)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(loss),
            "vf_clipfrac": float(masked_mean((err_clipped > err).to(m.dtype), m)),
        }
    return loss, metrics
