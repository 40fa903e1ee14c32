"""Parallel model-stages (TP, PP, DP/FSDP2) against one process, element by element.

Two spawned 4-rank gloo runs carry most checks (spawning costs far more than the tiny
models): one trains every parallel config for one step and compares loss, every gradient
and every parameter after AdamW with a single-process model; the other writes reshard's
reference values into ``stage_buffers`` and compares the forward with a full model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nereus.reshard.derive import DecoderSpec, derive_emus
from nereus.reshard.errors import LayoutError, ProcessGroupError
from nereus.reshard.layout import ParallelConfig, box_view, local_buffers
from nereus.reshard.reference import fill_reference, reference_box
from nereus.trainer.models.decoder import ModelArgs, build_model, init_weights
from nereus.trainer.parallel.groups import plan_groups, stage_groups
from nereus.trainer.parallel.parallelize import (
    ReplicatedKVHead,
    VocabParallelEmbedding,
    build_stage,
    init_stage,
    optimizer_buffers,
    plan_stage_modules,
    plan_tp,
    stage_buffers,
    stage_grads,
)
from nereus.trainer.parallel.pipeline import forward, forward_backward, sync_grads
from nereus.trainer.parallel.vocab_parallel import VocabShard, token_logprobs
from tests.distributed_harness import run_distributed

# GQA (kv=2: split at tp=2, one head copied twice at tp=4), 3 layers (uneven pp ranges).
LLAMA = ModelArgs(
    spec=DecoderSpec(vocab_size=32, hidden_size=16, intermediate_size=20, num_layers=3, num_heads=4, num_kv_heads=2),
    model_type="llama",
)
# Qwen2-style: qkv bias, tied embeddings, a single KV head (copied on every TP rank).
QWEN = ModelArgs(
    spec=DecoderSpec(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=1,
        qkv_bias=True, tie_embeddings=True,
    ),
    model_type="qwen2",
)
# Value head with odd sizes: dp=4 chunks are uneven, and some are empty (k/v, score).
VALUE = ModelArgs(
    spec=DecoderSpec(
        vocab_size=30, hidden_size=12, intermediate_size=18, num_layers=2, num_heads=2, num_kv_heads=1, head="value"
    ),
)
# Vocabularies no TP degree here divides: 21 rows (tp=2: 11 + 10; tp=4: 6, 6, 6, 3), and a
# tied 5-row one whose tp=4 shards are 2, 2, 1 and EMPTY (rank 3 holds no vocabulary row).
ODD = ModelArgs(spec=dataclasses.replace(LLAMA.spec, vocab_size=21), model_type="llama")
TINY_VOCAB = ModelArgs(spec=dataclasses.replace(QWEN.spec, vocab_size=5), model_type="qwen2")
MODELS = {"llama": LLAMA, "qwen": QWEN, "value": VALUE, "odd": ODD, "tiny_vocab": TINY_VOCAB}
B, T, SEED = 8, 6, 0
LR, EPS = 1e-3, 1e-6  # eps >> float noise on gradients that are 0 in exact arithmetic (k bias)


def make_batch(vocab: int = 30) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 30, (B, T), generator=g) % vocab
    mask = torch.ones(B, T, dtype=torch.bool)
    for row, pad in enumerate([0, 2, 1, 0, 3, 0, 1, 2]):
        mask[row, :pad] = False
    return {"input_ids": ids, "attention_mask": mask}


def token_loss(norm: float, vocab: VocabShard = VocabShard()):
    """Sum of next-token cross-entropy over real (token, next token) pairs, divided by
    ``norm``, from this rank's vocabulary columns of the logits."""

    def loss_fn(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        pairs = mb["attention_mask"][:, :-1] & mb["attention_mask"][:, 1:]
        return -(next_token_logprobs(vocab)(logits, mb) * pairs).sum() / norm

    return loss_fn


def chunk_sizes(vocab: int, tp: int) -> list[int]:
    """Rows per TP rank of a vocab-parallel tensor: ``torch.chunk``'s pieces, empty ones last."""
    pieces = [len(c) for c in torch.arange(vocab).chunk(tp)]
    return pieces + [0] * (tp - len(pieces))


def pair_count(batch) -> int:
    return int((batch["attention_mask"][:, :-1] & batch["attention_mask"][:, 1:]).sum())


def next_token_logprobs(vocab: VocabShard = VocabShard()):
    """log p(next token) [b, T-1]: what an RL inference stage keeps instead of the logits."""
    return lambda logits, mb: token_logprobs(logits[:, :-1].float(), mb["input_ids"][:, 1:], vocab)[0]


# ------------------------------------------------------------------------ pure planning


def test_plan_groups_orders_and_extra_groups():
    c = ParallelConfig(dp=2, tp=2, pp=2, ranks=(7, 6, 5, 4, 3, 2, 1, 0))
    g = plan_groups(c, QWEN.spec)  # kv=1 < tp=2: copies group = tp group; tied: embed groups
    assert g["tp"] == [(7, 6), (5, 4), (3, 2), (1, 0)]
    assert g["pp"] == [(7, 5), (6, 4), (3, 1), (2, 0)]
    assert g["dp"] == [(7, 3), (6, 2), (5, 1), (4, 0)]
    assert g["kv"] == g["tp"]
    assert g["embed"] == g["pp"]
    g4 = plan_groups(ParallelConfig.on(tp=4), LLAMA.spec)
    assert g4["kv"] == [(0, 1), (2, 3)] and g4["embed"] == []
    assert plan_groups(ParallelConfig.on(tp=2, pp=2), LLAMA.spec)["kv"] == []


def test_plan_stage_modules():
    assert plan_stage_modules(LLAMA.spec, 2) == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1"],
        ["model.layers.2", "model.norm", "lm_head"],
    ]
    assert plan_stage_modules(QWEN.spec, 2)[1] == ["model.embed_tokens", "model.layers.1", "model.norm"]
    whole = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "score"]
    assert plan_stage_modules(VALUE.spec, 1) == [whole]


