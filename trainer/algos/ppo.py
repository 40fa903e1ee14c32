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

3. Clipped surrogate with ratio ρ_t = exp(clamp(log π_θ − log π_old, −20, 20)) (the clamp
   keeps a wild log-ratio from overflowing exp; it binds only far outside the trust region):

        ℓ_pg,t = max(−A ρ, −A clip(ρ, 1−ε, 1+ε))

   Where the clipped branch wins the token contributes no gradient. Metrics: clip fraction
   (tokens where it wins) and approx-KL(π_old‖π_θ) = ρ − 1 − log ρ (k3), token-means.

4. Optional loss terms per token: + β k3(log π_θ, log π_ref) when the KL is a loss rather
   than a reward; − c_H H_t for an entropy bonus.

5. Clipped value loss (separate critic), with V' the critic's new values:

        ℓ_V,t = ½ max((V' − G)², (V_old + clip(V' − V_old, −c, c) − G)²)

Aggregation — the one rule every loss of the trainer follows. A mini-batch's loss is a
weighted sum over all its response tokens, L = Σ_bt w_bt ℓ_bt, with weights fixed by the
*global* mini-batch (all rows of all DP replicas; ``loss_weights``):

    token_mean            w_bt = m_bt / Σ_b'n_b'          (default; verl's "token-mean")
    seq_mean_token_mean   w_bt = m_bt / (n_b · B)          (each response weighs 1/B)
    seq_mean_token_sum    w_bt = m_bt / (B · L)            (Dr. GRPO: a constant normaliser)

(B the mini-batch's rows, n_b row b's response length, L the longest response a rollout
may produce, ``rollout.max_new_tokens``: Dr. GRPO's constant, so that the gradient's
scale, and with it gradient clipping, does not grow with the mean response length.) L is linear in the per-token
losses, so it splits exactly: each micro-batch of each replica adds Σ w ℓ over its own
rows, the backward passes add gradients, and the data-parallel gradient sync SUMS (it never
averages averages). The result is the same loss and the same gradient under every dp, tp,
pp and micro-batch size, up to floating-point reduction order. Metrics follow the same
rule: the loss terms add their weighted sums (``LossSums.loss``), token statistics add
Σ m x and Σ m (``LossSums.token``, ``LossSums.tokens``), over every micro-batch of every
replica, finished once per step (``LossSums.mean``).

Shortcuts: one task reward per response (no per-token rewards from the task); the KL of the
reward is the k1 sample estimate on sampled tokens, not the full-vocabulary KL; the critic
is a separate model (no shared trunk, so no value coefficient is needed).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    rewards = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)  # cheap [B, T]: float64
    kl = torch.zeros_like(rewards)
    if ref_logprobs is not None:
        if old_logprobs is None:
            raise ValueError("the KL penalty needs old_logprobs beside ref_logprobs")
        check_mask(mask, old_logprobs, ref_logprobs)
        kl = zero_pad(kl_k1(old_logprobs.double(), ref_logprobs.double()), mask)
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
    old_logprobs: Tensor | None,
    ref_logprobs: Tensor | None,
    kl_coef: float,
    kl_in_reward: bool,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Steps 1–2: (advantages, returns, metrics) from task scores [B] and the rollout tensors.

    ``old_logprobs`` may be None when the KL is not in the reward (the on-policy shortcut
    of ``trainer/runtime/step.py`` then never computes them). The metrics are the ones only this
    step knows (``return``, ``value``); the step's ``reward_mean``, ``kl`` and
    ``response_length`` are the loop's."""
    in_reward = ref_logprobs if kl_in_reward else None
    rewards, _ = token_rewards(scores, mask, old_logprobs=old_logprobs, ref_logprobs=in_reward, kl_coef=kl_coef)
    adv, returns = gae(rewards, values, mask, gamma=gamma, lam=lam)
    if whiten:
        adv = masked_whiten(adv, mask)
    m = mask.to(rewards.dtype)
    metrics = {
        "return": float(masked_mean(returns, m)),
        "value": float(masked_mean(values.to(m.dtype), m)),
    }
    return adv, returns, metrics


LOSS_AGG = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
LOG_RATIO_CLAMP = 20.0


def loss_weights(mask: Tensor, loss_agg: str = "token_mean", *, max_length: int | None = None) -> Tensor:
    """The aggregation weights w [B, T] of a whole mini-batch (module docstring), float64,
    zero on padding; Σ w = 1 for the two means, = mean length / L for the token sum
    (``max_length`` = L, default the mask's width)."""
    check_mask(mask)
    m = mask.to(torch.float64)
    if loss_agg == "token_mean":
        return m / m.sum().clamp(min=1)
    if loss_agg == "seq_mean_token_mean":
        return m / (m.sum(1, keepdim=True).clamp(min=1) * m.shape[0])
    if loss_agg == "seq_mean_token_sum":
        return m / (m.shape[0] * (max_length or m.shape[1]))
    raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGG)}; got {loss_agg!r}")


