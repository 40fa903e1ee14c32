"""Hypothesis strategies and small builders for layouts, shared by the reshard tests."""

from __future__ import annotations

import itertools

from hypothesis import strategies as st

from nereus.reshard.derive import DecoderSpec
from nereus.reshard.layout import EMU, ParallelConfig, Shard, TensorLayout


def tiny_spec(**overrides) -> DecoderSpec:
    """A Llama-shaped decoder small enough to reshard in milliseconds (GQA, untied)."""
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2
    )
    fields.update(overrides)
    return DecoderSpec(**fields)


@st.composite
def grid_layouts(draw, name: str = "t", world: int = 4, dtype: str = "float32", shape=None, min_size: int = 1) -> TensorLayout:
    """A random tensor cut into a grid of boxes, each box on 1..3 random ranks
    (``min_size=0``: dimensions may be empty).

    A rank may hold several boxes of the tensor: each box then is a buffer of its own,
    named after the box, unless it is the rank's only box (a plain buffer).
    """
    if shape is None:
        shape = tuple(draw(st.integers(min_size, 7)) for _ in range(draw(st.integers(0, 3))))
    cuts = []
    for size in shape:
        inner = draw(st.lists(st.integers(1, size - 1), max_size=2, unique=True)) if size > 1 else []
        points = [0, *sorted(inner), size]
        cuts.append([(a, b - a) for a, b in zip(points, points[1:])])
    shards = []
    for cell in itertools.product(*cuts):
        offsets = tuple(o for o, _ in cell)
        lengths = tuple(n for _, n in cell)
        ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3, unique=True))
        shards += [(r, offsets, lengths) for r in ranks]
    boxes_per_rank = {r: sum(1 for s in shards if s[0] == r) for r, _, _ in shards}
    return TensorLayout(
        name=name,
        shape=shape,
        dtype=dtype,
        shards=tuple(
            Shard(rank=r, offsets=o, lengths=n, buffer=f"{name}{list(o)}" if boxes_per_rank[r] > 1 else "")
            for r, o, n in shards
        ),
    )


def emu_of(layouts: list[TensorLayout], world: int, stage: str = "s") -> EMU:
    """One EMU over ranks 0..world-1 holding these layouts."""
    config = ParallelConfig.on(dp=world)
    return EMU(model="m", stage=stage, replica=0, config=config, ranks=config.ranks, tensors=tuple(layouts))


configs = st.builds(
    lambda dp, tp, pp: (dp, tp, pp),
    st.sampled_from([1, 2]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([1, 2]),
)


def simulate(plan, seed: int = 0) -> dict[int, dict]:
    """Run a plan in one process: every rank's buffers, filled through the plan's views."""
    from nereus.reshard.plan import STAGED
    from nereus.reshard.reference import make_buffers, reference_state

    src_ranks = {t.src_rank for t in plan.transfers} - {STAGED}
    src = {r: reference_state(plan.src_layouts.values(), r, seed) for r in src_ranks}
    staged = {STAGED: _whole_tensors(plan, seed)}
    dst = {r: make_buffers(specs) for r, specs in plan.dst_buffers.items()}
    for t in plan.transfers:
        if t.src_rank == STAGED:
            region = _staged_region(staged[STAGED], t)
        else:
            region = t.src_view(src[t.src_rank])
        t.dst_view(dst[t.dst_rank]).copy_(region)
    return dst


def _whole_tensors(plan, seed):
    from nereus.reshard.reference import reference_box

    return {
        name: reference_box(name, t.shape, t.dtype, (0,) * len(t.shape), t.shape, seed)
        for name, t in plan.src_layouts.items()
    }


def _staged_region(whole, t):
    from nereus.reshard.layout import box_view

    offsets = tuple(a + b for a, b in zip(t.item.storage_index.offset, t.item.storage_offsets))
    return box_view(whole[t.tensor], offsets, tuple(t.item.lengths))