def test_plan_tp_styles():
    assert isinstance(plan_tp(LLAMA.spec, 4)["model.layers.*.self_attn.k_proj"], ReplicatedKVHead)
    assert not isinstance(plan_tp(LLAMA.spec, 2)["model.layers.*.self_attn.k_proj"], ReplicatedKVHead)
    tied = plan_tp(QWEN.spec, 2)
    assert "lm_head" not in tied and "" in tied and "model.norm" in tied
    assert "lm_head" not in plan_tp(VALUE.spec, 2)
    with pytest.raises(LayoutError, match="tp=3"):
        plan_tp(LLAMA.spec, 3)
    assert isinstance(plan_tp(ODD.spec, 4)["model.embed_tokens"], VocabParallelEmbedding)  # 21 rows over 4 ranks
    with pytest.raises(LayoutError, match="tp=4 is larger than vocab_size=3"):
        plan_tp(dataclasses.replace(LLAMA.spec, vocab_size=3), 4)


# ------------------------------------------------------------------------ training equivalence

# (model, config, dp_shard, n_microbatches)
TRAIN_CASES = [
    ("llama", dict(tp=2, dp=2), False, 2),
    ("llama", dict(tp=4), False, 1),
    ("llama", dict(pp=2, dp=2), True, 2),
    ("llama", dict(tp=2, pp=2), False, 2),
    ("llama", dict(pp=3, ranks=(3, 1, 0)), False, 4),  # rank 2 idle; permuted ranks
    ("qwen", dict(tp=2, dp=2), True, 2),
    ("qwen", dict(tp=2, pp=2), False, 4),
    ("qwen", dict(pp=2, dp=2), False, 1),
    ("odd", dict(tp=4), False, 1),
    ("odd", dict(tp=2, dp=2), True, 2),
    ("tiny_vocab", dict(tp=4), False, 1),
    ("tiny_vocab", dict(tp=2, pp=2), False, 2),
]


