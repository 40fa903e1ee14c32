"""Layouts and EMUs: validation, buffers, and a lossless JSON round trip."""

import json

import pytest
import torch
from hypothesis import given, settings

from nereus.reshard.derive import derive_emus
from nereus.reshard.errors import LayoutError
from nereus.reshard.layout import (
    ParallelConfig,
    Shard,
    TensorLayout,
    emu_from_dict,
    emu_to_dict,
    local_buffers,
    shard_view,
)

from .strategies import configs, emu_of, grid_layouts, tiny_spec


def test_parallel_config_orders_tp_fastest_then_pp_then_dp():
    cfg = ParallelConfig(dp=2, tp=2, pp=2, ranks=tuple(range(10, 18)))
    assert cfg.rank(dp=0, pp=0, tp=1) == 11
    assert cfg.rank(dp=0, pp=1, tp=0) == 12
    assert cfg.rank(dp=1, pp=0, tp=0) == 14
    assert cfg.replica_ranks(1) == (14, 15, 16, 17)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dp=2, tp=2, ranks=(0, 1, 2)), "needs 4 ranks"),
        (dict(tp=2, ranks=(0, 0)), "distinct"),
        (dict(tp=0, ranks=()), "tp=0"),
    ],
)
def test_parallel_config_rejects_bad_input(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        ParallelConfig(**kwargs)


def test_shard_out_of_bounds_names_tensor_and_rank():
    with pytest.raises(LayoutError, match=r"'w'.*rank 3.*exceeds shape"):
        TensorLayout(name="w", shape=(4, 4), dtype="float32", shards=(Shard(rank=3, offsets=(2, 0), lengths=(3, 4)),))


def test_unknown_dtype_is_rejected():
    with pytest.raises(LayoutError, match="unsupported dtype"):
        TensorLayout(name="w", shape=(2,), dtype="complex64", shards=())


@pytest.mark.parametrize(
    "shards, message",
    [
        ([((0, 0), (2, 4)), ((0, 0), (3, 4))], "partially overlapping"),
        ([((0, 0), (2, 4))], "cover 8 of 16"),
    ],
)
def test_emu_rejects_overlapping_or_missing_regions(shards, message):
    layout = TensorLayout(
        name="w", shape=(4, 4), dtype="float32", shards=tuple(Shard(rank=i, offsets=o, lengths=n) for i, (o, n) in enumerate(shards))
    )
    with pytest.raises(LayoutError, match=message):
        emu_of([layout], world=2)


def test_emu_rejects_shard_outside_its_ranks():
    layout = TensorLayout(name="w", shape=(2,), dtype="float32", shards=(Shard(rank=5, offsets=(0,), lengths=(2,)),))
    with pytest.raises(LayoutError, match="rank 5, outside"):
        emu_of([layout], world=2)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_derived_emus_round_trip_through_json(cfg):
    dp, tp, pp = cfg
    spec = tiny_spec(qkv_bias=True, tie_embeddings=True)
    config = ParallelConfig.on(dp=dp, tp=tp, pp=pp)
    for kwargs in (dict(optimizer=True), dict(optimizer=True, dp_shard=True), dict(fused=True)):
        for emu in derive_emus(spec, config, model="actor", stage="train", **kwargs):
            text = json.dumps(emu_to_dict(emu))
            back = emu_from_dict(json.loads(text))  # validates coverage too
            assert back == emu
            assert back.tensor("model.norm.weight") == emu.tensor("model.norm.weight")


@settings(max_examples=30, deadline=None)
@given(grid_layouts(world=4))
def test_random_grid_layout_round_trips(layout):
    emu = emu_of([layout], world=4)
    assert emu_from_dict(json.loads(json.dumps(emu_to_dict(emu)))) == emu


def test_unknown_schema_version_is_rejected():
    emu = emu_of([TensorLayout(name="w", shape=(1,), dtype="float32", shards=(Shard(rank=0, offsets=(0,), lengths=(1,)),))], 1)
    data = emu_to_dict(emu) | {"schema": 99}
    with pytest.raises(LayoutError, match="schema 99"):
        emu_from_dict(data)


def fused_layouts(rows_b: int, row_b: int):
    a = TensorLayout(name="a", shape=(2, 3), dtype="float32", shards=(Shard(rank=0, offsets=(0, 0), lengths=(2, 3), buffer="ab", row=0),))
    b = TensorLayout(name="b", shape=(rows_b, 3), dtype="float32", shards=(Shard(rank=0, offsets=(0, 0), lengths=(rows_b, 3), buffer="ab", row=row_b),))
    return a, b


def test_fused_buffer_spec_and_views():
    a, b = fused_layouts(rows_b=4, row_b=2)
    spec = local_buffers([a, b], rank=0)["ab"]
    assert spec.shape == (6, 3)
    buf = {"ab": torch.arange(18.0).view(6, 3)}
    assert torch.equal(shard_view(buf, b, b.shards[0]), torch.arange(6.0, 18.0).view(4, 3))


def test_fused_buffer_with_a_gap_is_rejected():
    a, b = fused_layouts(rows_b=4, row_b=3)
    with pytest.raises(LayoutError, match=r"'b' starts at row 3, expected 2"):
        local_buffers([a, b], rank=0)


def test_fused_buffer_mixing_dtypes_is_rejected():
    a, _ = fused_layouts(rows_b=4, row_b=2)
    b = TensorLayout(name="b", shape=(4, 3), dtype="bfloat16", shards=(Shard(rank=0, offsets=(0, 0), lengths=(4, 3), buffer="ab", row=2),))
    with pytest.raises(LayoutError, match="mixes dtypes"):
        local_buffers([a, b], rank=0)