@dataclass(frozen=True, slots=True)
class LossSums:
    """Additive statistics of one micro-batch's loss, combined over micro-batches and
    replicas by ``+`` and finished once (module docstring, "Aggregation").

    ``loss``: Σ w x of each loss term (over a whole mini-batch: that term's value);
    ``token``: Σ m x of each per-token statistic; ``tokens``: Σ m. 0-d float64 tensors."""

    loss: dict[str, Tensor]
    token: dict[str, Tensor]
    tokens: Tensor

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(
            loss={k: v + other.loss[k] for k, v in self.loss.items()},
            token={k: v + other.token[k] for k, v in self.token.items()},
            tokens=self.tokens + other.tokens,
        )

    def tensors(self) -> dict[str, Tensor]:
        """Flat ``{"loss/k": .., "token/k": .., "tokens": ..}`` (for one collective)."""
        return {**{f"loss/{k}": v for k, v in self.loss.items()}, **{f"token/{k}": v for k, v in self.token.items()}, "tokens": self.tokens}

    def mean(self, minibatches: int = 1) -> dict[str, float]:
        """Loss terms averaged over the ``minibatches`` summed in; token statistics as
        token-means over every token summed in."""
        n = max(float(self.tokens), 1.0)
        return {**{k: float(v) / minibatches for k, v in self.loss.items()}, **{k: float(v) / n for k, v in self.token.items()}}


def _sums(mask: Tensor, weights: Tensor, loss: dict[str, Tensor], token: dict[str, Tensor]) -> LossSums:
    """LossSums of per-token terms [B, T] (detached; padding ignored by selection)."""
    m = mask.bool()
    return LossSums(
        loss={k: zero_pad(v.detach().double() * weights, m).sum() for k, v in loss.items()},
        token={k: zero_pad(v.detach().double(), m).sum() for k, v in token.items()},
        tokens=m.sum().double(),
    )


def _weights(mask: Tensor, weights: Tensor | None, dtype: torch.dtype) -> Tensor:
    w = loss_weights(mask) if weights is None else weights
    check_mask(mask, w)
    return w.to(dtype)


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip: float,
    weights: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, LossSums]:
    """Steps 3–4: Σ w (ℓ_pg + β·k3 KL to the reference − c_H·entropy) and its LossSums.

    ``weights``: this micro-batch's rows of the mini-batch's ``loss_weights`` (None: the
    token-mean of these rows alone).

    The log-ratio is clamped to ±20 before ``exp``: a token past it gets no gradient (like a
    clipped one), and its ratio metric saturates at e^20 — a policy that far from π_old has
    diverged, which the ratio and approx-KL metrics show. ``advantages`` is [B, T], or [B] for one advantage per
    response (GRPO), broadcast over the valid tokens. Shared by PPO and GRPO."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(mask)
    check_mask(mask, logprobs, old_logprobs, advantages)
    w = _weights(mask, weights, logprobs.dtype)
    m = mask.bool()
    log_ratio = zero_pad(logprobs - old_logprobs, m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = zero_pad(advantages.to(logprobs.dtype).detach(), m)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    pg = torch.maximum(unclipped, clipped)
    per_token = pg
    terms = {}  # the policy-gradient term by itself, where the loss has others (else it is ``loss``)
    stats = {"clipfrac": (clipped > unclipped).to(logprobs.dtype), "approx_kl": ratio - 1 - log_ratio, "ratio": ratio}
    if ref_logprobs is not None and kl_coef:
        kl = kl_k3(zero_pad(logprobs, m), zero_pad(ref_logprobs.to(logprobs.dtype), m))
        per_token = per_token + kl_coef * kl
        stats["kl_ref_k3"] = kl
    if entropy is not None:
        per_token = per_token - entropy_coef * entropy
        stats["entropy"] = entropy
    if per_token is not pg:
        terms["pg_loss"] = pg
    loss = zero_pad(per_token * w, m).sum()
    return loss, _sums(mask, w.double(), {"loss": per_token, **terms}, stats)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float, weights: Tensor | None = None
) -> tuple[Tensor, LossSums]:
    """Step 5: Σ w ½ max(unclipped, clipped squared error) and its LossSums."""
    check_mask(mask, values, old_values, returns)
    w = _weights(mask, weights, values.dtype)
    m = mask.bool()
    old, ret = zero_pad(old_values.to(values.dtype).detach(), m), zero_pad(returns.to(values.dtype).detach(), m)
    # inside the clip range the clipped branch IS ``values`` (bit for bit: old + (v − old)
    # would round differently and make the clip fraction count rounding noise)
    clipped_values = torch.where((values - old).abs() > clip, old + torch.clamp(values - old, -clip, clip), values)
    err = (values - ret) ** 2
    err_clipped = (clipped_values - ret) ** 2
    per_token = 0.5 * torch.maximum(err, err_clipped)
    loss = zero_pad(per_token * w, m).sum()
    stats = {"vf_clipfrac": (err_clipped > err).to(values.dtype)}
    return loss, _sums(mask, w.double(), {"loss": per_token}, stats)