def _config(kw: dict) -> ParallelConfig:
    kw = dict(kw)
    ranks = kw.pop("ranks", None)
    return ParallelConfig(**kw, ranks=ranks) if ranks else ParallelConfig.on(**kw)


def _boxes(part, tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple, tuple, np.ndarray]]:
    """(name, offsets, lengths, copy of the local tensor) of every shard this rank holds.
    Results cross the process boundary as numpy arrays (torch tensors would travel as
    shared-memory handles that die with the child)."""
    return [
        (t.name, s.offsets, s.lengths, tensors[t.name].detach().numpy().copy())
        for t in part.layouts()
        for s in t.shards
        if s.rank == part.rank
    ]


def _train_case(rank: int, m: str, c: ParallelConfig, dp_shard: bool, n: int) -> dict:
    """One step of one config on this rank: what the parent compares with one process."""
    batch = make_batch(MODELS[m].spec.vocab_size)
    part = build_stage(MODELS[m], c, rank, dp_shard=dp_shard)
    init_stage(part, SEED)
    views = stage_buffers(part)
    rows = torch.tensor_split(torch.arange(B), c.dp)[part.groups.dp_index]
    mine = {k: v[rows] for k, v in batch.items()}
    loss_fn = token_loss(pair_count(batch), part.vocab)  # the global count: dp replicas' gradients add up
    loss = forward_backward(part, mine, loss_fn, n)
    local_grads = {k: v.clone() for k, v in stage_grads(part).items()}
    grads = _boxes(part, local_grads)
    logp = forward(part, mine, n_microbatches=n, output_fn=next_token_logprobs(part.vocab))  # must leave .grad alone
    logits = forward(part, mine)  # this rank's vocabulary columns
    # Accumulating over two calls (sync once) gives the one-call gradients.
    part.module.zero_grad()
    for h in torch.tensor_split(torch.arange(len(rows)), 2):
        forward_backward(part, {k: v[h] for k, v in mine.items()}, loss_fn, n // 2 or 1, sync=False)
    sync_grads(part)
    accumulated = max((stage_grads(part)[k] - g).abs().max().item() for k, g in local_grads.items())
    opt = torch.optim.AdamW(part.module.parameters(), lr=LR, eps=EPS)
    state = optimizer_buffers(part, opt)  # created before the step: the step must use these tensors
    opt.step()  # on the accumulated gradients (equal to local_grads within 1e-6)
    after = stage_buffers(part)
    live = all(after[k].data_ptr() == v.data_ptr() for k, v in views.items()) and after.keys() == views.keys()
    adam = max((state[f"optim/exp_avg/{k}"] - (1 - 0.9) * g).abs().max().item() for k, g in local_grads.items())
    adam_steps = {float(state[f"optim/step/{k}"]) for k in local_grads}
    return dict(
        dp=part.groups.dp_index, rows=rows.numpy(), loss=loss.item(), grads=grads, params=_boxes(part, after),
        logp=logp.numpy(), logits=logits.numpy(), vocab=part.vocab.start, tp=part.groups.tp_index, live=live, adam=adam, adam_steps=adam_steps,
        accumulated=accumulated,
    )


def _train_worker(rank: int, world: int) -> list:
    configs = [(m, _config(kw), shard, n) for m, kw, shard, n in TRAIN_CASES]
    for m, c, _, _ in configs:  # every rank creates every group, members or not
        stage_groups(c, MODELS[m].spec)
    return [_train_case(rank, m, c, shard, n) if rank in c.ranks else None for m, c, shard, n in configs]


def _reference(args: ModelArgs):
    model = build_model(args, "cpu")
    init_weights(model, SEED)
    batch = make_batch(args.spec.vocab_size)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    loss = token_loss(pair_count(batch))(model(batch["input_ids"], attention_mask=batch["attention_mask"]), batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(loss=loss.item(), grads=grads, params=params, logits=logits, logp=next_token_logprobs()(logits, batch))


def _assert_boxes(boxes, full: dict[str, torch.Tensor], what: str, where: str) -> None:
    seen = set()
    for name, offsets, lengths, local in boxes:
        ref, local = box_view(full[name], offsets, lengths), torch.from_numpy(local)
        assert local.shape == ref.shape, (where, what, name)
        err = (local - ref).abs().max().item() if local.numel() else 0.0
        assert err < 1e-5, f"{where}: {what} of {name} at {offsets} differs by {err}"
        seen.add(name)
    return seen


@pytest.mark.timeout(240)
def test_parallel_training_matches_single_process():
    results = run_distributed(_train_worker, 4, timeout=220)
    refs = {m: _reference(MODELS[m]) for m in MODELS if m != "value"}
    for i, (m, kw, shard, n) in enumerate(TRAIN_CASES):
        where, ref = f"{m} {kw} dp_shard={shard} n={n}", refs[m]
        per_rank = [r[i] for r in results if r[i] is not None]
        losses = {}
        names = set()
        for r in per_rank:
            assert r["live"], f"{where}: stage_buffers views moved during a step"
            assert r["adam"] < 1e-7 and r["adam_steps"] == {1.0}, (where, r["adam"], r["adam_steps"])
            assert r["accumulated"] < 1e-6, (where, r["accumulated"])
            losses[r["dp"]] = r["loss"]
            names |= _assert_boxes(r["grads"], ref["grads"], "gradient", where)
            names |= _assert_boxes(r["params"], ref["params"], "parameter after AdamW", where)
            rows = torch.from_numpy(r["rows"])
            assert (torch.from_numpy(r["logp"]) - ref["logp"][rows]).abs().max() < 1e-5, where
            logits = torch.from_numpy(r["logits"])  # vocabulary-parallel: this rank's columns only
            sizes = chunk_sizes(MODELS[m].spec.vocab_size, _config(kw).tp)
            assert (logits.shape[-1], r["vocab"]) == (sizes[r["tp"]], sum(sizes[: r["tp"]])), where
            want = ref["logits"][rows][..., r["vocab"] : r["vocab"] + logits.shape[-1]]
            torch.testing.assert_close(logits, want, rtol=0, atol=1e-5, msg=where)  # (an empty shard: empty logits)
        assert names == set(ref["grads"]), where  # every parameter was compared
        assert abs(sum(losses.values()) - ref["loss"]) < 1e-5, (where, losses, ref["loss"])  # replicas' shares add up


# ------------------------------------------------------------------------ layouts

# (model, config, dp_shard)
LAYOUT_CASES = [
    ("llama", dict(dp=4), True),
    ("llama", dict(tp=4), False),
    ("llama", dict(tp=2, pp=2), False),
    ("llama", dict(tp=2, dp=2), True),
    ("qwen", dict(pp=2, dp=2), True),
    ("qwen", dict(tp=2, pp=2), False),
    ("qwen", dict(tp=4), False),
    ("qwen", dict(tp=2, dp=2, ranks=(3, 1, 2, 0)), True),  # group rank order = config order
    ("value", dict(dp=4), True),
    ("value", dict(tp=2, dp=2), True),
    ("value", dict(tp=2, pp=2), False),
    ("odd", dict(tp=4), False),
    ("odd", dict(tp=2, dp=2), True),
    ("tiny_vocab", dict(tp=4), False),
]


UNEVEN_GATHER = ("odd", "tiny_vocab")  # also built as generation builds them (the logits gathered over TP)


def _layout_worker(rank: int, world: int) -> list:
    out = []
    if rank < 2:  # a config over part of the world, its groups not created by every rank
        with pytest.raises(ProcessGroupError, match="stage_groups"):
            build_stage(LLAMA, ParallelConfig(tp=2, ranks=(1, 0)), rank)
    for m, kw, dp_shard in LAYOUT_CASES:
        args, c = MODELS[m], _config(kw)
        batch = make_batch(args.spec.vocab_size)
        part = build_stage(args, c, rank, dp_shard=dp_shard)
        emus = derive_emus(args.spec, c, model=m, stage="train", optimizer=True, dp_shard=dp_shard)
        emu = emus[0 if dp_shard else part.groups.dp_index]
        params = [t for t in emu.tensors if not t.name.startswith("optim/")]
        want = {k: (v.shape, v.dtype) for k, v in local_buffers(params, rank).items()}
        bufs = stage_buffers(part)
        have = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in bufs.items()}
        fill_reference(bufs, params, rank)
        opt = torch.optim.AdamW(part.module.parameters())
        optim = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in optimizer_buffers(part, opt).items()}
        want_optim = {k: (v.shape, v.dtype) for k, v in local_buffers(emu.tensors, rank).items() if k.startswith("optim/")}
        rows = torch.tensor_split(torch.arange(B), c.dp)[part.groups.dp_index]
        y = forward(part, {k: v[rows] for k, v in batch.items()})  # an LM's: its vocabulary columns
        live = all(stage_buffers(part)[k].data_ptr() == v.data_ptr() for k, v in bufs.items())
        gathered = None
        if m in UNEVEN_GATHER and not dp_shard:  # generation's layout: every rank gets all V columns
            gen = build_stage(args, c, rank, vocab_parallel=False)
            fill_reference(stage_buffers(gen), params, rank)
            gathered = forward(gen, {k: v[rows] for k, v in batch.items()}).numpy()
        out.append(dict(
            want=want, have=have, optim=optim, want_optim=want_optim, rows=rows.numpy(), y=y.numpy(), live=live, vocab=part.vocab.start,
            gathered=gathered,
        ))
    return out


