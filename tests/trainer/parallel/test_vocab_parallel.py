"""Log-probs and entropy from vocabulary-sharded logits equal the whole vocabulary's, with
the same gradients, on one process and split over 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from nereus.trainer.parallel.vocab_parallel import VocabShard, token_logprobs
from tests.distributed_harness import run_distributed

V = 12


def reference(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 4
    return z, torch.randint(0, V, (3, 5), generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("entropy", [False, True])
def test_whole_vocabulary_matches_log_softmax_and_its_gradient(entropy: bool) -> None:
    z, targets, g_logp, g_h = data()
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    logp, h = token_logprobs(z1, targets, entropy=entropy)
    ref_logp, ref_h = reference(z2, targets)
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-12)
    assert (h is None) != entropy
    loss = (logp * g_logp).sum() + ((h * g_h).sum() if entropy else 0)
    ref = (ref_logp * g_logp).sum() + ((ref_h * g_h).sum() if entropy else 0)
    if entropy:
        torch.testing.assert_close(h, ref_h, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, z1)
    (want,) = torch.autograd.grad(ref, z2)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


def test_mismatched_targets_are_refused() -> None:
    with pytest.raises(ValueError, match=r"logits \(3, 5, 12\) and targets \(3, 4\)"):
        token_logprobs(torch.zeros(3, 5, V), torch.zeros(3, 4, dtype=torch.long))


def _sharded(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    z, targets, g_logp, g_h = data()
    cols = V // world
    local = z[..., rank * cols : (rank + 1) * cols].clone().requires_grad_(True)
    group = dist.new_group(list(range(world)))
    logp, h = token_logprobs(local, targets, VocabShard(start=rank * cols, group=group), entropy=True)
    ((logp * g_logp).sum() + (h * g_h).sum()).backward()
    return logp.detach(), h.detach(), local.grad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_vocabulary_gives_the_whole_ones_values_and_gradients(world: int) -> None:
    z, targets, g_logp, g_h = data()
    z = z.requires_grad_(True)
    ref_logp, ref_h = reference(z, targets)
    ((ref_logp * g_logp).sum() + (ref_h * g_h).sum()).backward()
    results = run_distributed(_sharded, world, timeout=100)
    cols = V // world
    for rank, (logp, h, grad) in enumerate(results):
        torch.testing.assert_close(logp, ref_logp.detach(), rtol=0, atol=1e-12)  # the same on every TP rank
        torch.testing.assert_close(h, ref_h.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(grad, z.grad[..., rank * cols : (rank + 1) * cols], rtol=0, atol=1e-12)
