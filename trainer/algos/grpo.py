"""GRPO: group-relative advantages, PPO's clipped surrogate, no critic.

Each prompt is sampled G times; a batch of B = P·G responses keeps the G samples of one
prompt contiguous (rows p·G … p·G + G − 1). With R_{p,i} the task reward of sample i of
prompt p (Shao et al., DeepSeekMath, 2024):

    A_{p,i} = (R_{p,i} − mean_i R_{p,·}) / (std_i R_{p,·} + eps)     (std Bessel-corrected)

or, with ``scale_by_std=False``, A_{p,i} = R_{p,i} − mean_i R_{p,·}. A_{p,i} applies to
every valid token of response (p, i). The loss is PPO's clipped surrogate (ppo.policy_loss)
with ratio ρ_t = exp(log π_θ − log π_old), plus the reference KL as a loss term with the k3
estimator, aggregated over the mini-batch by ``loss_agg`` (ppo.py, "Aggregation"):

    L = Σ_bt w_bt [ max(−A ρ, −A clip(ρ, 1−ε, 1+ε)) + β (exp(r − l) − 1 − (r − l)) ]

where l = log π_θ and r = log π_ref on the sampled tokens. The default ``token_mean``
(w = m / Σ m, as DAPO) weighs every token alike; the paper's per-sequence mean is
``seq_mean_token_mean``. Dr. GRPO (Liu et al., 2025) is ``scale_by_std=False`` together
with ``loss_agg: seq_mean_token_sum``: no std in the advantage, and token sums divided by
the constant B · ``rollout.max_new_tokens`` instead of by the response lengths.

Shortcuts: a group whose samples all score the same gets advantage 0 and contributes only
through the KL term.
"""

from __future__ import annotations

from torch import Tensor


def group_advantages(
    scores: Tensor, group_size: int, *, scale_by_std: bool = True, eps: float = 1e-4
) -> tuple[Tensor, dict[str, float]]:
    """Per-response advantages [B] from task scores [B] in contiguous groups of ``group_size``."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {tuple(scores.shape)}")
    if group_size < 2 or scores.numel() % group_size:
        raise ValueError(f"group_size={group_size} must be >= 2 and divide the batch of {scores.numel()} scores")
    groups = scores.float().view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    adv = groups - mean
    if scale_by_std:
        adv = adv / (std + eps)
    metrics = {
        "group_std": float(std.mean()),
        "zero_std_frac": float((std.flatten() == 0).float().mean()),
    }
    return adv.flatten(), metrics
