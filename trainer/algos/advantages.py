"""Token-level maths shared by PPO and GRPO: masked statistics, whitening, KL estimators
and mini-batches (pure tensor functions, no model code; the entropy of the policy comes
from the vocabulary-sharded logits, ``trainer/parallel/vocab_parallel.py``).

Shapes: a batch is ``B`` responses right-padded to ``T`` tokens. ``mask[b, t]`` is 1 for a
real response token (the final EOS included) and 0 for padding; every row's mask is a
prefix of ones. Statistics are over the valid tokens of the whole batch ("token-mean"):

    mean_m(x) = Σ_{b,t} m_{bt} x_{bt} / Σ_{b,t} m_{bt}
    var_m(x)  = Σ m (x − mean_m(x))² / (Σ m − 1)            (Bessel-corrected)
    whiten(x) = (x − mean_m(x)) / sqrt(var_m(x) + eps) · m    (padding stays 0)

KL between the sampling policy π (log-probs ``logp``) and the reference π_ref (``ref``),
per sampled token a ~ π, with log-ratio ρ = logp − ref (Schulman, "Approximating KL
divergence", 2020):

    k1 = ρ                        unbiased, can be negative; PPO's reward penalty
    k3 = exp(−ρ) − 1 + ρ  ≥ 0     unbiased, low variance; GRPO's loss term
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def check_mask(mask: Tensor, *like: Tensor) -> None:
    """Raise unless ``mask`` is [B, T], matches ``like`` and is a prefix of ones per row."""
    if mask.dim() != 2:
        raise ValueError(f"response mask must be [B, T], got shape {tuple(mask.shape)}")
    for x in like:
        if x.shape != mask.shape:
            raise ValueError(f"tensor of shape {tuple(x.shape)} does not match the mask {tuple(mask.shape)}")
    m = mask.to(torch.int8)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("response mask must be right-padded: ones then zeros in every row")


def zero_pad(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with padding set to 0 by selection, not by product: padding may hold inf or nan
    (log-probs of masked tokens), and gradients do not flow into it."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Token-mean of ``x`` over ``mask``; 0 when the mask is empty."""
    return zero_pad(x, mask).sum() / mask.sum().clamp(min=1)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Bessel-corrected variance of ``x`` over the valid tokens."""
    n = mask.sum()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens, got {int(n)}")
    mean = masked_mean(x, mask)
    return zero_pad((x - mean) ** 2, mask).sum() / (n - 1)


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Zero-mean, unit-variance over the valid tokens; with ``shift_mean=False`` the mean is kept."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return zero_pad(out, mask)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k1 = log π − log π_ref."""
    return logprobs - ref_logprobs


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 = exp(ref − logp) − 1 − (ref − logp) ≥ 0; differentiable in ``logprobs``."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - 1 - d


def minibatch_indices(
    batch_size: int, minibatch_size: int, *, epochs: int, generator: torch.Generator
) -> Iterator[Tensor]:
    """Index mini-batches for ``epochs`` passes: a fresh permutation of ``range(batch_size)``
    per epoch drawn from ``generator``, cut into ``batch_size / minibatch_size`` equal pieces.
    Same generator state → same sequence, on every rank."""
    if minibatch_size < 1 or batch_size % minibatch_size:
        raise ValueError(f"minibatch_size={minibatch_size} must divide the batch of {batch_size} samples")
    for _ in range(epochs):
        perm = torch.randperm(batch_size, generator=generator)
        yield from perm.split(minibatch_size)
