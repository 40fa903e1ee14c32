"""Log-probs and entropy from vocabulary-sharded logits equal the whole vocabulary's, with
the same gradients, on one process and split over 2 and 4 gloo ranks: in equal shards, and
in ``torch.chunk``'s uneven ones (the last shorter; with 5 columns over 4 ranks the last
rank's shard is empty)."""

from __future__ import annotations

import pytest
import torch

from nereus.trainer.parallel.vocab_parallel import VocabShard, token_logprobs
from tests.distributed_harness import run_distributed

V = 12


def reference(z: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def data(seed: int = 0, vocab: int = V):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(3, 5, vocab, generator=g, dtype=torch.float64) * 4
    return z, torch.randint(0, vocab, (3, 5), generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)


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


# per world size, the vocabularies split over it: equal shards, uneven ones, and (5 over 4:
# 2, 2, 1, 0 columns) a rank with none; the targets then fall on every non-empty rank
VOCABS = {2: [12, 11], 4: [12, 10, 5]}


def columns(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s columns: ``torch.chunk`` of the vocabulary, empty ones last."""
    pieces = torch.arange(vocab).chunk(world)
    if rank >= len(pieces):
        return vocab, vocab
    return int(pieces[rank][0]), int(pieces[rank][-1]) + 1


def _sharded(rank: int, world: int) -> list[tuple]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    out = []
    for vocab in VOCABS[world]:
        z, targets, g_logp, g_h = data(vocab=vocab)
        start, stop = columns(vocab, world, rank)
        local = z[..., start:stop].clone().requires_grad_(True)
        logp, h = token_logprobs(local, targets, VocabShard(start=start, group=group), entropy=True)
        ((logp * g_logp).sum() + (h * g_h).sum()).backward()
        alone = local.detach().clone().requires_grad_(True)  # log-probs without the entropy: the other backward
        lp_only, _ = token_logprobs(alone, targets, VocabShard(start=start, group=group))
        (lp_only * g_logp).sum().backward()
        out.append((logp.detach(), h.detach(), local.grad, lp_only.detach(), alone.grad))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_vocabulary_gives_the_whole_ones_values_and_gradients(world: int) -> None:
    results = run_distributed(_sharded, world, timeout=100)
    for i, vocab in enumerate(VOCABS[world]):
        z, targets, g_logp, g_h = data(vocab=vocab)
        z = z.requires_grad_(True)
        ref_logp, ref_h = reference(z, targets)
        (want_alone,) = torch.autograd.grad((ref_logp * g_logp).sum(), z, retain_graph=True)
        ((ref_logp * g_logp).sum() + (ref_h * g_h).sum()).backward()
        for rank, per_vocab in enumerate(results):
            logp, h, grad, lp_only, grad_alone = per_vocab[i]
            start, stop = columns(vocab, world, rank)
            where = f"V={vocab} over {world}, rank {rank} (columns {start}..{stop})"
            torch.testing.assert_close(logp, ref_logp.detach(), rtol=0, atol=1e-12, msg=where)  # the same on every TP rank
            torch.testing.assert_close(lp_only, ref_logp.detach(), rtol=0, atol=1e-12, msg=where)
            torch.testing.assert_close(h, ref_h.detach(), rtol=0, atol=1e-12, msg=where)
            assert grad.shape == (3, 5, stop - start), where
            torch.testing.assert_close(grad, z.grad[..., start:stop], rtol=0, atol=1e-12, msg=where)
            torch.testing.assert_close(grad_alone, want_alone[..., start:stop], rtol=0, atol=1e-12, msg=where)
    assert columns(5, 4, 3) == (5, 5) and columns(10, 4, 3) == (9, 10)  # an empty shard, a short one
