"""Log-probabilities and entropy from vocabulary-sharded logits (no rank holds all of V).

Under TP the output projection is column-parallel: TP rank t holds the logits of the
vocabulary rows [s_t, s_t + V_t) — ``torch.chunk`` pieces of ceil(V/tp) rows
(``reshard.derive.vocab_range``): the last shards may be shorter, or empty (V_t = 0). For
each position with logits z over the whole vocabulary and a target token a (Megatron's
vocab-parallel cross entropy, with the entropy added):

    M       = max_v z_v                          all-reduce MAX over the TP group
    S       = Σ_v exp(z_v − M)                    all-reduce SUM  ┐
    z_a     = the target's logit (0 off its rank) all-reduce SUM  ├ one stacked all-reduce
    E       = Σ_v exp(z_v − M) z_v                all-reduce SUM  ┘ (only with the entropy)
    log π(a) = z_a − M − log S
    H        = M + log S − E / S                  (= logsumexp z − Σ p z)

Uneven shards change nothing in these formulas: each rank reduces over its own columns,
whatever their number, and the collectives combine the partial results. An empty shard
contributes each reduction's identity — −inf to the MAX, 0 to the SUMs, and 0 as its
target logit, since no target falls in an empty range — so M, S, z_a and E are the same
as with every column on one rank, up to the order of the floating-point sums (exactly the
whole vocabulary's values where one rank holds all of it). Exactly one rank holds each
target (the ranges tile [0, V)). There are no padded columns, so nothing is masked.

Gradients, with p_v = exp(z_v − M) / S (each rank its own columns; the upstream
gradients are the same on every TP rank, because the loss after these all-reduces is):

    ∂ log π(a) / ∂z_v = [v = a] − p_v
    ∂ H / ∂z_v        = −p_v (z_v − E / S)

(an empty shard's gradient is empty). Memory per call: the float32 logits block and p,
both [..., V_t]: what ``trainer/controller/memory.py`` counts, at the largest V_t. With
``group=None`` the whole vocabulary is local and no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, slots=True)
class VocabShard:
    """Where this rank's logits sit in the vocabulary: columns [start, start + local size)
    of the full vocabulary, shared with the ranks of ``group`` (None: all of it is here)."""

    start: int = 0
    group: dist.ProcessGroup | None = None


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor, start: int, group, with_entropy: bool):  # noqa: ANN001
        local = z.shape[-1]
        # an empty shard (possible only when V ≤ (tp − 1)²: 5 rows over 4 ranks) holds MAX's identity
        m = z.detach().amax(-1) if local else torch.full(z.shape[:-1], float("-inf"), dtype=z.dtype, device=z.device)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        p = torch.sub(z.detach(), m[..., None]).exp_()  # one [.., V_t] block, exponentiated in place
        index = targets - start
        inside = (index >= 0) & (index < local)
        index = index.clamp(0, max(local - 1, 0))
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        picked = torch.where(inside, z.detach().gather(-1, index[..., None]).squeeze(-1), zero) if local else zero.expand(targets.shape)
        parts = [p.sum(-1), picked] + ([(p * z.detach()).sum(-1)] if with_entropy else [])
        sums = torch.stack(parts)
        if group is not None:
            dist.all_reduce(sums, group=group)
        s, z_a = sums[0], sums[1]
        lse = m + torch.log(s)
        p.div_(s[..., None])
        logp = z_a - lse
        entropy = lse - sums[2] / s if with_entropy else None
        ez = sums[2] / s if with_entropy else None
        ctx.save_for_backward(p, index, inside, z if with_entropy else None, ez)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):  # noqa: ANN001
        # grad = −p · (g_logp + g_H (z − E/S)) + [v = a] g_logp, written into p's own block
        # (backward runs once per graph), so the softmax is the only [.., V_t] block held
        p, index, inside, z, ez = ctx.saved_tensors
        g_logp = p.new_zeros(p.shape[:-1]) if g_logp is None else g_logp
        if g_entropy is not None and z is not None:
            coef = z.detach().sub(ez[..., None]).mul_(g_entropy[..., None]).add_(g_logp[..., None])
            grad = p.mul_(coef).neg_()
        else:
            grad = p.mul_(g_logp[..., None]).neg_()
        if grad.shape[-1]:  # an empty shard holds no target
            grad.scatter_add_(-1, index[..., None], torch.where(inside, g_logp, torch.zeros_like(g_logp))[..., None])
        return grad, None, None, None, None


def token_logprobs(
    logits: Tensor, targets: Tensor, shard: VocabShard = VocabShard(), *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """log π(targets) and (with ``entropy``) H(π) per position, from this rank's logits
    ``logits`` [..., V_t] (float32: compute them in float32 first) and token ids ``targets``
    [...] of the full vocabulary. Differentiable in ``logits``; every rank of
    ``shard.group`` calls it with the same targets (a collective)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree on the leading dims")
    return _TokenLogProbs.apply(logits, targets, shard.start, shard.group, entropy)