@pytest.mark.timeout(200)
def test_stage_buffers_match_derive_and_hold_the_weights():
    results = run_distributed(_layout_worker, 4, timeout=180)
    for i, (m, kw, dp_shard) in enumerate(LAYOUT_CASES):
        where = f"{m} {kw} dp_shard={dp_shard}"
        batch = make_batch(MODELS[m].spec.vocab_size)
        model = build_model(MODELS[m], "cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(reference_box(name, tuple(p.shape), MODELS[m].spec.dtype, (0,) * p.dim(), tuple(p.shape)))
            y = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        for rank, r in enumerate(results):
            res = r[i]
            assert res["have"] == res["want"], (where, rank)
            assert res["optim"] == res["want_optim"], (where, rank)
            assert res["live"], f"{where} rank {rank}: the first forward moved a parameter's storage"
            ref, got = y[torch.from_numpy(res["rows"])], torch.from_numpy(res["y"])
            if MODELS[m].spec.head == "lm":
                ref = ref[..., res["vocab"] : res["vocab"] + got.shape[-1]]
            err = ((got - ref).abs().max() / ref.abs().max()).item() if got.numel() else 0.0
            assert got.shape == ref.shape and err < 1e-5, f"{where} rank {rank}: output differs by {err} (relative)"
            if res["gathered"] is not None:  # uneven shards (one empty: tiny_vocab) all-gathered for sampling
                full = torch.from_numpy(res["gathered"])
                assert full.shape == y[torch.from_numpy(res["rows"])].shape, where
                err = ((full - y[torch.from_numpy(res["rows"])]).abs().max() / y.abs().max()).item()
                assert err < 1e-5, f"{where} rank {rank}: gathered logits differ by {err} (relative)"
        assert (m not in UNEVEN_GATHER or dp_shard) or all(r[i]["gathered"] is not None for r in results), where

