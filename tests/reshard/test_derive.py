"""Derivation of EMUs from a decoder description and a parallel config."""

import pytest
import torch

from nereus.reshard.derive import check_tp, derive_emus, plan_layer_ranges, plan_parameters, vocab_range, vocab_shard_rows
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import ParallelConfig, emu_from_dict, emu_to_dict, local_buffers

from .strategies import tiny_spec

HF_LLAMA_ONE_LAYER = [
    "model.embed_tokens.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def test_parameter_names_are_huggingface_llama_names():
    names = [p[0] for p in plan_parameters(tiny_spec(num_layers=1))]
    assert sorted(names) == sorted(HF_LLAMA_ONE_LAYER)


def test_qwen2_style_biases_and_tied_embeddings():
    names = {p[0] for p in plan_parameters(tiny_spec(num_layers=1, qkv_bias=True, tie_embeddings=True))}
    assert "lm_head.weight" not in names
    assert {f"model.layers.0.self_attn.{m}_proj.bias" for m in "qkv"} <= names


def test_value_head_replaces_lm_head():
    names = {p[0] for p in plan_parameters(tiny_spec(num_layers=1, head="value"))}
    assert "score.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("layers, pp, sizes", [(4, 2, [2, 2]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (3, 3, [1, 1, 1])])
def test_layer_ranges_are_contiguous_and_balanced(layers, pp, sizes):
    ranges = plan_layer_ranges(layers, pp)
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(layers))


@pytest.mark.parametrize(
    "spec_kwargs, tp, pp, message",
    [
        ({}, 3, 1, "tp=3 does not divide num_heads=4"),
        ({}, 1, 5, "pp=5 is larger than the number of layers"),
        (dict(vocab_size=3), 4, 1, "tp=4 is larger than vocab_size=3"),
        (dict(num_heads=6, num_kv_heads=3, hidden_size=48), 2, 1, "num_kv_heads=3"),
    ],
)
def test_layouts_that_do_not_fit_the_model_are_rejected(spec_kwargs, tp, pp, message):
    with pytest.raises(LayoutError, match=message):
        derive_emus(tiny_spec(**spec_kwargs), ParallelConfig.on(tp=tp, pp=pp), model="a", stage="s")


@pytest.mark.parametrize("vocab, tp, rows", [
    (64, 4, [16, 16, 16, 16]),
    (21, 2, [11, 10]),
    (21, 4, [6, 6, 6, 3]),
    (50257, 4, [12565, 12565, 12565, 12562]),  # GPT-2's vocabulary
    (5, 4, [2, 2, 1, 0]),  # V <= (tp - 1)**2: the last rank's shard may be empty
])
def test_vocab_shards_are_torch_chunk_pieces_of_the_real_vocabulary(vocab, tp, rows):
    """No padding: the TP shards of embed_tokens/lm_head are torch.chunk (DTensor Shard(0))
    of the V real rows, the last shorter or empty; an empty shard is no shard at all."""
    assert [len(c) for c in torch.arange(vocab).chunk(tp)] == [r for r in rows if r]  # torch's own rule, the oracle
    assert [vocab_range(vocab, tp, t)[1] - vocab_range(vocab, tp, t)[0] for t in range(tp)] == rows
    assert vocab_shard_rows(vocab, tp) == max(rows)
    spec = tiny_spec(vocab_size=vocab)
    check_tp(spec, tp)
    (emu,) = derive_emus(spec, ParallelConfig.on(tp=tp), model="a", stage="train", optimizer=True)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "optim/exp_avg/lm_head.weight"):
        layout = emu.tensor(name)
        assert layout.shape == (vocab, 32)
        assert [(s.rank, s.offsets[0], s.lengths[0]) for s in layout.shards] == [
            (t, sum(rows[:t]), n) for t, n in enumerate(rows) if n
        ]
    holders = {s.rank for s in emu.tensor("optim/step/lm_head.weight").shards}
    assert holders == {t for t, n in enumerate(rows) if n}
    emu_from_dict(emu_to_dict(emu))  # the validating constructor: the shards tile the V rows exactly


def test_kv_heads_fewer_than_tp_are_replicated_like_vllm():
    spec = tiny_spec(num_heads=8, num_kv_heads=2, hidden_size=64)  # head_dim 8
    (emu,) = derive_emus(spec, ParallelConfig.on(tp=8), model="a", stage="gen")
    k = emu.tensor("model.layers.0.self_attn.k_proj.weight")
    heads = {s.rank: s.offsets[0] // 8 for s in k.shards}
    assert heads == {r: r // 4 for r in range(8)}
    assert all(s.lengths == (8, 64) for s in k.shards)


def test_pipeline_stages_hold_their_layers_and_the_tied_embedding_copy():
    spec = tiny_spec(tie_embeddings=True)
    (emu,) = derive_emus(spec, ParallelConfig.on(tp=2, pp=2), model="a", stage="train")
    assert {s.rank for s in emu.tensor("model.layers.0.mlp.up_proj.weight").shards} == {0, 1}
    assert {s.rank for s in emu.tensor("model.layers.3.mlp.up_proj.weight").shards} == {2, 3}
    assert {s.rank for s in emu.tensor("model.norm.weight").shards} == {2, 3}
    assert {s.rank for s in emu.tensor("model.embed_tokens.weight").shards} == {0, 1, 2, 3}


def test_dp_sharded_state_chunks_each_tp_shard_like_torch_chunk():
    spec = tiny_spec(intermediate_size=40)
    (emu,) = derive_emus(spec, ParallelConfig.on(dp=3, tp=2), model="a", stage="train", optimizer=True, dp_shard=True)
    up = emu.tensor("model.layers.0.mlp.up_proj.weight")  # (40, 32), tp rows 20 each, then 3 dp chunks
    full = torch.arange(40 * 32).view(40, 32)
    for t in range(2):
        tp_local = full[t * 20 : (t + 1) * 20]
        for d, chunk in enumerate(torch.chunk(tp_local, 3, dim=0)):
            (shard,) = [s for s in up.shards if s.rank == d * 2 + t]
            got = full[shard.offsets[0] : shard.offsets[0] + shard.lengths[0]]
            assert torch.equal(got, chunk)
    step = emu.tensor("optim/step/model.layers.0.mlp.up_proj.weight")
    assert step.shape == () and {s.rank for s in step.shards} == set(range(6))


def test_fused_rollout_layout_stacks_q_k_v_and_gate_up_per_tp_rank():
    spec = tiny_spec(qkv_bias=True)  # q 32 rows, k/v 16 rows
    (emu,) = derive_emus(spec, ParallelConfig.on(tp=2), model="a", stage="gen", fused=True)
    specs = local_buffers(emu.tensors, rank=1)
    assert specs["model.layers.2.self_attn.qkv_proj.weight"].shape == (16 + 8 + 8, 32)
    assert specs["model.layers.2.self_attn.qkv_proj.bias"].shape == (32,)
    assert specs["model.layers.2.mlp.gate_up_proj.weight"].shape == (64, 32)
    v = [s for s in emu.tensor("model.layers.2.self_attn.v_proj.weight").shards if s.rank == 1][0]
    assert (v.buffer, v.row, v.offsets) == ("model.layers.2.self_attn.qkv_proj.weight", 24, (8, 0))
    assert "model.layers.2.self_attn.q_proj.weight" not in specs


def test_fused_and_dp_sharded_together_is_rejected():
    with pytest.raises(LayoutError, match="fused"):
        derive_emus(tiny_spec(), ParallelConfig.on(dp=2), model="a", stage="gen", fused=True, dp_shard=True)


@pytest.mark.parametrize("dp, tp, pp", [(1, 1, 1), (2, 2, 1), (1, 4, 2), (2, 1, 4), (3, 2, 2)])
@pytest.mark.parametrize("kwargs", [dict(optimizer=True), dict(optimizer=True, dp_shard=True), dict(fused=True)])
@pytest.mark.parametrize("vocab", [64, 9])  # 9 rows over tp=4: 3, 3, 3 and an empty shard
def test_every_derived_emu_covers_every_tensor_exactly(dp, tp, pp, kwargs, vocab):
    spec = tiny_spec(qkv_bias=True, tie_embeddings=True, dtype="bfloat16", vocab_size=vocab)
    emus = derive_emus(spec, ParallelConfig.on(dp=dp, tp=tp, pp=pp), model="a", stage="s", **kwargs)
    assert len(emus) == (1 if kwargs.get("dp_shard") else dp)
    for emu in emus:
        emu_from_dict(emu_to_dict(emu))  # the validating constructor checks coverage
        for rank in emu.ranks:
            local_buffers(emu.tensors, rank)  # fused pieces tile their buffers
